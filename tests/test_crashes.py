"""A crash at any moment leaves a run that resumes to the uninterrupted run's weights.

Each trial starts a 2-process fp32 run and kills every one of its processes with SIGKILL (a
power cut: the launcher and both ranks at once) at a random moment, or the moment a checkpoint
save or the final export is under way (its temporary folder exists); then the same command
resumes it with `--resume_from_checkpoint latest`. The resumed run must finish, and its
`final/` weights must equal the uninterrupted run's bit for bit.

`make test` runs CRASH_TRIALS=3 trials (one per config: ddp, fsdp, zero3); `make test-crashes`
runs 21 (seven per config).
"""

import os
import random
import signal
import subprocess
import time

import pytest

from conftest import FP32, OFFLINE_ENV, causal_lm_args, launch, launch_command, load_weights

TRIALS = int(os.environ.get("CRASH_TRIALS", "3"))
CONFIGS = ("ddp.yaml", "fsdp.yaml", "zero3.yaml")
RUN = dict(max_steps=8, save_steps=2, save_total_limit=2, per_device_train_batch_size=2,
           gradient_accumulation_steps=2, warmup_steps=2)


def moments(count: int) -> list[tuple[str, str]]:
    """(config, when) for each trial: the configs in turn; when is 'save' (inside a checkpoint
    save), 'export' (inside the final export) or 'random' (anywhere in the run)."""
    kinds = ["save", "export", "random"]
    return [(CONFIGS[i % len(CONFIGS)], kinds[(i + i // len(CONFIGS)) % len(kinds)]) for i in range(count)]


def kill_everything(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_until_killed(command: list[str], out, when: str, seed: int, reference_s: float) -> str:
    """Start the run in its own process group and kill all of it at the chosen moment; returns
    what was under way (or 'finished' when the moment never came)."""
    process = subprocess.Popen(command, env={**os.environ, **OFFLINE_ENV}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    rng = random.Random(seed)
    started = time.monotonic()
    deadline = started + (rng.uniform(0.2, 0.8) * reference_s if when == "random" else 600)
    while process.poll() is None:
        if when == "save" and any(p.name.startswith("tmp-step_") for p in (out / "checkpoints").glob("*")):
            kill_everything(process)
            return "inside a checkpoint save"
        if when == "export" and (out / "final.tmp").exists():
            kill_everything(process)
            return "inside the final export"
        if time.monotonic() > deadline:
            kill_everything(process)
            return f"at random, {time.monotonic() - started:.1f} s in"
        time.sleep(0.001)
    return "finished"


@pytest.fixture(scope="module")
def uninterrupted(markov_data, tmp_path_factory) -> dict:
    """Each config's uninterrupted run: its final weights and its wall time."""
    runs = {}
    for config in sorted({config for config, _ in moments(TRIALS)}):
        out = tmp_path_factory.mktemp(config.removesuffix(".yaml"))
        started = time.monotonic()
        launch(config, "causal_lm.py", causal_lm_args(markov_data, out / "run", **RUN), launcher_args=FP32)
        runs[config] = {"weights": load_weights(out / "run" / "final"), "seconds": time.monotonic() - started}
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_run_killed_at_any_moment_resumes_to_the_same_weights(trial, uninterrupted, markov_data, tmp_path):
    config, when = moments(TRIALS)[trial]
    out = tmp_path / "run"
    args = causal_lm_args(markov_data, out, **RUN)
    what = run_until_killed(launch_command(config, "causal_lm.py", args, FP32), out, when, seed=trial,
                            reference_s=uninterrupted[config]["seconds"])
    assert what != "finished", f"{config}: the run finished before the moment to kill it ({when}) came"
    resumed = launch(config, "causal_lm.py", args + ["--resume_from_checkpoint", "latest"], launcher_args=FP32)
    assert resumed.returncode == 0
    weights, reference = load_weights(out / "final"), uninterrupted[config]["weights"]
    assert weights.keys() == reference.keys()
    different = [key for key in weights if not bool((weights[key] == reference[key]).all())]
    print(f"{config}: killed {what}; resumed; {len(different)} of {len(weights)} tensors differ")
    assert not different, f"{config}, killed {what}: the resumed run's final weights differ in {different[:5]}"
