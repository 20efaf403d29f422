"""A crash at any moment leaves a run that resumes to the uninterrupted run's weights.

Each trial starts a 2-process fp32 run (4 under fsdp_ep.yaml) and kills every one of its processes with SIGKILL (a
power cut: the launcher, both ranks and anything they started, all stopped first) at a random moment, or the moment a checkpoint
save or the final export is under way (its temporary folder exists); then the same command
resumes it with `--resume_from_checkpoint latest`. The resumed run must finish, and its
`final/` weights must equal the uninterrupted run's bit for bit.

`make test-all` runs CRASH_TRIALS=8 trials (one per config: ddp killed inside a checkpoint save, fsdp inside
the final export, zero3 at a random moment, tp: the tensor-parallel run inside a save, zero3_ulysses: the
sequence-parallel run inside the export, fsdp_cp: the context-parallel run at random, ep: the tiny MoE, its experts
split, inside a save; fsdp_ep: the same MoE on 4 processes, its experts split over pairs and sharded over the
pairs, inside the export), `make test` the first; `make test-crashes` runs 48 (six per config). Two last tests kill a run while it converts a ZeRO-3 checkpoint for
another world size (make test), and while it rewrites a zero2 checkpoint for another config
(common/outputs/portable.py).
"""

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    FP32,
    OFFLINE_ENV,
    REPO,
    LaunchedOnce,
    causal_lm_args,
    launch,
    launch_command,
    load_weights,
    max_weight_difference,
    read_run,
    tiered,
)


TRIALS = int(os.environ.get("CRASH_TRIALS", "8"))
IN_MAKE_TEST = (0,)  # ddp killed inside a checkpoint save; make test-all: all eight
CONFIGS = (
    "ddp.yaml",
    "fsdp.yaml",
    "zero3.yaml",
    "tp.yaml",
    "zero3_ulysses.yaml",
    "fsdp_cp.yaml",
    "ep.yaml",
    "fsdp_ep.yaml",
)
MOE = REPO / "recipes/configs/tiny_qwen3_moe.json"
MODELS = {"ep.yaml": MOE, "fsdp_ep.yaml": MOE}  # the expert-parallel configs split a MoE's experts
RUN = dict(
    max_steps=8,
    save_steps=2,
    save_total_limit=2,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    warmup_steps=2,
)


