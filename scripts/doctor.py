"""Check a machine or a cluster before training on it: versions, devices, the network, the collectives.

    make doctor                                     # this host, 2 processes (ddp.yaml)
    make doctor CONFIG=accelerate_configs/multi_node_ddp.yaml \\
        LAUNCH_ARGS="--machine_rank 0 --main_process_ip 10.0.0.1"   # on each node, its own rank

`make doctor` runs this script without a launcher: it checks that this node can reach the main
node (a bounded wait, not a hang), then starts `accelerate launch` on this script with the
same config. Launched that way (or by hand, like a recipe), every rank reports its versions,
device and distributed environment, and then all ranks test the collectives together:
all_reduce, all_gather, reduce_scatter and broadcast give the right answers, and all_reduce
is timed over a range of sizes (algbw and busbw as nccl-tests report them: busbw =
algbw * 2(n-1)/n), all_gather and reduce_scatter at the two largest (busbw = algbw * (n-1)/n).
A failure ends in one line that names the likely cause (the main node unreachable, a wrong
network interface, versions that differ between nodes) and exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path


ENV_PREFIXES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_",
    "GLOO_",
    "TORCHELASTIC_",
    "ACCELERATE_USE_",
    "ACCELERATE_MIXED_PRECISION",
    "OMP_NUM_THREADS",
)
REPO = Path(__file__).resolve().parents[1]
WORKER = "RECIPES_DOCTOR_WORKER"  # set for the launched copies of this script


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


# ---- what this host has ----------------------------------------------------------------------


def devices() -> dict:
    import torch

    info = {"cpu_cores": os.cpu_count(), "gpus": []}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["gpus"].append(
                {
                    "name": props.name,
                    "memory_gb": round(props.total_memory / 1e9, 1),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
        info["cuda"] = torch.version.cuda
        with contextlib.suppress(Exception):
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        with contextlib.suppress(Exception):
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()[0]
    return info


def distributed_env() -> dict:
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(ENV_PREFIXES) and k not in ("TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE")
    }


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one (Linux ioctl SIOCGIFADDR)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                found[name] = socket.inet_ntoa(packed[20:24])
    return found


def network(main_address: str) -> dict:
    """How this host reaches the main node, and which address gloo/NCCL will announce to peers."""
    info = {"main_node": main_address, "hostname": socket.gethostname(), "interfaces": interface_addresses()}
    with contextlib.suppress(OSError):
        info["hostname_address"] = socket.gethostbyname(info["hostname"])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # no packet is sent
            sock.connect((socket.gethostbyname(main_address), 9))
            info["route_address"] = sock.getsockname()[0]
        info["route_interface"] = next((n for n, a in info["interfaces"].items() if a == info["route_address"]), None)
    except OSError as error:
        info["route_error"] = error.strerror or str(error)
    info["socket_ifname"] = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    return info


def network_problem(net: dict, multi_host: bool) -> str | None:
    """The likely cause, from this host's side, of peers failing to connect; None when none is seen."""
    main = net["main_node"]
    if "route_error" in net:
        return (
            f"this host has no route to the main node {main} ({net['route_error']}): check the address, that this "
            "node's network link is up, and the routes (`ip route get " + main + "`)"
        )
    ifname = net["socket_ifname"]
    if ifname and ifname.split(",")[0] not in net["interfaces"]:
        return (
            f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME is {ifname}, which this host does not have (it has "
            f"{', '.join(net['interfaces'])}): set it to the interface that reaches {main}"
            f" ({net.get('route_interface')})"
        )
    announced = net["interfaces"].get(ifname) if ifname else net.get("hostname_address")
    if multi_host and announced and announced.startswith("127.") and not main.startswith("127."):
        return (
            f"this host announces {announced} (its hostname {net['hostname']} resolves to loopback) to peers on "
            f"other hosts, which cannot reach it there: set GLOO_SOCKET_IFNAME={net.get('route_interface')} "
            f"(NCCL_SOCKET_IFNAME for NCCL), the interface with {net.get('route_address')} that reaches {main}"
        )
    return None


def wait_for_main_node(address: str, port: int, timeout: float) -> str | None:
    """Connect to the main node's rendezvous port until it answers; the reason when it never does."""
    deadline, last = time.time() + timeout, "no answer"
    while time.time() < deadline:
        try:
            with socket.create_connection((address, port), timeout=min(5.0, max(0.1, deadline - time.time()))):
                return None
        except OSError as error:
            last = error.strerror or str(error)
            if error.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH) or isinstance(error, socket.gaierror):
                return last
        time.sleep(0.5)
    return f"{last} for {timeout:.0f} s"


