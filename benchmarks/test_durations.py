"""Where the suite's time goes, from its own timing: a table per file written into docs/testing.md.

    make test-all ARGS="--junitxml=outputs/junit.xml"      # the suite times itself (pytest's junit XML)
    python benchmarks/test_durations.py --label after --junit outputs/junit.xml --launch_cost

Each test's seconds (setup, call and teardown, so a session fixture counts where it is first made),
its tier (`make test-fast`, `make test`, or `make test-all` only, read from the markers by collecting
the tree's tests), and the `accelerate launch` and `make` commands it started (tests/conftest.py
records each in the test's junit properties) are kept under a label in docs/testing-durations.json;
--launch_cost times the start-up of one launch (the launcher, the workers' imports, the process
group) on ddp.yaml's 2 processes. The page's section shows every stored label, so a change to the
suite shows its before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from figures import machine, markdown_table  # noqa: E402

from common.launch.peers import free_port  # noqa: E402


STORE = os.path.join(REPO, "docs", "testing-durations.json")
PAGE = os.path.join(REPO, "docs", "testing.md")
BEGIN, END = "<!-- durations: written by benchmarks/test_durations.py -->", "<!-- /durations -->"
TIERS = ("fast", "test", "all")  # not slow; slow but in make test; make test-all only
TIER_SELECTION = {"fast": "not slow", "test": "slow and not exhaustive"}  # the rest is "all"

# What one launch starts before a recipe's first batch: the launcher, each worker's imports (a recipe's), the
# process group with the count of ranks that took part. Timestamps are wall clock, shared by the processes.
PROBE = """
import importlib.util, json, sys, tempfile, time
started = time.time()
spec = importlib.util.spec_from_file_location("recipe", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))  # the recipe's imports, not its main()
imported = time.time()
try:  # common/ in layers; a --tree from before them has the flat modules
    from common.launch.accelerator import build_accelerator, participating_processes
    from common.options.arguments import TrainingArguments
except ImportError:
    from common.accelerator import build_accelerator, participating_processes
    from common.arguments import TrainingArguments
from common.run import run_recipe

def main(args):
    accelerator, _ = build_accelerator(args)
    processes = participating_processes(accelerator)
    if accelerator.is_main_process:
        print("PROBE " + json.dumps({"started": started, "imported": imported, "grouped": time.time(),
                                     "processes": processes}), flush=True)

