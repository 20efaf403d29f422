"""Throughput and peak memory of a causal LM under each accelerate config.

Runs recipes/causal_lm.py for --steps optimizer steps per config (and per
precision, accumulation and extra recipe arguments asked for), all in one
invocation so the figures compare on the same (noisy, shared) machine, and prints
steps/s, tokens/s per process, peak memory per rank, and each run's speed as a
ratio to the first DDP run. On a CPU-only host these are CPU figures (peak
resident set size). It also draws them (--chart, default outputs/benchmark.png): each
config's memory per rank by category as the run measured it (run.json's memory
account) beside scripts/estimate_memory.py's prediction, and its steps/s.

    python benchmarks/benchmark_strategies.py --steps 60
    python benchmarks/benchmark_strategies.py --configs ddp.yaml fsdp.yaml --precisions bf16 no
    # memory with accumulation, at 101M parameters:
    python benchmarks/benchmark_strategies.py --model_config recipes/configs/llama_100m.json --steps 3 \
        --batch_size 1 --block_size 64 --accumulation 1 4 --configs fsdp.yaml zero3.yaml
    # on 2 and 4 processes, activation checkpointing off and on:
    python benchmarks/benchmark_strategies.py --num_processes 2 4 --activation_checkpointing off on ...
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from common.launch.peers import free_port


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CONFIGS = [
    "single.yaml",
    "ddp.yaml",
    "tp.yaml",
    "fsdp.yaml",
    "fsdp_shard_grad_op.yaml",
    "fsdp_offload.yaml",
    "zero1.yaml",
    "zero2.yaml",
    "zero2_offload.yaml",
    "zero2_json.yaml",
    "zero3.yaml",
    "zero3_offload.yaml",
    "zero3_ulysses.yaml",
    "fsdp_cp.yaml",
]


def checkpoints_in_yaml(config: str) -> bool:
    """The config turns activation checkpointing on itself (FSDP's fsdp_activation_checkpointing)."""
    from common.planning.memory import read_strategy

    return read_strategy(os.path.join(REPO, "accelerate_configs", config), None, None)["activation_checkpointing"]


def run_config(
    config: str,
    steps: int,
    data: str,
    out: str,
    precision: str,
    accumulation: int,
    processes,
    checkpointing: str,
    args,
) -> dict:
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    window = max(steps // 3, 1)
    world = ["--num_processes", str(processes)] if processes and config != "single.yaml" else []
    command = [
        accelerate,
        "launch",
        "--config_file",
        os.path.join(REPO, "accelerate_configs", config),
        *world,
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        precision,
        os.path.join(REPO, "recipes", "causal_lm.py"),
        "--config",
        os.path.join(REPO, "recipes/configs/causal_lm_demo.yaml"),
        "--tokenizer_name_or_path",
        os.path.join(data, "tokenizer"),
        "--train_file",
        os.path.join(data, "train.jsonl"),
        "--validation_file",
        os.path.join(data, "validation.jsonl"),
        "--output_dir",
        out,
        "--max_steps",
        str(steps),
        "--logging_steps",
        str(window),
        "--eval_steps",
        "0",
        "--save_steps",
        "0",
        "--report_to",
        "none",
        "--overwrite_output_dir",
        "--gradient_accumulation_steps",
        str(accumulation),
        "--model_config",
        args.model_config,
        "--per_device_train_batch_size",
        str(args.batch_size),
        "--block_size",
        str(args.block_size),
        "--per_device_eval_batch_size",
        str(args.batch_size),
        "--max_eval_samples",
        "8",
        "--gradient_checkpointing",
        str(checkpointing == "on").lower(),
        *args.recipe_args,
    ]
    result = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    if result.returncode != 0:
        raise SystemExit(f"error: {config} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    run = json.load(open(os.path.join(out, "run.json")))
    with open(os.path.join(out, "final", "config.json")) as handle:
        run["vocab_size"] = json.load(handle)["vocab_size"]  # as the recipe sized it to the tokenizer
    steady = rows[1:] or rows  # the first window includes warm-up
    seconds = steady[-1]["elapsed_s"] - (rows[0]["elapsed_s"] if len(rows) > 1 else 0.0)
    # on when asked, or when the config's FSDP settings turn it on (fsdp_offload.yaml)
    run["activation_checkpointing"] = bool(
        run["args"].get("gradient_checkpointing") or run.get("fsdp_activation_checkpointing")
    )
    return {
        "config": config,
        "precision": run["compute_dtype"],
        "accumulation": accumulation,
        "vocab_size": run["vocab_size"],
        "activation_checkpointing": run["activation_checkpointing"],
        "parameters": run["total_parameters"],
        "processes": run["participating_processes"],
        "type": run["distributed_type"],
        "steps_per_s": window * len(steady) / seconds,
        "tokens_per_s_per_process": sum(r["tokens_per_s_per_device"] for r in steady) / len(steady),
        "peak_mb_per_rank": rows[-1]["peak_memory_mb_per_rank"],
        "final_loss": rows[-1]["loss"],
        "measured_mb": measured_by_category(run),
        "estimated_mb": estimated_by_category(config, run, precision, accumulation, args),
    }


CATEGORIES = ("parameters", "master_weights", "gradients", "optimizer_states", "communication_buffers", "activations")


def measured_by_category(run: dict) -> dict:
    """The memory account of the rank with the highest peak: MB by category, the rest of the
    first step's peak resident set as `process and transients` (with the activations under pp.yaml, whose
    account does not count them: common.training.memory hooks no saved tensors there)."""
    account = max(run["memory_per_rank"], key=lambda a: a["phases"]["first_step"]["peak_rss_mb"])
    mb = {key: account[f"{key}_mb"] or 0.0 for key in CATEGORIES}
    peak = account["phases"]["first_step"]["peak_rss_mb"]
    return {**mb, "process and transients": max(peak - sum(mb.values()), 0.0), "peak": peak}


def estimated_by_category(config: str, run: dict, precision: str, accumulation: int, args) -> dict:
    """scripts/estimate_memory.py for the same model, config, world size, batch, precision,
    accumulation and activation checkpointing (run as a command: its start-up baseline is a
    fresh process's)."""
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "estimate.json")
        command = [
            sys.executable,
            os.path.join(REPO, "scripts", "estimate_memory.py"),
            "--model",
            args.model_config,
            "--config",
            os.path.join(REPO, "accelerate_configs", config),
            "--num_processes",
            str(run["participating_processes"]),
            "--batch_size",
            str(args.batch_size),
            "--seq_len",
            str(args.block_size),
            "--mixed_precision",
            precision,
            "--vocab_size",
            str(run["vocab_size"]),
            "--gradient_accumulation_steps",
            str(accumulation),
            "--json",
            target,
            *(["--gradient_checkpointing"] if run["activation_checkpointing"] else []),
        ]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
        with open(target) as handle:
            estimate = json.load(handle)
    mb = {key: estimate[key] / 2**20 for key in CATEGORIES}
    return {**mb, "process and transients": estimate["peak_mb"] - sum(mb.values()), "peak": estimate["peak_mb"]}


def draw(results: list, path: str, title: str) -> None:
    """Memory per rank by category (measured | estimated, stacked) and steps/s, one row per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['config'].removesuffix('.yaml')} ({r['processes']}p"
        + (f", {r['precision']}" if len({x["precision"] for x in results}) > 1 else "")
        + (f", acc {r['accumulation']}" if len({x["accumulation"] for x in results}) > 1 else "")
        + (", AC" if r["activation_checkpointing"] else "")
        + ")"
        for r in results
    ]
    parts = (*CATEGORIES, "process and transients")
    colors = plt.get_cmap("tab10").colors
    figure, (memory, speed) = plt.subplots(
        1, 2, figsize=(13, 0.55 * len(results) + 1.8), sharey=True, gridspec_kw={"width_ratios": [3, 1]}
    )
    rows = range(len(results))
    for offset, key, hatch in ((-0.2, "measured_mb", None), (0.2, "estimated_mb", "//")):
        left = [0.0] * len(results)
        for index, part in enumerate(parts):
            widths = [r[key][part] for r in results]
            memory.barh(
                [y + offset for y in rows],
                widths,
                height=0.38,
                left=left,
                color=colors[index],
                hatch=hatch,
                edgecolor="white",
                linewidth=0.3,
                label=part.replace("_", " ") if key == "measured_mb" else None,
            )
            left = [a + b for a, b in zip(left, widths)]
    memory.set_yticks(list(rows), labels)
    memory.invert_yaxis()
    memory.set_xlabel("MB per rank: upper bar measured (run.json), hatched bar estimated (estimate_memory.py)")
    memory.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 1.2 / (len(results) + 3)), ncol=4, fontsize=8)
    memory.set_title(title, fontsize=10)
    speed.barh(list(rows), [r["steps_per_s"] for r in results], color="gray")
    speed.set_xlabel("optimizer steps / s")
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CPU_CONFIGS)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--precisions", nargs="+", default=["bf16"], help="bf16 (as the configs ship) and/or no (fp32)"
    )
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1], help="gradient_accumulation_steps values")
    parser.add_argument(
        "--num_processes",
        nargs="+",
        type=int,
        default=[None],
        help="world sizes to run each config on (default: the config's own)",
    )
    parser.add_argument(
        "--activation_checkpointing",
        nargs="+",
        choices=["off", "on"],
        default=["off"],
        help="the recipe's --gradient_checkpointing (fsdp_offload.yaml turns it on in its YAML)",
    )
    parser.add_argument("--model_config", default=os.path.join(REPO, "recipes/configs/tiny_llama.json"))
    parser.add_argument("--batch_size", type=int, default=8, help="per process (global batch: x processes)")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument(
        "--recipe_args",
        nargs=argparse.REMAINDER,
        default=[],
        help="passed to every run, e.g. --recipe_args --sync_each_micro_batch false",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--chart",
        default=os.path.join(REPO, "outputs", "benchmark.png"),
        help="the PNG to draw (memory by category, measured and estimated, and steps/s); '' for none",
    )
    parser.add_argument(
        "--docs",
        help="write the tables (and the chart's link) to this markdown page, e.g. "
        "docs/benchmark.md (make benchmark does)",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from common.data.synthetic import write_markov_corpus

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        write_markov_corpus(data)
        results = [
            run_config(
                c, args.steps, data, os.path.join(tmp, "run"), precision, accumulation, processes, checkpointing, args
            )
            for processes in args.num_processes
            for checkpointing in args.activation_checkpointing
            for c in args.configs
            for precision in args.precisions
            for accumulation in args.accumulation
            if not (c == "single.yaml" and processes not in (None, args.num_processes[0]))
            # a config that turns it on itself runs once ("off" is then that same run)
            and not (checkpointing == "on" and "off" in args.activation_checkpointing and checkpoints_in_yaml(c))
        ]
    reference = next((r for r in results if r["config"] == "ddp.yaml"), results[0])  # the "vs" column's
    baseline, versus = reference["steps_per_s"], f"vs {reference['config'].removesuffix('.yaml')}"
    summary = (
        f"{results[0]['parameters']:,} parameters; batch {args.batch_size} x {args.block_size} tokens per process"
    )
    print(summary)
    print(
        f"{'config':26} {'procs':>5} {'type':10} {'dtype':9} {'accum':>5} {'AC':>3} {'steps/s':>8} {versus:>7} "
        f"{'tok/s/proc':>10} peak MB per rank"
    )
    for r in results:
        print(
            f"{r['config']:26} {r['processes']:>5} {r['type']:10} {r['precision']:9} {r['accumulation']:>5} "
            f"{'on' if r['activation_checkpointing'] else 'off':>3} "
            f"{r['steps_per_s']:8.2f} {r['steps_per_s'] / baseline:7.2f} {r['tokens_per_s_per_process']:10.0f} "
            f"{', '.join(f'{m:.0f}' for m in r['peak_mb_per_rank'])}"
        )
    print("MB per rank (the rank with the highest peak), measured / estimated:")
    for r in results:
        print(
            f"{r['config']:20} {r['processes']}p {'AC ' if r['activation_checkpointing'] else '   '}"
            + "  ".join(
                f"{key.split('_')[0]} {r['measured_mb'][key]:.0f}/{r['estimated_mb'][key]:.0f}"
                for key in (*CATEGORIES, "peak")
            )
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    if args.chart:
        draw(
            results,
            args.chart,
            f"{results[0]['parameters']:,} parameters, batch {args.batch_size} x "
            f"{args.block_size} tokens per process, {args.steps} steps",
        )
        print(f"chart: {args.chart}")
    if args.docs:
        write_docs(args, results, baseline, versus, summary)
    return results


def write_docs(args, results: list, baseline: float, versus: str, summary: str) -> None:
    """The two tables as markdown, with the chart beside the page when it was drawn."""
    from figures import markdown_table, write_page

    speed = markdown_table(
        [
            "config",
            "processes",
            "distributed type",
            "compute dtype",
            "accumulation",
            "activation checkpointing",
            "steps/s",
            versus,
            "tokens/s per process",
            "peak MB per rank",
        ],
        [
            [
                f"`{r['config']}`",
                r["processes"],
                r["type"],
                r["precision"],
                r["accumulation"],
                "on" if r["activation_checkpointing"] else "off",
                f"{r['steps_per_s']:.2f}",
                f"{r['steps_per_s'] / baseline:.2f}",
                f"{r['tokens_per_s_per_process']:.0f}",
                ", ".join(f"{m:.0f}" for m in r["peak_mb_per_rank"]),
            ]
            for r in results
        ],
    )
    memory = markdown_table(
        ["config", "processes", "AC", *[key.replace("_", " ") for key in CATEGORIES], "peak"],
        [
            [
                f"`{r['config']}`",
                r["processes"],
                "on" if r["activation_checkpointing"] else "off",
                *[f"{r['measured_mb'][key]:.0f} / {r['estimated_mb'][key]:.0f}" for key in (*CATEGORIES, "peak")],
            ]
            for r in results
        ],
    )
    chart = ""
    if args.chart:
        chart = f"\n\n![memory by category and steps/s]({os.path.relpath(args.chart, os.path.dirname(os.path.abspath(args.docs)))})"
    write_page(
        args.docs,
        "Strategies: speed and memory per rank",
        (
            f"{summary}; {args.steps} optimizer steps per run, all runs in one invocation (compare rows, not "
            "machines). Steps/s leaves out the first logging window (warm-up)."
            + (
                " A tensor-, sequence- or context-parallel group trains on one batch, so at the same per-device batch "
                "its step holds fewer tokens than a data-parallel one's: compare tokens/s per process there."
                if any(key in r["config"] for r in results for key in ("tp", "ulysses", "_cp"))
                else ""
            )
            + "\n\n"
            + speed
            + "\n\nMemory per rank in MB, measured at the first optimizer step (run.json's `memory_per_rank`, the rank "
            "with the highest peak) / estimated before launch by `make estimate-memory`; peak is the process's peak "
            f"resident set by the first step. {allocator_note()}\n\n" + memory + chart
        ),
    )


def allocator_note() -> str:
    """How far the peak resident set is live memory: glibc keeps freed heap unless told otherwise."""
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if threshold:
        return (
            f"Run with MALLOC_MMAP_THRESHOLD_={threshold}, so large blocks go back to the OS when freed "
            "and the resident set is live memory."
        )
    return (
        "Run without MALLOC_MMAP_THRESHOLD_: glibc keeps freed heap in the resident set, so the measured "
        "peak can exceed the estimate of live memory (set MALLOC_MMAP_THRESHOLD_=131072 to measure live "
        "memory, at a cost in CPU throughput)."
    )


if __name__ == "__main__":
    main()
