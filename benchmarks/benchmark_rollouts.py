"""GRPO's rollouts under each config: generation speed per device against DDP's, the once-per-rollout gather of
sharded weights, the update's speed and the peak memory, all in one invocation (compare rows, not machines).

Runs recipes/grpo.py for --steps optimizer steps per config on --num_processes processes, on a model built from
--model_config (llama_100m.json: 101M parameters with the demo tokenizer), reading each run's metrics: the
rollout's completion tokens per second per device (`rollout/tokens_per_s_per_device`, generation only), the
gather's seconds (`rollout/gather_s_per_device`: FSDP2's, ZeRO-3's and tensor parallelism's copy of the
whole weights, once per rollout), the update's tokens/s, and each rank's peak memory through the last training
step (which holds the rollout's copy and KV cache; the export after it gathers the whole model and is left out).
The first step is left out (warm-up). Each config runs --rounds times, the
order rotated each round so that the configs share the host's slow and fast moments; the medians are shown. With
--docs the table goes to a page (make benchmark-rollouts writes docs/benchmark-rollouts.md).

    python benchmarks/benchmark_rollouts.py --configs ddp.yaml zero3.yaml zero3_offload.yaml fsdp.yaml tp.yaml \
        zero3.yaml:stages fsdp.yaml:stages      # NAME:stages: with --rollout_weights stages (no whole copy)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from common.launch.peers import free_port


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [
    "ddp.yaml",
    "zero3.yaml",
    "zero3_offload.yaml",
    "fsdp.yaml",
    "tp.yaml",
    "zero3.yaml:stages",
    "fsdp.yaml:stages",
]


def run_config(entry: str, args, data: str, out: str, live_memory: bool = False) -> dict:
    config, _, how = entry.partition(":")  # "fsdp.yaml:stages": with --rollout_weights stages
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"),
        "launch",
        "--config_file",
        os.path.join(REPO, "accelerate_configs", config),
        "--num_processes",
        str(args.num_processes),
        "--main_process_port",
        str(free_port()),
        os.path.join(REPO, "recipes/grpo.py"),
        "--model_config",
        args.model_config,
        "--tokenizer_name_or_path",
        os.path.join(data, "tokenizer"),
        "--train_file",
        os.path.join(data, "train.jsonl"),
        "--validation_file",
        os.path.join(data, "validation.jsonl"),
        "--reward_funcs",
        "format",
        "--num_generations",
        str(args.num_generations),
        "--max_completion_length",
        str(args.max_completion_length),
        "--block_size",
        str(args.max_completion_length + 16),
        "--per_device_train_batch_size",
        str(args.num_generations),
        "--max_steps",
        str(args.steps),
        "--logging_steps",
        "1",
        "--max_eval_samples",
        "2",
        "--output_dir",
        out,
        "--overwrite_output_dir",
        "--report_to",
        "none",
        *(("--rollout_weights", how) if how else ()),
    ]
    # live_memory: glibc's heap otherwise keeps what set-up freed (the model built whole, then sharded) in the
    # resident set: about 500 MB per rank at 101M under zero3.yaml, not tensors the run holds. Large blocks mapped
    # and unmapped each time let the resident set show what the estimate counts, but every such block then costs
    # page faults again (autocast's bf16 copies of ddp's fp32 weights at each decoded token among them): seen at
    # 101M, ddp.yaml's generation 0.84-0.92x and its update 0.78-0.84x of glibc's default, zero3.yaml's generation
    # 0.97-1.03x. So the speeds come from runs with glibc's default, as users run.
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "131072"} if live_memory else {})}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{entry} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train = [r for r in rows if "loss" in r][1:]  # the first step warms up
    record = json.load(open(os.path.join(out, "run.json")))

    def mean(key):
        return sum(r[key] for r in train) / len(train)

    sys.path.insert(0, os.path.join(REPO, "scripts"))  # make estimate-memory's tool
    import estimate_memory
    from transformers import AutoTokenizer

    estimated = estimate_memory.main(
        [
            "--model", args.model_config,
            "--vocab_size", str(len(AutoTokenizer.from_pretrained(os.path.join(data, "tokenizer")))),
            "--config", os.path.join(REPO, "accelerate_configs", config),
            "--num_processes", str(args.num_processes),
            "--batch_size", str(args.num_generations),
            "--seq_len", str(args.max_completion_length + 16),
            "--grpo_generations", str(args.num_generations),
            *(("--rollout_stages",) if how == "stages" else ()),
        ]
    )  # fmt: skip
    return {
        "estimated_peak_mb": estimated["peak_mb"],
        "estimated_copy_mb": estimated["rollout_weights"] / 2**20,
        "config": entry,
        "weights": record["rollout"]["weights"],
        "copy_mb": record["rollout"]["copy_bytes_per_rank"] / 2**20,
        "generate_tokens_per_s": mean("rollout/tokens_per_s_per_device"),
        "gather_s": mean("rollout/gather_s_per_device"),
        "generate_s": mean("rollout/generate_s_per_device"),
        "update_tokens_per_s": mean("tokens_per_s_per_device"),
        # through the last training step, before the export gathers the whole model to write final/
        "peak_mb": [row["peak_memory_mb_per_rank"] for row in rows if "peak_memory_mb_per_rank" in row][-1],
        "whole_run_peak_mb": [
            rank.get("peak_allocated_mb") or rank.get("peak_rss_mb") for rank in record["peak_memory_whole_run"]
        ],
        "parameters": record["total_parameters"],
    }


def median_run(runs: list[dict], live: dict) -> dict:
    """One config's rounds: the median of each speed and time, the highest resident peak under glibc's default, and
    the live peak of its run with large blocks unmapped when freed."""
    merged = dict(runs[-1])
    for key in ("generate_tokens_per_s", "gather_s", "generate_s", "update_tokens_per_s"):
        merged[key] = statistics.median(r[key] for r in runs)
    merged["default_peak_mb"] = [max(peaks) for peaks in zip(*(r["peak_mb"] for r in runs))]
    merged["peak_mb"] = live["peak_mb"]
    return merged


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--model_config", default=os.path.join(REPO, "recipes/configs/llama_100m.json"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_completion_length", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="runs per config, in a rotated order; medians shown")
    parser.add_argument("--docs", help="write the table to this markdown page")
    args = parser.parse_args(argv)
    from common.data.synthetic import write_prompt_data

    args.load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        write_prompt_data(data, train=64, validation=4)
        runs = {config: [] for config in args.configs}
        for round_ in range(args.rounds):  # each round in another order: the configs share the host's slow moments
            shift = round_ % len(args.configs)
            for config in args.configs[shift:] + args.configs[:shift]:
                runs[config].append(run_config(config, args, data, os.path.join(tmp, f"{config}-{round_}")))
        live = {c: run_config(c, args, data, os.path.join(tmp, f"{c}-live"), live_memory=True) for c in args.configs}
        results = [median_run(runs[config], live[config]) for config in args.configs]
    args.load.append(os.getloadavg()[0])
    base = next((r for r in results if r["config"] == "ddp.yaml"), results[0])
    for r in results:
        r["versus"] = r["generate_tokens_per_s"] / base["generate_tokens_per_s"]
        print(
            f"{r['config']:<20} generate {r['generate_tokens_per_s']:8.1f} tokens/s per device "
            f"({r['versus']:.2f}x {base['config']}), gather {r['gather_s']:.2f} s per rollout, update "
            f"{r['update_tokens_per_s']:.0f} tokens/s, peak MB {', '.join(f'{m:.0f}' for m in r['peak_mb'])} "
            f"(glibc's default: {', '.join(f'{m:.0f}' for m in r['default_peak_mb'])})"
        )
    if args.docs:
        write_docs(args, results, base)
    return results


def write_docs(args, results, base) -> None:
    from figures import markdown_table, write_page

    table = markdown_table(
        [
            "config",
            "weights sampled from",
            "copy MB per rank (estimated)",
            "generation tokens/s per device",
            f"vs {base['config']}",
            "gather s per rollout",
            "generation s per rollout",
            "update tokens/s per device",
            "peak MB per rank",
            "estimated peak MB",
            "resident peak MB, glibc's default",
        ],
        [
            [
                f"`{r['config']}`",
                r["weights"],
                f"{r['copy_mb']:.0f} ({r['estimated_copy_mb']:.0f})",
                f"{r['generate_tokens_per_s']:.1f}",
                f"{r['versus']:.2f}",
                f"{r['gather_s']:.2f}",
                f"{r['generate_s']:.2f}",
                f"{r['update_tokens_per_s']:.0f}",
                ", ".join(f"{m:.0f}" for m in r["peak_mb"]),
                f"{r['estimated_peak_mb']:.0f}",
                ", ".join(f"{m:.0f}" for m in r["default_peak_mb"]),
            ]
            for r in results
        ],
    )
    write_page(
        args.docs,
        "GRPO rollouts: generation speed and memory per config",
        f"{results[0]['parameters']:,} parameters, {args.num_processes} processes, the configs' mixed precision; "
        f"{args.num_generations} completions of {args.max_completion_length} tokens at most per prompt, one prompt "
        f"per process a step, {args.steps} steps (the first left out), {args.rounds} rounds in rotated order "
        f"(medians), then one run each for the peak; the host's load average {args.load[0]:.1f} at the start, "
        f"{args.load[1]:.1f} at the end"
        f"{' (above its core count, other work shared it: compare with care)' if max(args.load) > os.cpu_count() else ''}. "
        "Generation tokens/s counts the completions' "
        "tokens per second of generation on each device (the gather of sharded weights apart, in its own column); "
        "the peak is each rank's through the last training step (the export that follows gathers the whole model "
        "and is left out; the allocator's peak on a GPU; on a CPU the resident set of a run with glibc's "
        "MALLOC_MMAP_THRESHOLD_=131072, so that memory freed during set-up, which glibc's default keeps, leaves it), "
        "beside `make estimate-memory ... --grpo_generations G`'s. The speeds come from runs with glibc's default, "
        "as users run: with the threshold every large block freed is unmapped and mapped again a page fault at a "
        "time, which slowed ddp.yaml's decoding (its autocast makes bf16 copies of the fp32 weights at each token) "
        "by 8-16% in a paired run here and the sharded configs' by less; the last column is those runs' highest "
        "resident peak.\n\n" + table,
    )


if __name__ == "__main__":
    main()