run_recipe(main, TrainingArguments, argv=["--output_dir", tempfile.mkdtemp(), "--report_to", "none"])  # and its exit
"""


def collect(tree: str, selection: str) -> set[str]:
    """Node ids the tree's tests select under `-m selection` (collection only, nothing runs)."""
    python = os.path.join(tree, ".venv", "bin", "python")
    result = subprocess.run(
        [
            python if os.path.exists(python) else sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            selection,
            "tests",
        ],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    return {line.strip() for line in result.stdout.splitlines() if "::" in line}


def condense(junit: str, tree: str) -> list[dict]:
    """One row per test case in the junit XML: file, name, seconds, tier, launches, make commands."""
    tiers = {tier: collect(tree, selection) for tier, selection in TIER_SELECTION.items()}
    rows = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        node = f"{path}::{case.get('name')}"
        properties = [p.get("name") for p in case.iter("property")]
        tier = next((t for t, ids in tiers.items() if node in ids), "all")
        rows.append(
            {
                "file": os.path.basename(path),
                "test": case.get("name"),
                "seconds": float(case.get("time", 0)),
                "tier": tier,
                "launches": properties.count("launch"),
                "make": properties.count("make"),
                "warm": properties.count("warm"),
                "outcome": "skipped"
                if case.find("skipped") is not None
                else "failed"
                if case.find("failure") is not None or case.find("error") is not None
                else "passed",
            }
        )
    return rows


def launch_cost(tree: str, config: str, repeats: int) -> dict:
    """Median seconds over `repeats` launches of the probe with `tree`'s venv and config."""
    accelerate = os.path.join(tree, ".venv", "bin", "accelerate")
    with tempfile.TemporaryDirectory() as folder:
        probe = os.path.join(folder, "probe.py")
        with open(probe, "w") as handle:
            handle.write(PROBE)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "PYTHONPATH": tree,
            "PATH": f"{os.path.dirname(accelerate)}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        samples = []
        for _ in range(repeats):
            begun = time.time()
            result = subprocess.run(
                [
                    accelerate,
                    "launch",
                    "--config_file",
                    os.path.join(tree, "accelerate_configs", config),
                    "--main_process_port",
                    str(free_port()),
                    probe,
                    os.path.join(tree, "recipes", "causal_lm.py"),
                ],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
            )
            ended = time.time()
            line = next((lo for lo in result.stdout.splitlines() if lo.startswith("PROBE ")), None)
            if result.returncode or line is None:
                sys.exit(
                    f"error: the launch probe failed under {config} (exit {result.returncode}): "
                    f"{result.stderr.strip()[-3000:]}"
                )
            times = json.loads(line[len("PROBE ") :])
            assert times["processes"] == 2, times
            samples.append(
                {
                    "launcher": times["started"] - begun,
                    "imports": times["imported"] - times["started"],
                    "process_group": times["grouped"] - times["imported"],
                    "exit": ended - times["grouped"],
                    "total": ended - begun,
                }
            )
    return {key: round(statistics.median(s[key] for s in samples), 2) for key in samples[0]} | {
        "config": config,
        "repeats": repeats,
    }


def render(store: dict) -> str:
    lines = [
        f"*Written by `benchmarks/test_durations.py` (the newest section here on {machine()}; each section names its host). Seconds from the suite's junit XML "
        "(setup + call + teardown: a session fixture counts in the first test that uses it); launches: "
        "`accelerate launch` commands the tests started; warm: launches through the warm launcher "
        "(tests/warm_launcher.py, from its first section on); make: `make` targets they ran (each of which may "
        "launch).*\n"
    ]
    for label, entry in store.items():
        rows, by_file = entry.get("tests", []), {}
        for row in rows:
            counts = by_file.setdefault(
                row["file"], {"tests": 0, "launches": 0, "warm": 0, "make": 0, **dict.fromkeys(TIERS, 0.0)}
            )
            counts["tests"] += 1
            counts[row["tier"]] += row["seconds"]
            counts["launches"] += row["launches"]
            counts["make"] += row["make"]
            counts["warm"] += row.get("warm", 0)
        lines.append(f"### {label}\n\n{entry.get('what', '')}\n")
        if rows:
            total = {tier: sum(c[tier] for c in by_file.values()) for tier in TIERS}
            lines.append(
                f"{len(rows)} tests, {sum(r['launches'] for r in rows)} launches, "
                f"{sum(r.get('warm', 0) for r in rows)} warm launches, "
                f"{sum(r['make'] for r in rows)} make targets. Sum of the test seconds that ran: `make test-fast`'s "
                f"{total['fast'] / 60:.1f} min, `make test`'s {(total['fast'] + total['test']) / 60:.1f} min, "
                f"`make test-all`'s {sum(total.values()) / 60:.1f} min (where its own tests ran: "
                f"{sum(r['tier'] == 'all' for r in rows)} of them).\n"
            )
            table = sorted(by_file.items(), key=lambda item: -sum(item[1][t] for t in TIERS))
            lines.append(
                markdown_table(
                    [
                        "file",
                        "tests",
                        "fast s",
                        "slow s (make test)",
                        "make test-all only s",
                        "launches",
                        "warm",
                        "make",
                    ],
                    [
                        [
                            f"`{name}`",
                            c["tests"],
                            f"{c['fast']:.0f}",
                            f"{c['test']:.0f}",
                            f"{c['all']:.0f}",
                            c["launches"],
                            c["warm"],
                            c["make"],
                        ]
                        for name, c in table
                    ],
                )
                + "\n"
            )
            slowest = sorted(rows, key=lambda r: -r["seconds"])[:10]
            lines.append(
                "Slowest tests: "
                + "; ".join(f"`{r['file']}::{r['test']}` {r['seconds']:.0f} s ({r['tier']})" for r in slowest)
                + ".\n"
            )
        if "launch_cost" in entry:
            cost = entry["launch_cost"]
            lines.append(
                f"One launch's start-up ({cost['config']}, 2 processes, median of {cost['repeats']}): "
                f"{cost['total']:.1f} s in all: the launcher to the workers' first line {cost['launcher']:.1f} s, "
                f"a recipe's imports {cost['imports']:.1f} s, the process group and the count of ranks "
                f"{cost['process_group']:.1f} s, the exit {cost['exit']:.1f} s.\n"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="the name the figures are kept under (before, after, ...)")
    parser.add_argument("--what", default="", help="a line saying what was measured (the tree, the command)")
    parser.add_argument("--junit", help="a junit XML that `pytest --junitxml` wrote for the whole suite")
    parser.add_argument("--tree", default=REPO, help="the checkout whose tests ran (its markers give the tiers)")
    parser.add_argument("--wall_minutes", type=float, help="the command's wall time, install included")
    parser.add_argument("--launch_cost", action="store_true", help="time one launch's start-up (ddp.yaml)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    tree = os.path.abspath(args.tree)
    if args.junit and not os.path.isfile(args.junit):
        sys.exit(f'error: --junit {args.junit} does not exist; run make test-all ARGS="--junitxml={args.junit}" first')
    store = json.load(open(STORE)) if os.path.exists(STORE) else {}
    entry = store.setdefault(args.label, {})
    entry["date"] = datetime.date.today().isoformat()
    if args.what:
        entry["what"] = args.what
    if args.junit:
        entry["tests"] = condense(args.junit, tree)
    if args.wall_minutes:
        entry["what"] = f"{entry.get('what', '')} Wall time {args.wall_minutes:.1f} min.".strip()
    if args.launch_cost:
        entry["launch_cost"] = launch_cost(tree, "ddp.yaml", args.repeats)
        print(json.dumps(entry["launch_cost"]))
    with open(STORE, "w") as handle:  # one line per test, so a new measurement reads as a diff of its rows
        handle.write(json.dumps(store, indent=1).split("\n", 1)[0] + "\n")
        for index, (name, entry) in enumerate(store.items()):
            fields = {key: value for key, value in entry.items() if key != "tests"}
            rows = ",\n".join("  " + json.dumps(row) for row in entry.get("tests", []))
            handle.write(f' {json.dumps(name)}: {json.dumps(fields)[:-1]}, "tests": [\n{rows}\n ]}}')
            handle.write(",\n" if index < len(store) - 1 else "\n")
        handle.write("}\n")
    page = open(PAGE).read()
    if BEGIN not in page:
        sys.exit(f"error: {PAGE} has no {BEGIN} ... {END} section to write into")
    head, rest = page.split(BEGIN, 1)
    with open(PAGE, "w") as handle:
        handle.write(head + BEGIN + "\n" + render(store) + "\n" + END + rest.split(END, 1)[1])
    print(f"figures: {PAGE}")


if __name__ == "__main__":
    main()
