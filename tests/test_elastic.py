"""Elastic multi-node runs (common/launch/elastic.py): two "nodes" on loopback lose one and go on, and the bad cases.

Each node is its own `python -m common.launch.elastic --nnodes 1:2 ...` (the command make builds from LAUNCH_ARGS), one
process per node, fp32. Node 1 is killed whole (its agent and worker, a power cut) after step 6; node 0's worker
fails its collective at once, its agent forms a world of one node, and the worker resumes from step_4 with twice the
accumulation: every step, the ones trained again included, must match an uninterrupted run of the same global batch
(losses within 1e-5 relative) and so must the final weights (1e-5). make test checks the launcher's and the batch's
refusals in this process; the launches (ddp, fsdp, zero3, a node that comes back, the main node lost) are make
test-all's: each takes 45 s or more, most of it the Python start-ups of three workers.
"""

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest
from conftest import (
    BIN,
    OFFLINE_ENV,
    REPO,
    causal_lm_args,
    free_port,
    launch,
    load_weights,
    outer_make_state,
    read_metrics,
    read_run,
    run,
)
from test_crashes import kill_everything, logged_steps

from common.launch import elastic
from common.launch.errors import UsageError


# each template's distributed type on one process (DDP's is none: one process trains alone)
TEMPLATES = {"multi_node_ddp.yaml": "NO", "multi_node_fsdp.yaml": "FSDP", "multi_node_zero3.yaml": "DEEPSPEED"}
# The rendezvous as make sets it, with a shorter wait for a node that will not come (the loss is the point here).
RENDEZVOUS = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def node_command(
    config: str,
    port: int,
    machine_rank: int,
    args: list,
    nodes: str = "1:2",
    main: str = "127.0.0.1",
    rendezvous: str = RENDEZVOUS,
) -> list[str]:
    """One node's launch, as `make <recipe> LAUNCH_ARGS="--nnodes 1:2 ..."` builds it (its flags, then the user's)."""
    return [
        str(BIN / "python"),
        "-m",
        "common.launch.elastic",
        "--rdzv_backend",
        "c10d",
        "--max_restarts",
        "3",
        "--nnodes",
        nodes,
        "--rdzv_conf",
        rendezvous,
        "--config_file",
        str(REPO / "accelerate_configs" / config),
        "--num_processes",
        nodes.split(":")[1],  # one per node
        "--machine_rank",
        str(machine_rank),
        "--main_process_ip",
        main,
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
        str(REPO / "recipes" / "causal_lm.py"),
        *args,
    ]


def start_node(command: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, **OFFLINE_ENV},
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: killed whole, as a node is lost
    )


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def start_two_nodes(config: str, args: list, tmp_path, **node) -> tuple[list, int]:
    """Node 0 first, so that its agent holds the rendezvous store (the main node's role), then node 1. `node`:
    node_command's node range and rendezvous settings."""
    port = free_port()
    nodes = [start_node(node_command(config, port, 0, args, **node), tmp_path / "node0.log")]
    deadline = time.monotonic() + 120
    while not listening(port) and time.monotonic() < deadline and nodes[0].poll() is None:
        time.sleep(0.1)
    assert listening(port), (tmp_path / "node0.log").read_text()[-3000:]
    nodes.append(start_node(node_command(config, port, 1, args, **node), tmp_path / "node1.log"))
    return nodes, port


def wait_for(condition, nodes, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        assert nodes[0].poll() is None, f"node 0 ended early ({nodes[0].returncode})"
        time.sleep(0.01)


def finish(process: subprocess.Popen, log, timeout: float = 600) -> str:
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            kill_everything(process)
    return log.read_text()


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error:")]


def world_changes(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["world_change"] for row in rows if "world_change" in row]


def last_logged_step(out) -> int:
    """metrics.jsonl's last train row's step, while a run writes it (a line half-written left out)."""
    steps = [0]
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        steps += [row["step"]] if "loss" in row else []
    return max(steps)


def compare(out, reference, what: str) -> tuple[float, float]:
    """The largest relative loss gap over every step, and the largest final-weight gap, to `reference`."""
    rows, expected = read_metrics(out)[0], read_metrics(reference)[0]
    assert [row["step"] for row in rows] == [row["step"] for row in expected], "a step missing or logged twice"
    gap = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(rows, expected))
    mine, theirs = load_weights(out / "final"), load_weights(reference / "final")
    assert mine.keys() == theirs.keys()
    weights = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
    print(f"{what}: {len(rows)} steps, max relative loss gap {gap:.2e}, max weight gap {weights:.2e}")
    return gap, weights


