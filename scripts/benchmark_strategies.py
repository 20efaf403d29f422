"""Throughput and peak memory of a causal LM under each accelerate config.

Runs recipes/causal_lm.py for --steps optimizer steps per config (and per
precision, accumulation and extra recipe arguments asked for), all in one
invocation so the figures compare on the same (noisy, shared) machine, and prints
steps/s, tokens/s per process, peak memory per rank, and each run's speed as a
ratio to the first DDP run. On a CPU-only host these are CPU figures (peak
resident set size).

    python scripts/benchmark_strategies.py --steps 60
    python scripts/benchmark_strategies.py --configs ddp.yaml fsdp.yaml --precisions bf16 no
    # memory with accumulation, at 101M parameters:
    python scripts/benchmark_strategies.py --model_config recipes/configs/llama_100m.json --steps 3 \
        --batch_size 1 --block_size 64 --accumulation 1 4 --configs fsdp.yaml zero3.yaml
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CONFIGS = ["single.yaml", "ddp.yaml", "fsdp.yaml", "fsdp_shard_grad_op.yaml", "fsdp_offload.yaml",
               "zero1.yaml", "zero2.yaml", "zero2_offload.yaml", "zero2_json.yaml", "zero3.yaml", "zero3_offload.yaml"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_config(config: str, steps: int, data: str, out: str, precision: str, accumulation: int, args) -> dict:
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    window = max(steps // 3, 1)
    command = [accelerate, "launch", "--config_file", os.path.join(REPO, "accelerate_configs", config),
               "--main_process_port", str(free_port()), "--mixed_precision", precision,
               os.path.join(REPO, "recipes", "causal_lm.py"),
               "--config", os.path.join(REPO, "recipes/configs/causal_lm_demo.yaml"),
               "--tokenizer_name_or_path", os.path.join(data, "tokenizer"),
               "--train_file", os.path.join(data, "train.jsonl"), "--validation_file", os.path.join(data, "validation.jsonl"),
               "--output_dir", out, "--max_steps", str(steps), "--logging_steps", str(window),
               "--eval_steps", "0", "--save_steps", "0", "--report_to", "none", "--overwrite_output_dir",
               "--gradient_accumulation_steps", str(accumulation), "--model_config", args.model_config,
               "--per_device_train_batch_size", str(args.batch_size), "--block_size", str(args.block_size),
               "--per_device_eval_batch_size", str(args.batch_size), "--max_eval_samples", "8", *args.recipe_args]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    if result.returncode != 0:
        raise SystemExit(f"error: {config} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    run = json.load(open(os.path.join(out, "run.json")))
    steady = rows[1:] or rows  # the first window includes warm-up
    seconds = steady[-1]["elapsed_s"] - (rows[0]["elapsed_s"] if len(rows) > 1 else 0.0)
    return {"config": config, "precision": run["compute_dtype"], "accumulation": accumulation,
            "parameters": run["total_parameters"],
            "processes": run["participating_processes"], "type": run["distributed_type"],
            "steps_per_s": window * len(steady) / seconds,
            "tokens_per_s_per_process": sum(r["tokens_per_s_per_device"] for r in steady) / len(steady),
            "peak_mb_per_rank": rows[-1]["peak_memory_mb_per_rank"], "final_loss": rows[-1]["loss"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CPU_CONFIGS)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--precisions", nargs="+", default=["bf16"], help="bf16 (as the configs ship) and/or no (fp32)")
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1], help="gradient_accumulation_steps values")
    parser.add_argument("--model_config", default=os.path.join(REPO, "recipes/configs/tiny_llama.json"))
    parser.add_argument("--batch_size", type=int, default=8, help="per process (global batch: x processes)")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--recipe_args", nargs=argparse.REMAINDER, default=[],
                        help="passed to every run, e.g. --recipe_args --sync_each_micro_batch false")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from common.synthetic import write_markov_corpus

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        write_markov_corpus(data)
        results = [run_config(c, args.steps, data, os.path.join(tmp, "run"), precision, accumulation, args)
                   for c in args.configs for precision in args.precisions for accumulation in args.accumulation]
    baseline = next((r["steps_per_s"] for r in results if r["config"] == "ddp.yaml"), results[0]["steps_per_s"])
    print(f"{results[0]['parameters']:,} parameters; batch {args.batch_size} x {args.block_size} tokens per process")
    print(f"{'config':26} {'procs':>5} {'type':10} {'dtype':9} {'accum':>5} {'steps/s':>8} {'vs ddp':>7} "
          f"{'tok/s/proc':>10} peak MB per rank")
    for r in results:
        print(f"{r['config']:26} {r['processes']:>5} {r['type']:10} {r['precision']:9} {r['accumulation']:>5} "
              f"{r['steps_per_s']:8.2f} {r['steps_per_s'] / baseline:7.2f} {r['tokens_per_s_per_process']:10.0f} "
              f"{', '.join(f'{m:.0f}' for m in r['peak_mb_per_rank'])}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
