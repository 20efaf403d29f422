"""The start-up a user pays for one launch: a 1-step `make causal_lm` under ddp.yaml as it was and as it is, rounds
interleaved on the same tree: through `accelerate launch` (the whole CLI, as make ran it before) with deepspeed imported
by every rank (as every run did before), through `accelerate-launch` (accelerate's own launch entry point, as make runs
it now) with the same, and as it runs now (deepspeed imported only under DeepSpeed's configs); wall seconds and the CPU
seconds of every process the command started.

    python benchmarks/launch_startup.py --rounds 5 --docs docs/launch-startup.md
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import markdown_table, write_page  # noqa: E402


VENV = os.path.join(REPO, ".venv", "bin")
# (name, launcher, whether each rank imports deepspeed at its start as every run did before), the last as make runs now
LAUNCHERS = [
    ("accelerate launch (the whole CLI), deepspeed in every rank", f"{VENV}/accelerate launch", True),
    ("accelerate-launch (its launch entry point), deepspeed in every rank", f"{VENV}/accelerate-launch", True),
    ("accelerate-launch, deepspeed only under its configs (now)", f"{VENV}/accelerate-launch", False),
]
# A torchrun worker imports deepspeed as it starts, as common/launch/accelerator.py's unwrap did in every run before
IMPORTS_DEEPSPEED = """import os
if "TORCHELASTIC_RUN_ID" in os.environ:
    from common.launch.accelerator import import_deepspeed
    import_deepspeed()
"""


def one_launch(launcher: str, output_dir: str, site: str | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and everything it started) of one 1-step make causal_lm; `site`: a
    folder whose sitecustomize.py each process runs first."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, REPO, env.get("PYTHONPATH")) if p)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(
        ["make", "-s", "causal_lm", f"LAUNCH={launcher}", f"ARGS=--max_steps 1 --output_dir {output_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
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
    site = tempfile.mkdtemp(prefix="launch_startup_")
    with open(os.path.join(site, "sitecustomize.py"), "w") as handle:
        handle.write(IMPORTS_DEEPSPEED)
    one_launch(LAUNCHERS[0][1], args.output_dir, site)  # warm the page cache and the datasets' cache
    samples = {name: [] for name, _, _ in LAUNCHERS}
    for _ in range(args.rounds):
        for name, launcher, deepspeed_everywhere in LAUNCHERS:
            samples[name].append(one_launch(launcher, args.output_dir, site if deepspeed_everywhere else None))
    rows, medians = [], {}
    for name, values in samples.items():
        medians[name] = (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
        rows.append([f"`{name}`", f"{medians[name][0]:.2f}", f"{medians[name][1]:.2f}"])
    old, _, new = medians.values()
    text = markdown_table(["launch", "wall s (median)", "CPU s (median)"], rows) + (
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