# ---- the launcher and the batch, in this process (make test) ----------------------------------------------------
@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--nnodes", "2:1", "x.py"], r"--nnodes 2:1: give the range of nodes .* as MIN:MAX"),
        (["--nnodes", "1:x", "x.py"], r"--nnodes 1:x: give the range"),
        (["--nnodes=1", "x.py"], r"MAX >= 2"),
        (["--nnodes", "1:2", "--num_machines", "3", "x.py"], r"--num_machines 3 beside --nnodes 1:2"),
        (["--nnodes", "1:2", "--num_machines=3", "x.py"], r"--num_machines 3 beside --nnodes 1:2"),
        (["--num_machines=1", "--nnodes=1:2", "x.py"], r"--num_machines 1 beside --nnodes 1:2"),
        (
            [
                "--nnodes",
                "1:2",
                "--num_processes=3",
                "--config_file",
                str(REPO / "accelerate_configs/multi_node_ddp.yaml"),
                "x.py",
            ],
            r"--num_processes 3 with --nnodes 1:2: it counts the processes of 2 nodes.* a multiple of 2",
        ),  # fmt: skip
        (
            ["--nnodes", "1:3", "--config_file", str(REPO / "accelerate_configs/multi_node_ddp.yaml"), "x.py"],
            r"multi_node_ddp.yaml's num_processes 16 with --nnodes 1:3: .* a multiple of 3",
        ),
    ],
)
def test_a_bad_node_range_is_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        elastic.main(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and re.search(expected, errors[0]), errors


@pytest.mark.parametrize(
    "config, expected",
    [
        ("single.yaml", r"an elastic run is launched by torchrun"),
        ("pdsh", r"DeepSpeed's own multi-node launcher \(pdsh\) has no node range"),
        ("multi_node_hsdp.yaml", r"its mesh \(dp_replicate_size 2 x dp_shard_size 8\) is fixed to num_processes"),
        ("multi_node_hsdp_tp.yaml", r"tp_size 2\) is fixed to num_processes"),
        ("tp.yaml", r"its mesh \(tp_size 2\) is fixed"),
        ("fsdp_tp.yaml", r"its mesh \(dp_shard_size 2 x tp_size 2\) is fixed"),
        ("pp.yaml", r"its mesh \(pp_size 2\) is fixed"),
        ("dp_pp.yaml", r"its mesh \(pp_size 2\) is fixed"),
        ("fsdp_cp.yaml", r"its mesh \(cp_size 2\) is fixed"),
        ("zero3_ulysses.yaml", r"its mesh \(sp_size 2\) is fixed"),
    ],
)
def test_a_config_whose_world_cannot_change_is_refused_in_one_line(config, expected, tmp_path):
    path = REPO / "accelerate_configs" / config
    if config == "pdsh":  # multi_node_zero3.yaml with DeepSpeed's default multi-node launcher
        path = tmp_path / "pdsh.yaml"
        template = (REPO / "accelerate_configs/multi_node_zero3.yaml").read_text()
        path.write_text(
            template.replace("deepspeed_multinode_launcher: standard", "deepspeed_multinode_launcher: pdsh")
        )
    with pytest.raises(UsageError, match=expected):
        elastic.check_config(str(path), (1, 2))
    elastic.check_config(str(REPO / "accelerate_configs" / "multi_node_zero3.yaml"), (1, 2))  # the templates pass


@pytest.mark.parametrize("flag", ["--parallelism_config_tp_size", "--parallelism_config_dp_shard_size"])
def test_a_mesh_given_on_the_command_line_is_refused_in_one_line_before_anything_starts(flag, capsys):
    """multi_node_fsdp.yaml has no mesh, but accelerate launch takes one as flags: refused as in a config."""
    argv = ["--nnodes", "1:2", "--config_file", str(REPO / "accelerate_configs/multi_node_fsdp.yaml"), flag, "2"]
    with pytest.raises(SystemExit) as exit_info:
        elastic.main([*argv, "--use_parallelism_config", str(REPO / "recipes/causal_lm.py")])
    errors = error_lines(capsys.readouterr().err)
    size = flag.removeprefix("--parallelism_config_")
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert re.search(rf"multi_node_fsdp.yaml: its mesh \({size} 2\) is fixed to num_processes", errors[0]), errors


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], r"needs torchrun's c10d rendezvous.*the config's rdzv_backend: static"),
        (["--rdzv_backend", "c10d"], r"without --max_restarts: a lost node would end the run"),
    ],
)
def test_the_launcher_refuses_a_static_rendezvous_and_no_restarts_before_anything_starts(flags, expected, capsys):
    """The checks on torchrun's arguments as accelerate builds them (the config's rendezvous, the restarts): one
    line, exit status 2, no worker started (no output_dir)."""
    out = REPO / "outputs" / f"elastic-refused-{os.getpid()}"
    argv = ["--nnodes", "1:2", *flags, "--config_file", str(REPO / "accelerate_configs/multi_node_ddp.yaml")]
    argv += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), "--machine_rank", "0"]
    environment = dict(os.environ)
    with pytest.raises(SystemExit) as exit_info:
        elastic.main([*argv, str(REPO / "recipes/causal_lm.py"), "--output_dir", str(out)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and re.search(expected, errors[0]), errors
    assert not out.exists() and dict(os.environ) == environment


def test_the_global_batch_is_kept_on_every_world_of_the_range_or_refused(monkeypatch):
    """--nnodes 1:2 x 2 processes, 4 per device, accumulation 1: 16 samples per step; on one node, accumulation 2.
    1:3 cannot: 24 samples on 2 nodes (4 processes x 4) is no whole number of steps; accumulation 2 can."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=1)
    kept = elastic.keep_global_batch(elastic.Elastic(1, 2, "127.0.0.1", 1), args)
    assert kept == {"global_batch": 16, "accumulation": 2, "asked": 1} and args.gradient_accumulation_steps == 2
    args.gradient_accumulation_steps = 1
    with pytest.raises(UsageError, match=r"cannot keep the global batch of 24 samples .* on 2 nodes: 24 is not a "):
        elastic.keep_global_batch(elastic.Elastic(1, 3, "127.0.0.1", 1), args)
    with pytest.raises(UsageError, match=r"set --gradient_accumulation_steps to a multiple of 2"):
        elastic.keep_global_batch(elastic.Elastic(1, 3, "127.0.0.1", 1), args)
    args.gradient_accumulation_steps = 2
    assert elastic.keep_global_batch(elastic.Elastic(1, 3, "127.0.0.1", 1), args)["accumulation"] == 6


def keeps_every_world(low: int, high: int, per_node: int, per_device: int, accumulation: int) -> bool:
    global_batch = high * per_node * per_device * accumulation
    return all(global_batch % (n * per_node * per_device) == 0 for n in range(low, high + 1))


def test_the_refusal_names_the_smallest_accumulation_that_keeps_every_world(monkeypatch):
    """--nnodes 3:4, 8 processes per node, 4 per device, accumulation 2: 256 samples, no whole step on 3 nodes. The
    line named 6 (a multiple of what was typed); 3 is the smallest that works. Then every range of up to 8 nodes, 1, 2
    or 8 processes per node, 1 or 4 per device and accumulation 1-6: the accumulation the line names makes every
    number of nodes of the range whole, and no smaller one does."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "32")
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(UsageError, match=r"on 3 nodes: 256 is not a multiple of 96; set --gradient_accumulation_st"
                       r"eps to a multiple of 3, the smallest"):  # fmt: skip
        elastic.keep_global_batch(elastic.Elastic(3, 4, "127.0.0.1", 1), args)
    refused = 0
    for low, high, per_node, per_device, typed in itertools.product(
        range(1, 9), range(2, 9), (1, 2, 8), (1, 4), range(1, 7)
    ):
        if low > high:
            continue
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
        monkeypatch.setenv("WORLD_SIZE", str(per_node * high))
        args = SimpleNamespace(per_device_train_batch_size=per_device, gradient_accumulation_steps=typed)
        try:
            elastic.keep_global_batch(elastic.Elastic(low, high, "127.0.0.1", 1), args)
            assert keeps_every_world(low, high, per_node, per_device, typed)
        except UsageError as error:
            refused += 1
            named = int(re.search(r"a multiple of (\d+), the smallest", str(error)).group(1))
            works = [a for a in range(1, named + 1) if keeps_every_world(low, high, per_node, per_device, a)]
            assert works == [named], (low, high, per_node, per_device, typed, str(error))
    assert refused > 100


def test_a_recipes_rule_on_the_accumulation_is_checked_for_every_world_of_the_range(monkeypatch):
    """GRPO's whole groups (common.objectives.grpo.whole_groups): --nnodes 1:3 of one process, 1 completion per device,
    accumulation 4, 4 generations. On 3 nodes 4 completions per process, on 1 node 12, but on 2 nodes 6: refused at
    the start (Run.check_accumulation, whichever world starts), naming 2 nodes and the accumulation that fits every
    world (8: 8, 12 and 24 completions). Without a range, the world's own accumulation only."""
    from common.objectives.grpo import whole_groups
    from common.run import Run

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    rule = whole_groups(1, 4)
    for world in (1, 3):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        args = SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=4)
        launch = elastic.Elastic(1, 3, "127.0.0.1", 1)
        run = SimpleNamespace(
            args=args, world=SimpleNamespace(elastic=launch, batch=elastic.keep_global_batch(launch, args))
        )
        with pytest.raises(UsageError) as error:
            Run.check_accumulation(run, rule)
        assert re.fullmatch(
            r"--nnodes 1:3 on 2 nodes trains with 6 accumulation steps \(the global batch of 3 nodes kept\): a step "
            r"trains --per_device_train_batch_size x --gradient_accumulation_steps = 6 completions per process, not a "
            r"multiple of --num_generations 4: each process samples whole groups; set --gradient_accumulation_steps "
            r"to 8 \(every world of the range keeps it\), or narrow the range",
            str(error.value),
        ), str(error.value)
    elastic.check_every_world(elastic.Elastic(1, 3, "127.0.0.1", 1), 8, rule)  # the advice holds on every world
    with pytest.raises(
        UsageError, match=r"on 1 node trains with 12 .*: above 1; no --gradient_accumulation_steps fits"
    ):
        elastic.check_every_world(elastic.Elastic(1, 3, "127.0.0.1", 1), 4, lambda a: "above 1" if a > 1 else None)
    Run.check_accumulation(SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=4), world=None), rule)
    with pytest.raises(UsageError, match=r"= 6 completions per process, not a multiple of --num_generations 4: each"):
        Run.check_accumulation(SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=6), world=None), rule)


