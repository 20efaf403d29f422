"""Memory per pipeline stage, measured against `make estimate-memory` (common/planning/memory.py's estimate_stages).

Launches recipes/causal_lm.py at 101M parameters (recipes/configs/llama_100m.json, the demo tokenizer's vocabulary)
under pp.yaml with each schedule asked (a copy of the config with parallelism_config_pp_schedule set) and under
dp_pp.yaml on 4 processes, bf16 as the configs ship, with glibc returning freed blocks to the OS
(MALLOC_MMAP_THRESHOLD_=131072, as tests/test_memory.py measures), so a rank's resident set is its live memory. For
each rank: the model state its memory account counted (run.json) against the estimate's, and its peak resident set
through the last training step (metrics.jsonl's peak_memory_mb_per_rank, logged before the export gathers the whole
model) against the estimate's peak for its stages, the process start-up included; also the peak by the first step
(which other configs' tables use: there AdamW's moments do not yet exist during the first forward and backward).

    python benchmarks/benchmark_pipeline_memory.py --docs docs/benchmark-pipeline-memory.md     # about 5 minutes
    python benchmarks/benchmark_pipeline_memory.py --runs pp.yaml:1F1B --block_size 64 --accumulation 2
    python benchmarks/benchmark_pipeline_memory.py --model_name_or_path outputs/models/SmolLM2-135M-Instruct \
        --runs pp.yaml:1F1B --block_size 512      # a vocabulary of 49,152: the last stage's logits count
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import yaml

from common.launch.peers import free_port


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ["pp.yaml:GPipe", "pp.yaml:1F1B", "pp.yaml:Interleaved1F1B", "dp_pp.yaml:1F1B"]
LIVE_RSS = {"MALLOC_MMAP_THRESHOLD_": "131072"}
MB = 2**20


def config_with_schedule(entry: str, tmp: str) -> str:
    """`pp.yaml:GPipe`: pp.yaml with that schedule, written beside the runs."""
    name, _, schedule = entry.partition(":")
    config = yaml.safe_load(open(os.path.join(REPO, "accelerate_configs", name)))
    if schedule:
        config["parallelism_config"]["parallelism_config_pp_schedule"] = schedule
    path = os.path.join(tmp, f"{name.removesuffix('.yaml')}_{schedule or 'shipped'}.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(config, handle)
    return path


def measure(entry: str, args, tmp: str, data: str) -> dict:
    """One launch: each rank's account and peaks, and the estimate of each of its stages."""
    config = config_with_schedule(entry, tmp)
    out = os.path.join(tmp, entry.replace(":", "_").replace(".yaml", ""))
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"),
        "launch",
        *("--config_file", config, "--main_process_port", str(free_port())),
        os.path.join(REPO, "recipes/causal_lm.py"),
        *("--config", os.path.join(REPO, "recipes/configs/causal_lm_demo.yaml")),
        *(
            ("--model_name_or_path", args.model_name_or_path, "--model_config", "", "--tokenizer_name_or_path", "")
            if args.model_name_or_path
            else ("--model_config", args.model_config, "--tokenizer_name_or_path", os.path.join(data, "tokenizer"))
        ),
        *(
            "--train_file",
            os.path.join(data, "train.jsonl"),
            "--validation_file",
            os.path.join(data, "validation.jsonl"),
        ),
        *("--output_dir", out, "--overwrite_output_dir", "--max_steps", str(args.steps)),
        *("--block_size", str(args.block_size), "--per_device_train_batch_size", str(args.batch_size)),
        *("--per_device_eval_batch_size", str(args.batch_size), "--max_eval_samples", "64"),
        *("--gradient_accumulation_steps", str(args.accumulation), "--logging_steps", "1"),
        *("--eval_steps", "0", "--save_steps", "0", "--report_to", "none"),
    ]
    env = {**os.environ, **LIVE_RSS, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"error: {entry} failed:\n{result.stderr[-3000:]}")
    run = json.load(open(os.path.join(out, "run.json")))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    peaks = [row["peak_memory_mb_per_rank"] for row in rows if "loss" in row and "peak_memory_mb_per_rank" in row]
    vocab = json.load(open(os.path.join(out, "final", "config.json")))["vocab_size"]  # the tokenizer's
    estimate = os.path.join(tmp, "estimate.json")
    subprocess.run(  # a fresh process: its start-up is a run's (benchmarks/benchmark_strategies.py does the same)
        [
            sys.executable,
            os.path.join(REPO, "scripts/estimate_memory.py"),
            *("--model", args.model_name_or_path or args.model_config, "--vocab_size", str(vocab), "--config", config),
            *("--num_processes", str(run["participating_processes"]), "--batch_size", str(args.batch_size)),
            *("--seq_len", str(args.block_size), "--gradient_accumulation_steps", str(args.accumulation)),
            *("--json", estimate),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    estimated = json.load(open(estimate))
    size = estimated["strategy"]["pp_size"]
    ranks = []
    for rank, account in enumerate(run["memory_per_rank"]):
        stage = estimated["stages"][rank % size]  # a data-parallel replica's rank r holds what rank r mod p does
        ranks.append(
            {
                "rank": rank,
                "stage_indices": stage["stage_indices"],
                "layers": stage["layers"],
                "in_flight": stage["in_flight"],
                "last_stage": size * estimated["strategy"]["stages_per_rank"] - 1,
                "model_state_mb": account["model_state_mb"],
                "estimated_model_state_mb": stage["model_state"] / MB,
                "first_step_peak_mb": account["phases"]["first_step"]["peak_rss_mb"],
                "peak_mb": peaks[-1][rank],
                "estimated_peak_mb": stage["peak_mb"],
            }
        )
    return {
        "run": entry,
        "processes": run["participating_processes"],
        "parameters": run["total_parameters"],
        "compute_dtype": run["compute_dtype"],
        "schedule": estimated["strategy"]["pp_schedule"],
        "steps": len(peaks),
        "baseline_mb": estimated["process_baseline_mb"],
        "ranks": ranks,
    }


def stage_label(index: int, layers: list, last: int) -> str:
    """`0: embeddings, layers 0-3`."""
    ends = (["embeddings"] if index == 0 else []) + [f"layers {layers[0]}-{layers[-1]}"]
    return f"{index}: " + ", ".join(ends + (["norm and head"] if index == last else []))


def gap(measured: float, estimated: float) -> str:
    return f"{100 * (measured - estimated) / estimated:+.1f}%"


def write_docs(path: str, results: list, args, seconds: float, loads: list) -> None:
    from figures import markdown_table, write_page

    rows = []
    for result in results:
        for rank in result["ranks"]:
            stages = "; ".join(
                stage_label(index, layers, rank["last_stage"])
                for index, layers in zip(rank["stage_indices"], rank["layers"])
            )
            rows.append(
                [
                    f"`{result['run']}`",
                    result["processes"],
                    rank["rank"],
                    stages,
                    rank["in_flight"],
                    f"{rank['model_state_mb']:.0f} / {rank['estimated_model_state_mb']:.0f}",
                    f"{rank['peak_mb']:.0f} / {rank['estimated_peak_mb']:.0f}",
                    gap(rank["peak_mb"], rank["estimated_peak_mb"]),
                    f"{rank['first_step_peak_mb']:.0f} ({gap(rank['first_step_peak_mb'], rank['estimated_peak_mb'])})",
                ]
            )
    table = markdown_table(
        [
            "run",
            "processes",
            "rank",
            "its stages",
            "micro-batches in flight (estimated)",
            "model state MB, measured / estimated",
            "peak MB, measured / estimated",
            "gap",
            "peak by the first step, MB (gap)",
        ],
        rows,
    )
    first = results[0]
    write_page(
        path,
        "Pipeline parallelism: memory per stage, measured and estimated",
        f"{first['parameters']:,} parameters ("
        + (
            f"`{args.model_name_or_path}` with its own tokenizer"
            if args.model_name_or_path
            else f"`{os.path.relpath(args.model_config, REPO)}`, the demo tokenizer's vocabulary"
        )
        + f"), {first['compute_dtype']}, each micro-batch {args.batch_size} x {args.block_size} tokens, "
        f"{args.accumulation} micro-batches per step (the accumulation), {args.steps} steps per run; "
        "`recipes/causal_lm.py` under `pp.yaml` with each schedule and under `dp_pp.yaml` (2 pipelines of 2 stages). "
        f"Run with MALLOC_MMAP_THRESHOLD_=131072, so a rank's resident set is its live memory. The whole script took "
        f"{seconds:.0f} s; the host's 1-minute load average was {loads[0]:.1f} at its start and {loads[1]:.1f} at its "
        "end.\n\n"
        "Measured: each rank's model state as its memory account counted it at the first optimizer step (run.json), "
        "and its peak resident set through the last training step (metrics.jsonl, before the export gathers the "
        "whole model). Estimated: `make estimate-memory` for the same model, config, micro-batch and accumulation, "
        f"one row per stage (a process's start-up, {first['baseline_mb']:.0f} MB here, in each peak). The last column "
        "is the peak by the first step, which other configs' tables use: AdamW's moments are made in the first "
        "optimizer step, after that step's forward and backward, so the first step peaks lower than the later "
        "ones.\n\n" + table,
    )


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=RUNS, help="CONFIG:SCHEDULE, the config's pipeline configs")
    parser.add_argument("--model_config", default=os.path.join(REPO, "recipes/configs/llama_100m.json"))
    parser.add_argument(
        "--model_name_or_path",
        help="a pretrained Llama folder (its own tokenizer and vocabulary) instead of --model_config, e.g. make "
        "real-model's SmolLM2-135M-Instruct (its head tied to its embeddings)",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--docs", help="write the table to this page (make benchmark-pipeline-memory does)")
    args = parser.parse_args(argv)
    for entry in args.runs:
        name = entry.partition(":")[0]
        if not os.path.isfile(os.path.join(REPO, "accelerate_configs", name)):
            raise SystemExit(
                f"error: --runs {entry}: no accelerate_configs/{name}; pass CONFIG:SCHEDULE, e.g. pp.yaml:1F1B"
            )
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common.data.synthetic import write_markov_corpus

    began, load = time.perf_counter(), os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        write_markov_corpus(data)
        for entry in args.runs:
            results.append(measure(entry, args, tmp, data))
            for rank in results[-1]["ranks"]:
                print(
                    f"{entry} rank {rank['rank']}: model state {rank['model_state_mb']:.0f} MB (estimated "
                    f"{rank['estimated_model_state_mb']:.0f}), peak {rank['peak_mb']:.0f} MB (estimated "
                    f"{rank['estimated_peak_mb']:.0f}, {gap(rank['peak_mb'], rank['estimated_peak_mb'])}), by the "
                    f"first step {rank['first_step_peak_mb']:.0f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    if args.docs:
        write_docs(args.docs, results, args, time.perf_counter() - began, [load, os.getloadavg()[0]])
    return results


if __name__ == "__main__":
    main()
