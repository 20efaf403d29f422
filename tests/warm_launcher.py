"""The tests' warm launcher: each rank forked from one process that has already imported what a rank imports.

    python tests/warm_launcher.py serve SOCKET          # tests/conftest.py starts one per test session
    python tests/warm_launcher.py --config_file accelerate_configs/ddp.yaml recipes/sft.py ...   # `accelerate
        launch`'s arguments, through the session's server (WARM_LAUNCHER_SOCKET): make's LAUNCH for a test

Most of a test's launch is start-up: the launcher's CLI, and in every rank the imports (torch, transformers, datasets,
deepspeed) and the compilation of `common/`. Here the server imports all of that once and runs no torch compute (no
thread pool exists to be copied half-made into a fork). For each launch it forks a manager, which runs accelerate's
own `launch_command` with the launch's arguments and environment, up to the point where accelerate hands torchrun its
namespace (`common.launch.internals.torchrun_replaced`): there the manager builds each rank's environment as torchrun's
agent does (torch.distributed.run's config, the agent's variables, its store on MASTER_PORT), forks one fresh child per
rank and runs the recipe in it as `__main__`. When a rank fails the others are ended (SIGTERM, then SIGKILL), as
torchrun's agent ends them; the exit status is accelerate launch's (0, or 1 when a rank failed).

What it cannot start it refuses, so the caller launches for real: more than one machine, restarts or a rendezvous
other than torchrun's static one, accelerate's simple launcher (one process without torchrun), a config whose
pipeline or expert-parallel size accelerate does not export (pp.yaml, dp_pp.yaml, ep.yaml, fsdp_ep.yaml: a rank reads
them from its launcher's command line, common/launch/mesh.py), and an environment that differs from the server's in
a variable a library reads at import (HF_*, TORCH*, PYTHON*, ...). tests/test_warm_launcher.py holds each rank's
environment, command line and sys.path against a real launch's for every config it starts.

Known differences from a real rank, none of which the recipes read: every rank of every launch shares the server's
string-hash seed (a real launch draws one per process), and its threads and signal handlers are the server's.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
SOCKET_ENV = "WARM_LAUNCHER_SOCKET"
# Variables libraries read once, at import (huggingface_hub's offline switch, torch's and OpenMP's settings, Python's
# own): the forked ranks hold the server's values, so a launch whose environment differs in one is launched for real.
# OMP_NUM_THREADS is set in each rank (torch.set_num_threads), as torchrun's agent exports it.
IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TORCH", "PYTORCH_", "KMP_", "MKL_", "GOMP_",
               "OMP_", "OPENBLAS_", "MALLOC_", "GLIBC_", "DS_", "PYTHON", "LD_", "CUDA", "NCCL_", "GLOO_", "TOKENIZERS_",
               "XDG_", "HOME", "ACCELERATE_ENABLE_RICH")  # fmt: skip
# read when a launch or a rank starts, not at import: OMP_NUM_THREADS is set in each rank (torch.set_num_threads) as
# torchrun's agent exports it; torchrun reads the rendezvous store switch when it starts the agent
LAUNCH_TIME = {"OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
UNEXPORTED = ("parallelism_config_pp_size", "parallelism_config_pp_schedule", "parallelism_config_ep_size")
TERMINATE_GRACE_S = 30.0  # torchrun's agent: SIGTERM, then SIGKILL after 30 s
READY = "warm launcher ready: "
START_TIMEOUT_S = 300.0  # the server's imports (seen: 4-6 s)
BASE_PATH = sys.path[1:]  # the interpreter's own sys.path, without this script's folder


def import_time_differences(env: dict, server_env: dict, imported: dict, explicit=()) -> list[str]:
    """The variables read at import whose value in `env` is not the server's. Not counted: one the server's imports
    set (`imported`), absent or holding their value; one the server never had that the caller did not set itself
    (`explicit`): its process acquired it from its own imports (sklearn's KMP_DUPLICATE_LIB_OK), as a rank would."""
    names = {k for k in {*env, *server_env} if k.startswith(IMPORT_TIME) and k not in LAUNCH_TIME}
    return sorted(
        k
        for k in names
        if env.get(k) != server_env.get(k)
        and not (k in imported and env.get(k) in (None, imported[k]))
        and not (k not in server_env and k not in explicit)
    )


# ---- the server --------------------------------------------------------------------------------------------------
def preload() -> None:
    """What a rank imports, loaded once: the recipes' modules (not their main), the libraries and the model families
    the tests train, the launch code. Nothing here runs torch compute."""
    import importlib
    import importlib.util

    sys.path.insert(0, str(REPO))
    for name in (
        "torch",
        "torch.distributed.run",
        "torch.distributed.fsdp",
        "torch.distributed.checkpoint",
        "torch.distributed.tensor",
        "torch.distributed.pipelining",
        "torch.utils.tensorboard",
        "accelerate",
        "accelerate.commands.launch",
        "transformers",
        "transformers.optimization",
        "transformers.models.llama.modeling_llama",
        "transformers.models.qwen3.modeling_qwen3",
        "transformers.models.qwen3_moe.modeling_qwen3_moe",
        "transformers.models.mixtral.modeling_mixtral",
        "transformers.models.bert.modeling_bert",
        "datasets",
        "peft",
        "safetensors.torch",
    ):
        importlib.import_module(name)
    from common.launch.accelerator import import_deepspeed

    import_deepspeed()  # as a rank imports it (without deepspeed's optional mlflow)
    for path in sorted((REPO / "recipes").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"_warm_{path.stem}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    for path in sorted((REPO / "common").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        importlib.import_module(module)


def os_threads() -> list[str]:
    """The names of this process's threads (Linux), the main one first."""
    if not os.path.isdir("/proc/self/task"):
        return ["main"]
    return [
        Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in sorted(os.listdir("/proc/self/task"), key=int)
    ]


def die_with_parent() -> None:
    """This process is killed when its parent ends (Linux prctl PR_SET_PDEATHSIG): nothing outlives the session."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(path: str) -> None:
    die_with_parent()
    started = time.time()
    server_env = dict(os.environ)
    preload()
    # what the imports set in their process's environment (torch's inductor cache folder, ...): a rank that imported
    # them itself would hold these too
    imported = {k: v for k, v in os.environ.items() if server_env.get(k) != v}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # managers reaped by the kernel
    # the caller waits for this line: the imports' seconds, the threads running (a fork copies none of them) and the
    # variables the imports set
    ready = {"seconds": round(time.time() - started, 2), "threads": os_threads(), "imported": sorted(imported)}
    print(READY + json.dumps(ready), flush=True)
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            status = 0
            try:
                die_with_parent()
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                manage(connection, server_env, imported)
            except BaseException:  # before its output was redirected: into the server's log
                import traceback

                traceback.print_exc()
                status = 1
            finally:
                os._exit(status)
        connection.close()


def send(connection, message: dict) -> None:
    connection.sendall((json.dumps(message) + "\n").encode())


def manage(connection, server_env: dict, imported: dict) -> None:
    """One launch: the request's arguments through accelerate's launch_command, the ranks forked at torchrun."""
    request = json.loads(connection.makefile().readline())
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**imported, **request["env"]})
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    differing = import_time_differences(request["env"], server_env, imported, request.get("explicit", ()))
    if differing:
        send(connection, {"refused": f"the environment differs from the server's in {', '.join(differing)}"})
        return
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout, sys.stderr = text_stream(1), text_stream(2)
    from accelerate.commands.launch import launch_command, launch_command_parser

    from common.launch.internals import torchrun_replaced

    result = {}

    def start_workers(torchrun_args):
        result.update(run_ranks(torchrun_args, connection))

    def simple_launch(args):
        raise Refused("one process without torchrun (accelerate's simple launcher)")

    try:
        args = launch_command_parser().parse_args(request["argv"])
        config = config_file_settings(args.config_file)
        machines = args.num_machines if args.num_machines is not None else config.get("num_machines", 1)
        if machines not in (None, 1) or args.max_restarts or args.rdzv_backend not in (None, "static"):
            raise Refused("more than one machine, restarts or an elastic rendezvous")
        unexported = [key for key in UNEXPORTED if key in (config.get("parallelism_config") or {})]
        if unexported:
            raise Refused(f"{', '.join(unexported)}: a rank reads it from its launcher's command line (mesh.py)")
        with torchrun_replaced(start_workers, simple_launch):
            launch_command(args)
    except Refused as refused:
        send(connection, {"refused": str(refused)})
        return
    except BaseException as error:  # accelerate's own refusal of the arguments, as the launch prints it
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        result = {"returncodes": [], "launcher_error": f"{type(error).__name__}: {error}"}
    send(connection, result)


class Refused(Exception):
    pass


def config_file_settings(config_file: str | None) -> dict:
    """The launch's accelerate config file as written (accelerate's default file where none is named), or {}."""
    import yaml
    from accelerate.commands.config import default_config_file

    path = config_file or default_config_file
    if not path or not os.path.exists(path) or not path.endswith((".yaml", ".yml")):
        return {}
    with open(path) as handle:
        return yaml.safe_load(handle) or {}


def text_stream(fd: int):
    """A rank's sys.stdout/sys.stderr as `python -u` (torchrun's command) makes them: unbuffered."""
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace" if fd == 2 else "strict",
        write_through=True,
    )


def rank_environments(torchrun_args) -> tuple[list[str], list[dict]]:
    """torchrun's command for these arguments, and each rank's environment as torchrun's agent (LocalElasticAgent,
    torch 2.13) builds it from its launch config: the launch's environment plus the agent's variables."""
    from torch.distributed.run import config_from_args

    config, command, command_args = config_from_args(torchrun_args)  # sets OMP_NUM_THREADS as torchrun does
    if config.min_nodes != 1 or config.max_nodes != 1 or config.max_restarts or config.rdzv_backend != "static":
        raise Refused("more than one node, restarts or an elastic rendezvous")
    if command != sys.executable or command_args[:1] != ["-u"] or command_args[1:2] == ["-m"]:
        raise Refused(f"a command other than a Python script: {[command, *command_args][:3]}")
    address, port = config.rdzv_endpoint.rsplit(":", 1)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle  # torch.distributed.launcher.api sets it
    error_files = tempfile.mkdtemp(prefix="torchelastic_")
    world = config.nproc_per_node
    environments = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(rank),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_NAME": config.role,
                "LOCAL_WORLD_SIZE": str(world),
                "WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": "1",
                "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": address,
                "MASTER_PORT": port,
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": config.run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                "LOCAL_RANK": str(rank),
                "TORCHELASTIC_ERROR_FILE": os.path.join(error_files, str(rank), "error.json"),
            }
        )
        os.makedirs(os.path.join(error_files, str(rank)))
        environments.append(env)
    return [command, *command_args], environments


def run_ranks(torchrun_args, connection) -> dict:
    import shutil
    from datetime import timedelta

    from torch.distributed import TCPStore

    command, environments = rank_environments(torchrun_args)
    script, script_args = command[2], command[3:]
    pids, returncodes = [], None
    try:
        for env in environments:
            pids.append(fork_rank(script, script_args, env, connection))
        send(connection, {"pids": pids})
        # the agent's store, which the ranks join (TORCHELASTIC_USE_AGENT_STORE), made after the forks: none holds it
        address, port = environments[0]["MASTER_ADDR"], int(environments[0]["MASTER_PORT"])
        store = TCPStore(address, port, None, True, timedelta(seconds=900), wait_for_workers=False, multi_tenant=True)
        returncodes = wait_for_ranks(pids)
        del store
    finally:
        if returncodes is None:  # interrupted (Ctrl-C, the store's port taken): no rank outlives its launch
            end_ranks(pids, signal.SIGKILL)
        shutil.rmtree(os.path.dirname(os.path.dirname(environments[0]["TORCHELASTIC_ERROR_FILE"])), ignore_errors=True)
    return {"returncodes": returncodes}


def fork_rank(script: str, script_args: list[str], env: dict, connection) -> int:
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        os.setsid()  # its own session, as torchrun starts a worker: ending a rank ends what it started
        die_with_parent()
        connection.close()
        os.environ.clear()
        os.environ.update(env)  # the launch's (with what the server's imports set), and torchrun's for this rank
        import runpy

        import torch

        if "OMP_NUM_THREADS" in env:  # OpenMP read the server's value at import: the rank's, as torchrun sets it
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        # `python -u script`: the script's folder first on sys.path, then PYTHONPATH's (accelerate adds the cwd), then
        # the interpreter's own
        paths = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *paths, *BASE_PATH]
        if "numpy" in sys.modules:  # numpy's global generator: drawn afresh, as in a new process
            sys.modules["numpy"].random.seed()
        sys.argv = [script, *script_args]
        sys.stdout = sys.__stdout__ = text_stream(1)
        sys.stderr = sys.__stderr__ = text_stream(2)
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)


def wait_for_ranks(pids: list[int]) -> list[int]:
    """Each rank's exit status (a signal as -N, as subprocess gives it); the first failure ends the others."""
    codes: dict[int, int] = {}
    deadline = None
    while len(codes) < len(pids):
        if deadline is None:
            pid, status = os.waitpid(-1, 0)
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.time() > deadline:
                    end_ranks([p for p in pids if p not in codes], signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.05)
                continue
        if pid not in pids:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and deadline is None:
            end_ranks([p for p in pids if p not in codes], signal.SIGTERM)
            deadline = time.time() + TERMINATE_GRACE_S
    return [codes[p] for p in pids]