def test_streaming_on_a_node_range_is_refused_at_the_start(tmp_path, monkeypatch):
    """A stream's checkpoint resumes on as many processes as wrote it: on a range (1:2) the first loss would refuse
    every world after it, so start_run refuses it at once, in one line; a fixed number of nodes (2:2) keeps it."""
    from common.options.arguments import DataArguments, TrainingArguments
    from common.run import start_run

    monkeypatch.setenv(elastic.ENV, "1:2:127.0.0.1:1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    data = DataArguments(train_file=str(tmp_path / "train.jsonl"), streaming=True)
    with pytest.raises(UsageError) as error:
        start_run(data, TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4))
    assert re.fullmatch(
        r"--streaming with --nnodes 1:2: a stream's checkpoint resumes only on the number of processes that wrote "
        r"it, .*; train on a map-style dataset \(drop --streaming\), or launch on a fixed number of nodes "
        r"\(--nnodes 2\)",
        str(error.value),
    ), str(error.value)
    elastic.check_streaming(elastic.Elastic(2, 2, "127.0.0.1", 1), True)
    elastic.check_streaming(elastic.Elastic(1, 2, "127.0.0.1", 1), False)


class RunRecords:
    """common.outputs.metrics.MetricsLogger's part the world's account uses: run.json's fields, its clock."""

    def __init__(self, out):
        self.path, self.start_time = out / "run.json", time.perf_counter()

    def record_in_run_json(self, key: str, value) -> None:
        self.path.write_text(json.dumps({**json.loads(self.path.read_text()), key: value}))

    def log_event(self, row: dict) -> None:
        pass