# ---- the collectives -------------------------------------------------------------------------


def check_collectives(dist, device, world: int, rank: int) -> dict:
    """Each collective on values whose right answer every rank can compute."""
    import torch

    results = {}
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    results["all_reduce"] = bool(torch.all(x == world * (world + 1) / 2))
    gathered = torch.empty(world * 2, device=device)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(
        gathered, torch.full((2,), float(rank), device=device)
    )
    results["all_gather"] = torch.equal(gathered, torch.arange(world, device=device).float().repeat_interleave(2))
    contribution = torch.arange(world * 2, device=device).float() * (rank + 1)
    shard = torch.empty(2, device=device)
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(shard, contribution)
    expected = torch.arange(rank * 2, rank * 2 + 2, device=device).float() * (world * (world + 1) / 2)
    results["reduce_scatter"] = torch.equal(shard, expected)
    y = torch.full((3,), 7.0 if rank == 0 else -1.0, device=device)
    dist.broadcast(y, src=0)
    results["broadcast"] = bool(torch.all(y == 7.0))
    agreed = torch.tensor([float(v) for v in results.values()], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # a check passes only when it passed on every rank
    return {name: bool(ok) for name, ok in zip(results, agreed.tolist())}


def time_collective(dist, device, world: int, sizes: list[int], iterations: int, op: str = "all_reduce") -> list[dict]:
    """nccl-tests' *_perf figures for one collective: the slowest rank's time per call, algbw (bytes: the
    whole buffer, an all_gather's output or a reduce_scatter's input) and busbw (algbw * 2(n-1)/n for
    all_reduce, * (n-1)/n for all_gather and reduce_scatter)."""
    import torch

    rows = []
    for size in sizes:
        numel = max(1, size // 4) if op == "all_reduce" else max(world, size // 4 // world * world)
        whole = torch.ones(numel, device=device)
        part = torch.empty(whole.numel() // world, device=device)
        call = {
            "all_reduce": lambda: dist.all_reduce(whole),
            "all_gather": lambda: dist.all_gather_into_tensor(whole, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole),
        }[op]
        repeats = max(2, min(iterations, int(iterations * 2**20 / max(size, 2**20))))
        for _ in range(2):
            call()
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([(time.perf_counter() - start) / repeats], device=device, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = elapsed.item()
        algbw = whole.numel() * 4 / seconds / 1e9
        factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
        rows.append(
            {"bytes": whole.numel() * 4, "time_us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * factor}
        )
    return rows


def version_mismatches(reports: list[dict]) -> list[str]:
    """'torch: 2.13.0 on ranks 0-1 (host a), 2.12.0 on rank 2 (host b)' for each package that differs."""
    found = []
    for name in reports[0]["versions"]:
        by_version: dict = {}
        for report in reports:
            by_version.setdefault(report["versions"][name], []).append(report)
        if len(by_version) > 1:
            parts = [
                f"{version} on rank{'s' if len(rs) > 1 else ''} {','.join(str(r['rank']) for r in rs)} "
                f"(host {', '.join(sorted({r['host'] for r in rs}))})"
                for version, rs in by_version.items()
            ]
            found.append(f"{name}: " + "; ".join(parts))
    return found


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 64K, 16M or 1G")
    return int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)]


def worker(args) -> None:
    """One launched rank: report, then test the collectives with every other rank."""
    import torch
    import torch.distributed as dist

    from common.launch.accelerator import more_processes_than_gpus
    from common.launch.peers import free_port
    from common.outputs.run_info import package_versions

    if "RANK" not in os.environ:  # a one-process config: accelerate starts the script without torchrun
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    main = os.environ.get("MASTER_ADDR", "127.0.0.1")
    use_gpu = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "false").lower() != "true"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_gpu else torch.device("cpu")
    too_many = more_processes_than_gpus(local_world, torch.cuda.device_count()) if use_gpu else None
    if too_many:
        fail(f"rank {rank}: {too_many}")
    if use_gpu:
        torch.cuda.set_device(device)
    net = network(main)
    report = {
        "rank": rank,
        "host": net["hostname"],
        "address": net.get("route_address"),
        "versions": package_versions(),
        "devices": devices(),
        "env": distributed_env(),
        "network": net,
    }
    problem = network_problem(net, multi_host=world > local_world)
    if problem:
        fail(f"rank {rank}: {problem}")
    backend = "nccl" if use_gpu else "gloo"
    try:
        dist.init_process_group(
            backend, timeout=timedelta(seconds=args.timeout), device_id=device if use_gpu else None
        )
        reports = [None] * world
        dist.all_gather_object(reports, report)
        checks = check_collectives(dist, device, world, rank)
        sizes = [s for s in (2**k for k in range(2, 40, 2)) if s <= args.max_size] if world > 1 else []
        bandwidth = time_collective(dist, device, world, sizes, args.iterations)
        # the sharded strategies' collectives, at the largest sizes (make choose-config reads them)
        gathers = {
            op: time_collective(dist, device, world, sizes[-2:], args.iterations, op)
            for op in ("all_gather", "reduce_scatter")
        }
    except Exception as error:  # every failure inside the process group gets its cause named
        from common.launch.peers import lost_peer_message

        fail(
            lost_peer_message(error, args.timeout)
            or f"rank {rank}: a collective failed ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        )
    if rank == 0:
        mismatches = version_mismatches(reports)
        summary = {
            "world_size": world,
            "hosts": sorted({r["host"] + "@" + str(r["address"]) for r in reports}),
            "backend": backend,
            "ranks": reports,
            "collectives": checks,
            "all_reduce": bandwidth,
            **gathers,
            "version_mismatches": mismatches,
        }
        print_summary(summary)
        if args.report:
            Path(args.report).parent.mkdir(parents=True, exist_ok=True)
            Path(args.report).write_text(json.dumps(summary, indent=1))
        problems = [f"{name} gave a wrong result" for name, ok in checks.items() if not ok]
        problems += [f"versions differ between ranks: {m}" for m in mismatches]
        if problems:
            fail("; ".join(problems) + " (install the same versions on every node, then run make doctor again)")
    dist.barrier()
    dist.destroy_process_group()


def print_summary(summary: dict) -> None:
    ranks = summary["ranks"]
    print(
        f"doctor: {summary['world_size']} ranks on {len(summary['hosts'])} host(s) {', '.join(summary['hosts'])}, "
        f"backend {summary['backend']}"
    )
    print("versions (rank 0): " + ", ".join(f"{k} {v}" for k, v in ranks[0]["versions"].items()))
    for r in ranks:
        gpus = ", ".join(f"{g['name']} {g['memory_gb']} GB" for g in r["devices"]["gpus"]) or "no GPU"
        extra = "".join(f", {k} {r['devices'][k]}" for k in ("driver", "cuda", "nccl") if k in r["devices"])
        env = " ".join(f"{k}={v}" for k, v in r["env"].items())
        print(
            f"rank {r['rank']} on {r['host']} ({r['address']} via {r['network'].get('route_interface')}): "
            f"{r['devices']['cpu_cores']} CPU cores, {gpus}{extra}\n    {env}"
        )
    print("collectives: " + ", ".join(f"{k} {'ok' if ok else 'WRONG'}" for k, ok in summary["collectives"].items()))
    if summary["world_size"] == 1:
        print("all_reduce not timed: one rank, nothing crosses a link (launch 2 or more processes to time it)")
        return
    print(
        f"all_reduce over {summary['world_size']} ranks:\n{'bytes':>12} {'time_us':>10} {'algbw_GB/s':>11} "
        f"{'busbw_GB/s':>11}"
    )
    for row in summary["all_reduce"]:
        print(f"{row['bytes']:>12} {row['time_us']:>10.1f} {row['algbw_gbps']:>11.3g} {row['busbw_gbps']:>11.3g}")
    for op in ("all_gather", "reduce_scatter"):
        if summary.get(op):
            print(
                f"{op}: "
                + ", ".join(f"busbw {row['busbw_gbps']:.3g} GB/s at {row['bytes']} bytes" for row in summary[op])
            )
    if summary["version_mismatches"]:
        print("versions differ: " + "; ".join(summary["version_mismatches"]))


# ---- make doctor: the check before the launch, then the launch ------------------------------


def launch(args, launcher_args: list[str]) -> None:
    """Check that this node reaches the main node, then launch the workers; one line if they cannot meet."""
    import yaml

    config = yaml.safe_load(Path(args.config_file).read_text()) or {}
    given = argparse.ArgumentParser(add_help=False)
    for name in ("machine_rank", "num_machines", "main_process_ip", "main_process_port"):
        given.add_argument(f"--{name}", default=config.get(name))
    known, _ = given.parse_known_args(launcher_args)
    machines, machine_rank = int(known.num_machines or 1), int(known.machine_rank or 0)
    if machines > 1:
        main, port = str(known.main_process_ip), int(known.main_process_port or 29500)
        if main.startswith("FILL") or main == "None":
            fail(
                f'{args.config_file} has no main node address: pass LAUNCH_ARGS="--main_process_ip <address of '
                "the node with machine_rank 0> --machine_rank <this node's rank>\""
            )
        net = network(main)
        if (
            machine_rank == 0
            and net.get("route_address")
            and net["route_address"] != socket.gethostbyname(main)
            and socket.gethostbyname(main) not in net["interfaces"].values()
        ):
            fail(
                f"this node runs machine_rank 0 but {main} is not one of its addresses "
                f"({', '.join(net['interfaces'].values())}): run machine_rank 0 on the main node, or fix "
                "--main_process_ip"
            )
        problem = network_problem(net, multi_host=True)
        if problem:
            fail(f"machine_rank {machine_rank}: {problem}")
        if machine_rank > 0 and (reason := wait_for_main_node(main, port, args.timeout)):
            fail(
                f"machine_rank {machine_rank} cannot reach the main node {main}:{port} ({reason}): start machine_rank"
                f" 0 there first, and check the address, the port and any firewall between the nodes"
            )
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [
        str(accelerate),
        "launch",
        "--rdzv_conf",
        f"timeout={int(args.timeout)}",
        "--config_file",
        args.config_file,
        *launcher_args,
        __file__,
        "--timeout",
        str(args.timeout),
        "--iterations",
        str(args.iterations),
        *(["--max_size", str(args.max_size)] if args.max_size else []),
        *(["--report", args.report] if args.report else []),
    ]
    process = subprocess.Popen(
        command,
        env={**os.environ, WORKER: "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        stderr=subprocess.PIPE,
        text=True,
    )
    errors = []
    for line in process.stderr:  # passed through as it comes, kept to name the cause
        sys.stderr.write(line)
        errors.append(line)
    process.wait()
    errors = "".join(errors)
    if process.returncode != 0 and not re.search(r"^error: ", errors, re.MULTILINE):
        joined = re.search(r"(\d+)/(\d+) clients joined", errors)
        if joined:
            fail(
                f"the main node waited {args.timeout:.0f} s and only {joined.group(1)} of {joined.group(2)} nodes "
                "joined: start `make doctor` on every node with its own --machine_rank, and check that they reach "
                "this node's --main_process_ip and port"
            )
        fail(f"the launch failed (exit {process.returncode}) before the workers could report; see the output above")
    sys.exit(process.returncode)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--config_file",
        default="accelerate_configs/ddp.yaml",
        help="accelerate config to launch with (run without a launcher)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120,
        help="seconds to wait for the main node and for each collective before naming the cause",
    )
    parser.add_argument(
        "--max_size",
        type=parse_size,
        default=None,
        help="largest all_reduce timed, e.g. 64M (default 1G on GPU, 16M on CPU)",
    )
    parser.add_argument("--iterations", type=int, default=20, help="timed calls per size (fewer above 1 MB)")
    parser.add_argument("--report", default=None, help="also write the rank-0 summary here as JSON")
    args, launcher_args = parser.parse_known_args(argv)
    if os.environ.get(WORKER) or ("RANK" in os.environ and "LOCAL_RANK" in os.environ):
        if launcher_args:
            fail(f"unknown arguments {' '.join(launcher_args)}")
        if args.max_size is None:
            import torch

            args.max_size = 2**30 if torch.cuda.is_available() else 2**24
        sys.path.insert(0, str(REPO))
        worker(args)
    else:
        if not Path(args.config_file).is_file():
            fail(f"--config_file {args.config_file} does not exist: pass one of accelerate_configs/*.yaml")
        launch(args, launcher_args)


if __name__ == "__main__":
    main()