def end_ranks(pids: list[int], sig) -> None:
    """Each rank's session (what it started too), or the rank alone where its session is not made yet."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


# ---- the client ----------------------------------------------------------------------------------------------------
class Server:
    """The session's server, started on first use; `launch` sends it one launch."""

    def __init__(self, env: dict, running: str | None = None):
        """`running`: the socket of a server the test session started (a client of it: make's LAUNCH)."""
        self.folder = tempfile.mkdtemp(prefix="warm_launcher_")
        self.path = running or os.path.join(self.folder, "socket")
        self.env = dict(env)
        self.owned = running is None  # started here (else the test session's, running)
        self.process = None
        self.ready = None
        self.refusal = None  # why the last launch was refused
        import threading

        self.lock = threading.Lock()

    def start(self) -> None:
        import subprocess
        import threading

        self.process = subprocess.Popen(
            [sys.executable, __file__, "serve", self.path],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(self.folder, "server.log"), "w"),
            text=True,
        )
        deadline = threading.Timer(START_TIMEOUT_S, self.process.kill)  # imports that hang end here
        deadline.start()
        try:
            for line in self.process.stdout:  # what the imports print, then the ready line
                if line.startswith(READY):
                    self.ready = json.loads(line[len(READY) :])
                    break
        finally:
            deadline.cancel()
        if self.ready is None:
            raise RuntimeError(
                f"the warm launcher did not start: {Path(self.folder, 'server.log').read_text()[-4000:]}"
            )

    def ensure_started(self) -> None:
        with self.lock:
            if self.owned and self.process is None:
                self.start()

    def launch(self, argv: list[str], cwd, env: dict, timeout: float | None = None, explicit=()):
        """`accelerate launch <argv>` through the server: a subprocess.CompletedProcess, or None where it refused.
        `explicit`: the variables of `env` the caller set itself (not inherited)."""
        import subprocess

        self.ensure_started()
        if self.owned and self.process.poll() is not None:
            raise RuntimeError(f"the warm launcher has ended: {Path(self.folder, 'server.log').read_text()[-4000:]}")
        handle, stdout_path = tempfile.mkstemp(prefix="out_", dir=self.folder)
        os.close(handle)
        handle, stderr_path = tempfile.mkstemp(prefix="err_", dir=self.folder)
        os.close(handle)
        request = {"argv": [str(a) for a in argv], "cwd": str(cwd), "env": env, "explicit": list(explicit)}
        request.update(stdout=stdout_path, stderr=stderr_path)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.path)
        connection.settimeout(timeout)
        pids, reply = [], None
        try:
            send(connection, request)
            for line in connection.makefile():
                message = json.loads(line)
                if "pids" in message:
                    pids = message["pids"]
                else:
                    reply = message
                    break
        except (socket.timeout, TimeoutError):
            end_ranks(pids, signal.SIGKILL)
            raise subprocess.TimeoutExpired(["warm", *request["argv"]], timeout)
        finally:
            connection.close()
            stdout, stderr = (Path(p).read_text(errors="backslashreplace") for p in (stdout_path, stderr_path))
            os.unlink(stdout_path)
            os.unlink(stderr_path)
        if reply is None:  # it failed before its output went to the launch's files: the server's log has it
            log = Path(self.folder, "server.log")
            server_log = log.read_text(errors="backslashreplace")[-4000:] if log.exists() else ""
            raise RuntimeError(f"the warm launcher's manager ended without a reply:\n{stderr[-4000:]}{server_log}")
        if "refused" in reply:
            self.refusal = reply["refused"]
            return None
        codes = reply["returncodes"]
        status = 0 if codes and not any(codes) else 1
        if "launcher_error" in reply:
            stderr += f"\n{reply['launcher_error']}\n"
        result = subprocess.CompletedProcess(["warm launch", *request["argv"]], status, stdout, stderr)
        result.rank_returncodes = codes
        return result

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def client(argv: list[str]) -> int:
    """`accelerate launch`'s command line through the server named by WARM_LAUNCHER_SOCKET (make LAUNCH=...)."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        print(f"error: {SOCKET_ENV} is not set: the warm launcher runs inside the test session", file=sys.stderr)
        return 2
    server = Server(dict(os.environ), path)
    try:
        result = server.launch(
            argv, os.getcwd(), dict(os.environ), float(os.environ.get("WARM_LAUNCHER_TIMEOUT", "900"))
        )
    finally:
        server.stop()
    if result is None:  # refused: a real launch, as make would have run it
        os.execv(sys.executable, [sys.executable, "-m", "accelerate.commands.launch", *argv])
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1:]))