@pytest.mark.parametrize(
    "shrink_from, grow_from, grow_fails",
    [(4, 10, True), (0, 0, False)],
    ids=["a world failing after run.json was rewritten", "no checkpoint yet at either change"],
)
def test_every_world_of_a_launch_counts_its_world_changes(shrink_from, grow_from, grow_fails, tmp_path, monkeypatch):
    """Worlds of (host, agent) members: 2 -> 1 (node 1 lost), then 1 -> 2 (it came back); run.json's world_changes
    must hold both. run.json is written afresh as each world starts (common.outputs.run_info.record_run) and the
    changes added back once the world trains: a world that fails in between must not cost the next one the launch's
    earlier changes; nor may a world that starts afresh (no checkpoint yet: seen in make test-all's zero3 grow, node 1
    admitted at step 3 of a world started from step 0, run.json kept the grow only)."""
    import accelerate.utils
    import torch.distributed

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the agent's
    launch, out = elastic.Elastic(1, 2, "127.0.0.1", port), tmp_path
    (out / "metrics.jsonl").write_text(json.dumps({"step": 6, "loss": 1.0, "elapsed_s": 1.0}) + "\n")
    main = SimpleNamespace(is_main_process=True)

    def world(members: list, resumed_step: int, accumulation: int, fails: bool = False) -> None:
        monkeypatch.setattr(accelerate.utils, "gather_object", lambda _: members)
        watch = elastic.WorldWatch(launch, {"accumulation": accumulation, "global_batch": 8}, time.time())
        watch.begin(main, str(out), resumed_step, (time.time(), time.time()))
        (out / "run.json").write_text(json.dumps({"args": {}}))  # record_run
        if not fails:
            watch.started(RunRecords(out), main)

    world([["host", 10], ["host", 11]], 0, 1)
    world([["host", 10]], shrink_from, 2)
    if grow_fails:
        world([["host", 10], ["host", 12]], grow_from, 1, fails=True)
    world([["host", 10], ["host", 12]], grow_from, 1)
    changes = json.loads((out / "run.json").read_text())["world_changes"]
    assert [(c["from_processes"], c["to_processes"], c["resumed_from_step"]) for c in changes] == [
        (2, 1, shrink_from),
        (1, 2, grow_from),
    ]
    del store


