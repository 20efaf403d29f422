"""The start-up a user pays for one launch: a 1-step `make causal_lm` under ddp.yaml, through `accelerate launch` (the
whole CLI, as make ran it before) and through `accelerate-launch` (accelerate's own launch entry point, as make runs it
now), rounds interleaved on the same tree; wall seconds and the CPU seconds of every process the command started.

    python benchmarks/launch_startup.py --rounds 5 --docs docs/launch-startup.md
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import markdown_table, write_page  # noqa: E402


VENV = os.path.join(REPO, ".venv", "bin")
LAUNCHERS = {
    "accelerate launch (the whole CLI)": f"{VENV}/accelerate launch",
    "accelerate-launch (its launch entry point)": f"{VENV}/accelerate-launch",
}


def one_launch(launcher: str, output_dir: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and everything it started) of one 1-step make causal_lm."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(
        ["make", "-s", "causal_lm", f"LAUNCH={launcher}", f"ARGS=--max_steps 1 --output_dir {output_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        sys.exit(
            f"error: make causal_lm with LAUNCH={launcher} failed (exit {result.returncode}): {result.stderr[-2000:]}"
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output_dir", default=os.path.join(REPO, "outputs", "launch_startup"))
    parser.add_argument("--docs", default=None, help="write the table to this page")
    args = parser.parse_args(argv)
    subprocess.run(["make", "-s", "demo-data"], cwd=REPO, check=True, capture_output=True)
    one_launch(LAUNCHERS[next(iter(LAUNCHERS))], args.output_dir)  # warm the page cache and the datasets' cache
    samples = {name: [] for name in LAUNCHERS}
    for _ in range(args.rounds):
        for name, launcher in LAUNCHERS.items():
            samples[name].append(one_launch(launcher, args.output_dir))
    rows, medians = [], {}
    for name, values in samples.items():
        medians[name] = (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
        rows.append([f"`{name}`", f"{medians[name][0]:.2f}", f"{medians[name][1]:.2f}"])
    old, new = medians.values()
    text = markdown_table(["launcher", "wall s (median)", "CPU s (median)"], rows) + (
        f"\n\nnew / old: wall {new[0] / old[0]:.3f}x, CPU {new[1] / old[1]:.3f}x over {args.rounds} interleaved "
        'rounds of `make causal_lm ARGS="--max_steps 1"` (ddp.yaml, 2 processes, the demo\'s tiny Llama; the CPU '
        "seconds are every process the command started, make's, the launcher's and both ranks').\n"
    )
    print(text)
    if args.docs:
        write_page(args.docs, "A launch's start-up", text)
    return medians


if __name__ == "__main__":
    main()