def moments(count: int) -> list[tuple[str, str]]:
    """(config, when) for each trial: the configs in turn; when is 'save' (inside a checkpoint
    save), 'export' (inside the final export) or 'random' (anywhere in the run)."""
    kinds = ["save", "export", "random"]
    return [(CONFIGS[i % len(CONFIGS)], kinds[(i + i // len(CONFIGS)) % len(kinds)]) for i in range(count)]


def process_tree(root: int) -> list[int]:
    """`root` and every process under it. (torchrun starts each worker in a session of its own, so
    killing the launcher's process group would leave the workers running.)"""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack += children.get(pid, [])
    return tree


def kill_everything(process: subprocess.Popen) -> int:
    """A power cut: every process of the launch stopped at once (so none runs on while the others
    are killed), then killed. Returns how many processes there were."""
    killed = set()
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in process_tree(process.pid):  # again after SIGSTOP: a stopped process starts no other
            killed.add(pid)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    process.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(pid) for pid in killed):
        time.sleep(0.05)
    assert not any(alive(pid) for pid in killed)
    return len(killed)


def alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except (OSError, IndexError):
        return False


def logged_steps(out) -> int:
    metrics = out / "metrics.jsonl"
    return metrics.read_text().count('"loss"') if metrics.exists() else 0


def run_until_killed(command: list[str], out, when: str, seed: int) -> str:
    """Start the run in its own process group and kill all of it at the chosen moment; returns
    what was under way (or 'finished' when the moment never came). A random moment is a random
    time (up to 50 ms) after a random step's logged line."""
    process = subprocess.Popen(
        command,
        env={**os.environ, **OFFLINE_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    rng = random.Random(seed)
    after_steps, extra, reached = rng.randint(1, RUN["max_steps"] - 2), rng.uniform(0.0, 0.05), None
    while process.poll() is None:
        if when == "save" and any(p.name.startswith("tmp-step_") for p in (out / "checkpoints").glob("*")):
            return f"inside a checkpoint save ({kill_everything(process)} processes)"
        if when == "export" and (out / "final.tmp").exists():
            return f"inside the final export ({kill_everything(process)} processes)"
        if when == "random" and reached is None and logged_steps(out) >= after_steps:
            reached = time.monotonic()
        if reached is not None and time.monotonic() - reached >= extra:
            return f"at random, {extra:.2f} s after step {after_steps} ({kill_everything(process)} processes)"
        time.sleep(0.001)
    return "finished"


def run_args(config: str, data, out) -> list[str]:
    return causal_lm_args(data, out, **RUN, **({"model_config": MODELS[config]} if config in MODELS else {}))


@pytest.fixture(scope="module")
def uninterrupted(markov_data, tmp_path_factory) -> LaunchedOnce:
    """Each config's uninterrupted run's final weights."""

    def final_weights(config: str) -> dict:
        out = tmp_path_factory.mktemp(config.removesuffix(".yaml"))
        launch(config, "causal_lm.py", run_args(config, markov_data, out / "run"), launcher_args=FP32)
        return load_weights(out / "run" / "final")

    return LaunchedOnce(final_weights)


@pytest.mark.slow
@pytest.mark.parametrize("trial", tiered(range(TRIALS), IN_MAKE_TEST))
def test_a_run_killed_at_any_moment_resumes_to_the_same_weights(trial, uninterrupted, markov_data, tmp_path):
    config, when = moments(TRIALS)[trial]
    out = tmp_path / "run"
    args = run_args(config, markov_data, out)
    what = run_until_killed(launch_command(config, "causal_lm.py", args, FP32), out, when, seed=trial)
    assert what != "finished" and "(1 processes)" not in what, (
        f"{config}: the run's ranks had finished before the moment to kill them ({when}) came: {what}"
    )
    resumed = launch(config, "causal_lm.py", args + ["--resume_from_checkpoint", "latest"], launcher_args=FP32)
    assert resumed.returncode == 0
    weights, reference = load_weights(out / "final"), uninterrupted[config]
    assert weights.keys() == reference.keys()
    different = [key for key in weights if not bool((weights[key] == reference[key]).all())]
    print(f"{config}: killed {what}; resumed; {len(different)} of {len(weights)} tensors differ")
    assert not different, f"{config}, killed {what}: the resumed run's final weights differ in {different[:5]}"


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_run_killed_while_converting_a_checkpoint_for_another_world_size_resumes(markov_data, tmp_path):
    """A zero3 checkpoint of 2 processes resumed on 1: every process is killed while rank 0 converts
    it (DeepSpeed's universal format, written to universal.tmp), and the next resume converts it
    again and ends where the uninterrupted 2-process run ended."""
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    args = dict(RUN, save_steps=4)  # keeps step_4 and step_8
    launch("zero3.yaml", "causal_lm.py", causal_lm_args(markov_data, full, **args), launcher_args=FP32)
    shutil.copytree(full / "checkpoints" / "step_4", stopped / "checkpoints" / "step_4")
    one_process = dict(args, per_device_train_batch_size=4, resume_from_checkpoint="latest")  # the same global batch
    command = launch_command(
        "zero3.yaml",
        "causal_lm.py",
        causal_lm_args(markov_data, stopped, **one_process),
        FP32 + ["--num_processes", "1"],
    )
    process = subprocess.Popen(
        command,
        env={**os.environ, **OFFLINE_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    converting = stopped / "checkpoints" / "step_4" / "universal.tmp"
    while process.poll() is None and not converting.exists():
        time.sleep(0.001)
    assert process.poll() is None, "the run ended before the conversion started"
    assert kill_everything(process) >= 2  # the launcher and its rank at least
    assert not (stopped / "checkpoints" / "step_4" / "universal" / "trainer_state.json").exists()
    resumed = launch(
        "zero3.yaml",
        "causal_lm.py",
        causal_lm_args(markov_data, stopped, **one_process),
        num_processes=1,
        launcher_args=FP32,
    )
    assert "converting" in resumed.stderr and read_run(stopped)["participating_processes"] == 1
    gap = max_weight_difference(stopped / "final", full / "final")
    print(f"zero3, killed while converting for 1 process, converted again: max weight gap to 2 processes {gap:.2e}")
    assert gap < 1e-5


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_run_killed_while_rewriting_a_checkpoint_for_another_config_resumes(markov_data, tmp_path):
    """A zero2 checkpoint resumed under ddp.yaml: every process is killed while rank 0 rewrites it into the
    portable form (common/outputs/portable.py, written to portable.tmp; DeepSpeed's own per-parameter conversion
    runs inside it); the checkpoint's own files are left as they were, and the next resume rewrites it
    again and ends where the uninterrupted zero2 run ended."""
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    args = dict(RUN, save_steps=4)
    launch("zero2.yaml", "causal_lm.py", causal_lm_args(markov_data, full, **args), launcher_args=FP32)
    checkpoint = stopped / "checkpoints" / "step_4"
    shutil.copytree(full / "checkpoints" / "step_4", checkpoint)
    own = {path.relative_to(checkpoint): path.read_bytes() for path in checkpoint.rglob("*") if path.is_file()}
    resume = dict(args, resume_from_checkpoint="latest")
    command = launch_command("ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, stopped, **resume), FP32)
    process = subprocess.Popen(
        command,
        env={**os.environ, **OFFLINE_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    rewriting = checkpoint / "portable.tmp"
    while process.poll() is None and not rewriting.exists():
        time.sleep(0.001)
    assert process.poll() is None, "the run ended before the rewrite started"
    assert kill_everything(process) >= 3  # the launcher and its two ranks at least
    assert not (checkpoint / "portable" / "trainer_state.json").exists()
    assert {
        path.relative_to(checkpoint): path.read_bytes()
        for path in checkpoint.rglob("*")
        if path.is_file() and not path.relative_to(checkpoint).parts[0].startswith(("portable", "universal"))
    } == own
    resumed = launch("ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, stopped, **resume), launcher_args=FP32)
    assert "rewriting" in resumed.stderr and read_run(stopped)["participating_processes"] == 2
    gap = max_weight_difference(stopped / "final", full / "final")
    print(f"zero2 -> ddp, killed while rewriting, rewritten again: max weight gap to the zero2 run {gap:.2e}")
    assert gap < 1e-6