@pytest.mark.parametrize("stepped", [True, False], ids=["each step in the store", "metrics.jsonl alone"])
def test_a_world_change_counts_from_the_last_step_trained_not_the_last_row_logged(stepped, tmp_path, monkeypatch):
    """--logging_steps 3, checkpoints at step 4: world A (3 processes) logs steps 3 and 6 and trains to step 7; h2
    lost, world B (2) resumes from step 4 and trains step 5 (no row: the next is due at 6); h1 lost, world C (1)
    resumes from step 4 again. metrics.jsonl's last row is then world A's step 6, its elapsed_s on world A's clock
    (what the account took: "at step 6", 2 steps lost). With each step in the store (MetricsLogger.advance's
    on_step, WorldWatch.stepped) the changes say steps 7 and 5 and time every part from them; with metrics.jsonl
    alone, world A's rows are left out of world B's account: B got no further than its resume point (step 4)."""
    import accelerate.utils
    import torch.distributed

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the agent's
    launch, out, main = elastic.Elastic(1, 3, "127.0.0.1", port), tmp_path, SimpleNamespace(is_main_process=True)
    monkeypatch.setenv("RANK", "0")
    metrics_path = out / "metrics.jsonl"

    def world(members: list, resumed_step: int, accumulation: int, steps: range) -> elastic.WorldWatch:
        time.sleep(0.05)  # the workers of the next world start after the last one's end
        monkeypatch.setattr(accelerate.utils, "gather_object", lambda _: members)
        monkeypatch.setattr(elastic, "process_started_at", time.time)
        watch = elastic.WorldWatch(launch, {"accumulation": accumulation, "global_batch": 12}, time.time())
        watch.begin(main, str(out), resumed_step, (time.time(), time.time()))
        rows = metrics_path.read_text().splitlines() if metrics_path.exists() else []  # MetricsLogger's resume:
        metrics_path.write_text("".join(f"{r}\n" for r in rows if json.loads(r)["step"] <= resumed_step))
        (out / "run.json").write_text(json.dumps({"args": {}}))  # record_run
        records = RunRecords(out)
        watch.started(records, main)
        if not stepped:
            watch.step_store = None  # as after a write that failed
        for step in steps:
            time.sleep(0.01)
            watch.stepped(step)
            if step % 3 == 0:
                row = {"step": step, "loss": 1.0, "elapsed_s": time.perf_counter() - records.start_time}
                with open(metrics_path, "a") as handle:
                    handle.write(json.dumps(row) + "\n")
        if steps:
            watch.first_step(records, main, str(out))
        time.sleep(0.02)
        elastic.note_lost_peer(launch, "lost contact with rank 2")  # a survivor's failed collective
        return watch

    world([["h0", 1], ["h1", 2], ["h2", 3]], 0, 1, range(1, 8))
    world([["h0", 1], ["h1", 2]], 4, 1, range(5, 6))  # (accumulation 1.5 in truth: the figure plays no part)
    world([["h0", 1]], 4, 3, range(5, 9))
    changes = json.loads((out / "run.json").read_text())["world_changes"]
    said = [(c["at_step"], c["resumed_from_step"], c["steps_lost"]) for c in changes]
    assert said == ([(7, 4, 3), (5, 4, 1)] if stepped else [(6, 4, 2), (4, 4, 0)]), said
    for change in changes[: 2 if stepped else 1]:  # timed from the last step (untimed: world B's, from the file)
        seconds = change["seconds"]
        parts = ("detection", "restart_and_rendezvous", "start_up", "set_up", "conversion", "load", "first_step")
        assert all(seconds[part] >= 0 for part in parts), seconds
        assert abs(sum(seconds[part] for part in parts) - seconds["loss_to_first_step"]) < 0.01, seconds
    if not stepped:
        assert changes[1]["seconds"]["detection"] is None and changes[1]["seconds"]["restart_and_rendezvous"] >= 0
    del store


def test_make_launches_a_node_range_through_the_elastic_launcher():
    command = run(
        ["make", "-n", "causal_lm", "CONFIG=accelerate_configs/multi_node_ddp.yaml", "LAUNCH_ARGS=--nnodes 1:2"]
    ).stdout.splitlines()[-1]
    assert " -m common.launch.elastic --rdzv_backend c10d --max_restarts 3 --nnodes 1:2 --config_file " in command, (
        command
    )


# ---- launches (make test-all) ---------------------------------------------------------------------------------
SHRINK = dict(per_device_train_batch_size=4, max_steps=12, save_steps=4, ddp_timeout=60)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("config", sorted(TEMPLATES))
def test_a_run_that_loses_a_node_goes_on_alone_with_the_same_losses(config, markov_data, reference, tmp_path):
    """Node 1 killed after step 6: node 0 goes on alone from step_4 with accumulation 2 and ends where one process
    of the same global batch (8) ends. The line, the metrics row and run.json say what happened, with the time from
    the loss to the first step on one node and its parts."""
    out = tmp_path / "run"
    nodes, _ = start_two_nodes(config, causal_lm_args(markov_data, out, **SHRINK), tmp_path)
    wait_for(lambda: logged_steps(out) >= 6, nodes)
    killed_at = time.time()
    assert kill_everything(nodes[1]) >= 2  # node 1's agent (the launcher) and its worker
    log = finish(nodes[0], tmp_path / "node0.log")
    assert nodes[0].returncode == 0, log[-6000:]
    line = next((line for line in log.splitlines() if line.startswith("world 2 -> 1")), None)
    assert line is not None, log[-6000:]
    assert re.fullmatch(
        r"world 2 -> 1 processes after rank 1 was lost at step (6|7|8); resumed from step 4, accumulation 1 -> 2, "
        r"global batch 8 kept \((2|3|4) steps since the checkpoint to train again\)",
        line,
    ), line
    record = read_run(out)
    assert record["participating_processes"] == 1 and record["distributed_type"] == TEMPLATES[config]
    assert record["args"]["gradient_accumulation_steps"] == 2 and len(record["world_changes"]) == 1
    change = record["world_changes"][0]
    assert world_changes(out) == [
        {**change, "seconds": {k: v for k, v in change["seconds"].items() if "first" not in k}}
    ]
    assert change["lost_ranks"] == [1] and change["resumed_from_step"] == 4 and change["accumulation"] == [1, 2]
    seconds = change["seconds"]
    parts = ("detection", "restart_and_rendezvous", "start_up", "set_up", "conversion", "load", "first_step")
    assert all(seconds[part] >= 0 for part in parts), seconds
    assert abs(sum(seconds[part] for part in parts) - seconds["loss_to_first_step"]) < 0.5, seconds
    since_kill = seconds["last_step_at"] + seconds["loss_to_first_step"] - killed_at
    print(
        f"{config}: {line}; from the kill to the first step on one node {since_kill:.1f} s, from the last step before "
        f"it {seconds['loss_to_first_step']:.1f} s: " + ", ".join(f"{part} {seconds[part]:.1f}" for part in parts)
    )
    gap, weights = compare(out, reference, f"{config}, node 1 lost at step 6")
    assert gap < 1e-5 and weights < 1e-5


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize(
    "config, fixed",
    [
        ("multi_node_ddp.yaml", "ddp.yaml"),
        ("multi_node_fsdp.yaml", "fsdp.yaml"),
        ("multi_node_zero3.yaml", "zero3.yaml"),
    ],
)
def test_a_node_that_comes_back_joins_and_the_world_grows_back(config, fixed, markov_data, tmp_path):
    """Node 1 killed after step 12 (step_10 saved by two processes); node 0 resumes from step_10 alone and, once it has
    saved a checkpoint of its own (step_20), node 1 is started again with the same command: node 0's agent admits
    it, both resume from node 0's latest checkpoint on two processes (accumulation 2 -> 1; under zero3 its universal
    conversion from 1 process to 2), and every step matches an uninterrupted 2-process run of the config (`fixed`)
    with the same global batch. Rows every 2 steps (--logging_steps 2): each change says the last step trained, not
    the last row logged, and times its parts from it."""
    grow = dict(SHRINK, max_steps=400, save_steps=10, logging_steps=2)  # node 1 starts while node 0 trains alone
    out, reference = tmp_path / "run", tmp_path / "reference"
    launch(
        fixed,
        "causal_lm.py",
        causal_lm_args(markov_data, reference, **grow),
        launcher_args=["--mixed_precision", "no"],
    )
    nodes, port = start_two_nodes(config, causal_lm_args(markov_data, out, **grow), tmp_path)
    wait_for(lambda: logged_steps(out) >= 6, nodes)  # step 12
    kill_everything(nodes[1])
    wait_for(lambda: (out / "checkpoints" / "step_20").exists() and len(world_changes(out)) == 1, nodes)
    trained = last_logged_step(out)  # by the one-node world, at least
    returning = start_node(
        node_command(config, port, 1, causal_lm_args(markov_data, out, **grow)), tmp_path / "node1.log"
    )
    log = finish(nodes[0], tmp_path / "node0.log")
    returned = finish(returning, tmp_path / "node1.log")
    assert nodes[0].returncode == 0 and returning.returncode == 0, (log[-4000:], returned[-4000:])
    lines = re.findall(r"world \d+ -> \d+ processes [^\r\n]*", log)  # (a killed world's progress bar ends no line)
    assert len(lines) == 2 and lines[1].startswith("world 1 -> 2 processes after 1 process joined at step "), lines
    record = read_run(out)
    said = [line for line in (log + returned).splitlines() if re.match(r"(world|error:|a new world|restart \d)", line)]
    assert record["participating_processes"] == 2 and len(record["world_changes"]) == 2, (
        record["world_changes"],
        said,
    )
    shrink, grown = record["world_changes"]
    assert shrink["resumed_from_step"] == 10 and grown["resumed_from_step"] >= 20, record["world_changes"]
    assert grown["accumulation"] == [2, 1] and record["args"]["gradient_accumulation_steps"] == 1
    assert shrink["at_step"] >= 12 and grown["at_step"] >= max(trained, grown["resumed_from_step"]), (shrink, grown)
    parts = ("restart_and_rendezvous", "start_up", "set_up", "conversion", "load", "first_step")
    for change in (shrink, grown):
        assert change["steps_lost"] == change["at_step"] - change["resumed_from_step"], change
        assert all(change["seconds"][part] >= 0 for part in parts), change["seconds"]
    assert (grown["seconds"]["conversion"] > 0.1) == (config == "multi_node_zero3.yaml"), grown["seconds"]
    print(f"{config} grown back: {lines[1]}; its parts {grown['seconds']}")
    gap, weights = compare(out, reference, f"{config}, node 1 lost at step 12 and back")
    assert gap < 1e-5 and weights < 1e-5


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_node_cut_off_the_network_is_left_behind_within_the_timeout(two_hosts, markov_data, reference, tmp_path):
    """The nodes as two hosts (network namespaces over a veth pair, their own hostnames), --ddp_timeout 10: node 1's
    link goes down for good after step 6. Node 0's collective ends within the timeout, its agent counts node 1 lost
    once its heartbeats stop, and node 0 goes on alone to the one-process run's losses and weights."""
    out, port = tmp_path / "run", free_port()
    args = causal_lm_args(markov_data, out, **dict(SHRINK, ddp_timeout=10))
    nodes = []
    for host in (0, 1):
        command, env = two_hosts.command(
            host, node_command("multi_node_ddp.yaml", port, host, args, main=two_hosts.addresses[0]), own_hostname=True
        )
        log = open(tmp_path / f"node{host}.log", "a")
        nodes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        wait_for(lambda: logged_steps(out) >= 6, nodes)
        two_hosts.set_link(1, "down")
        cut = time.time()
        log = finish(nodes[0], tmp_path / "node0.log")
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert nodes[0].returncode == 0, log[-6000:]
    line = next(line for line in log.splitlines() if line.startswith("world 2 -> 1"))
    seconds = read_run(out)["world_changes"][0]["seconds"]
    detected = seconds["last_step_at"] + seconds["detection"] - cut
    print(f"link cut: {line}; node 0's collective failed {detected:.1f} s after the cut; parts {seconds}")
    assert detected < 10 + 15 and re.search(r"after rank 1 was lost at step \d+; resumed from step 4", line)
    gap, weights = compare(out, reference, "ddp, node 1 cut off after step 6")
    assert gap < 1e-5 and weights < 1e-5


@pytest.mark.slow
@pytest.mark.exhaustive
def test_losing_the_main_node_ends_the_other_in_one_line(markov_data, tmp_path):
    """The main node's agent holds the rendezvous: when it is lost, node 1 cannot form a world and ends with one
    line that says so and how to go on, at once."""
    out = tmp_path / "run"
    nodes, _ = start_two_nodes("multi_node_ddp.yaml", causal_lm_args(markov_data, out, **SHRINK), tmp_path)
    wait_for(lambda: logged_steps(out) >= 6, nodes)
    killed_at = time.monotonic()
    kill_everything(nodes[0])
    log = finish(nodes[1], tmp_path / "node1.log", timeout=120)
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    print(f"node 1 ended {time.monotonic() - killed_at:.1f} s after the main node was lost: {errors[-1:]}")
    assert nodes[1].returncode == 1 and re.search(
        r"error: the rendezvous at 127\.0\.0\.1:\d+ is gone .*the main node \(--main_process_ip\).*"
        r"--resume_from_checkpoint latest",
        errors[-1],
    ), log[-4000:]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_loss_that_leaves_fewer_than_min_nodes_ends_the_run_in_one_line(markov_data, tmp_path):
    """--nnodes 2:2 (the last node that may be lost already trains): node 1 killed after step 6. Node 0's worker
    says in its one line that the run goes on only if a node comes back; its agent waits the rendezvous'
    join_timeout (15 s here, 600 s by default) for one, then ends the launch with one line. No world forms."""
    out = tmp_path / "run"
    rendezvous = RENDEZVOUS + ",join_timeout=15"
    args = causal_lm_args(markov_data, out, **SHRINK)
    nodes, _ = start_two_nodes("multi_node_ddp.yaml", args, tmp_path, nodes="2:2", rendezvous=rendezvous)
    wait_for(lambda: logged_steps(out) >= 6, nodes)
    killed_at = time.monotonic()
    kill_everything(nodes[1])
    log = finish(nodes[0], tmp_path / "node0.log", timeout=180)
    errors = error_lines(log)
    print(f"node 0 ended {time.monotonic() - killed_at:.1f} s after node 1 was lost: {errors}")
    assert nodes[0].returncode == 1 and len(errors) == 2, log[-4000:]
    assert re.search(
        r"lost contact with rank 1 .*; elastic launch: this world had 2 nodes, the least --nnodes 2:2 trains on, so "
        r"it goes on only if a lost node comes back within the rendezvous' join_timeout$",
        errors[0],
    ), errors
    assert re.search(
        r"^error: fewer than 2 nodes \(--nnodes 2:2\) joined the rendezvous at 127\.0\.0\.1:\d+ within its "
        r"join_timeout: start the missing nodes .*--resume_from_checkpoint latest$",
        errors[1],
    ), errors
    assert not any(line.startswith("world ") for line in log.splitlines()) and len(world_changes(out)) == 0


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_checkpoint_that_cannot_be_converted_for_the_new_world_ends_the_run_in_one_line(markov_data, tmp_path):
    """multi_node_zero3.yaml, node 1 killed after step 6; once node 0's worker has ended (its lost-contact line),
    the ZeRO optimizer shards of every checkpoint are deleted. The world of one node must convert the latest (written
    by 2 processes) to DeepSpeed's universal format: the conversion fails, its line is printed once, and the worlds
    the remaining restarts form end at once."""
    out = tmp_path / "run"
    nodes, _ = start_two_nodes("multi_node_zero3.yaml", causal_lm_args(markov_data, out, **SHRINK), tmp_path)
    wait_for(lambda: logged_steps(out) >= 6, nodes)
    kill_everything(nodes[1])
    wait_for(lambda: "error: lost contact" in (tmp_path / "node0.log").read_text(), nodes, timeout=120)
    shards = list((out / "checkpoints").glob("step_*/pytorch_model/*optim_states.pt"))
    assert shards
    for shard in shards:
        shard.unlink()
    log = finish(nodes[0], tmp_path / "node0.log")
    errors = error_lines(log)
    print(f"{len(shards)} shards deleted: {errors}")
    assert nodes[0].returncode != 0 and len(errors) == 2, log[-6000:]
    assert re.search(r"lost contact with rank 1 .*; elastic launch: the nodes left form a new world", errors[0])
    assert re.search(
        r"^error: checkpoint \S+/step_\d+ could not be converted for another number of processes "
        r"\(deepspeed\.checkpoint\.ds_to_universal: .*\); resume it on the number of processes that wrote it",
        errors[1],
    ), errors
    assert re.search(r"exitcode\s*: 2\b", log) and len(world_changes(out)) == 0


@pytest.mark.slow
@pytest.mark.exhaustive
def test_bad_input_met_by_a_world_is_one_line_and_the_worlds_after_it_end_at_once(markov_data, tmp_path):
    """--nnodes 1:3 of one process each, 4 per device, accumulation 1: 12 samples per step cannot be made on 2 nodes.
    Node 0 alone forms a world whose worker refuses in one line; the worlds its restarts form end at once, without
    repeating it, and the launch ends. (A checkpoint that cannot be converted for a new world takes the same path.)"""
    started = time.monotonic()
    command = node_command("multi_node_ddp.yaml", free_port(), 0, causal_lm_args(markov_data, tmp_path / "run"), "1:3")
    log = finish(start_node(command, tmp_path / "node0.log"), tmp_path / "node0.log", timeout=300)
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    print(f"ended in {time.monotonic() - started:.0f} s: {errors}")
    assert len(errors) == 1 and re.search(
        r"--nnodes 1:3 cannot keep the global batch of 12 samples .* on 2 nodes: .* multiple of 2", errors[0]
    ), log[-4000:]
    assert re.search(r"exitcode\s*: 2\b", log) and not (tmp_path / "run" / "checkpoints").exists()


def one_machine_example() -> tuple[list[str], str]:
    """docs/operating.md's "Try it on one machine" lines: the two nodes' commands (node 0's, node 1's) and the kill."""
    page = (REPO / "docs" / "operating.md").read_text()
    block = page.split("**Try it on one machine.**", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    lines = [line for line in block.replace("\\\n", "").splitlines() if line and not line.startswith("#")]
    nodes = [line for line in lines if " make causal_lm " in line]
    kill = [line for line in lines if line.startswith("launcher=")]
    assert lines[0] == "make demo-data" and len(nodes) == 2 and len(kill) == 1, lines
    return nodes, kill[0]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_one_machine_example_loses_a_node_takes_it_back_and_lets_it_leave(tmp_path):
    """docs/operating.md's loopback lines as they are (a free port and a folder of this test's put in): node 1 lost
    by the page's kill line after step 20's checkpoint, node 0 goes on alone; node 1's command run again joins; then
    Ctrl-C in node 1's terminal (SIGINT to its foreground group: make and the launcher) says so in one line and
    node 0 ends the run alone. Each change of world is in run.json; the last world had 1 process."""
    port, out = free_port(), tmp_path / "elastic_demo"
    nodes, kill = one_machine_example()
    nodes, kill = [line.replace("29400", str(port)).replace("outputs/elastic_demo", str(out)) for line in nodes], kill
    run(["make", "demo-data"])
    env = {key: value for key, value in os.environ.items() if key not in outer_make_state()} | OFFLINE_ENV

    def start(line: str, log) -> subprocess.Popen:  # a terminal: its own session, the command its foreground group
        return subprocess.Popen(
            ["bash", "-c", line], cwd=REPO, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    started = [start(nodes[0], tmp_path / "node0.log")]
    try:
        wait_for(lambda: listening(port), started, timeout=120)
        started.append(start(nodes[1], tmp_path / "node1.log"))
        wait_for(lambda: (out / "checkpoints" / "step_20").exists(), started)
        subprocess.run(["bash", "-c", kill], cwd=REPO, check=True, timeout=30)
        assert started[1].wait(timeout=30) != 0
        wait_for(lambda: len(world_changes(out)) == 1, started)
        started[1] = start(nodes[1], tmp_path / "node1.log")
        wait_for(
            lambda: len(world_changes(out)) == 2 and last_logged_step(out) > world_changes(out)[1]["at_step"], started
        )
        os.killpg(started[1].pid, signal.SIGINT)
        returned = finish(started[1], tmp_path / "node1.log", timeout=60)
        log = finish(started[0], tmp_path / "node0.log")
    finally:
        for process in started:
            if process.poll() is None:
                kill_everything(process)
    assert started[0].returncode == 0, log[-4000:]
    stops = [line for line in error_lines(returned) if "stopped by" in line]
    assert stops == [
        "error: node 1 stopped by SIGINT: its workers were stopped; the other nodes go on without it, and this node's "
        "command run again joins them"
    ], returned[-4000:]
    assert "SignalException" not in returned, returned[-4000:]  # the line, not the agent's traceback
    lines = re.findall(r"world \d+ -> \d+ processes [^\r\n]*", log)
    assert [line.split(" after ")[0] for line in lines] == [
        "world 2 -> 1 processes",
        "world 1 -> 2 processes",
        "world 2 -> 1 processes",
    ], lines
    record = read_run(out)
    assert record["participating_processes"] == 1 and len(record["world_changes"]) == 3, record["world_changes"]
    assert record["world_changes"][0]["lost_ranks"] == [1] and record["world_changes"][2]["lost_ranks"] == [1]
    print(*lines, stops[0], sep="\n")
