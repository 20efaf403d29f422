"""Expert parallelism against the data-parallel configs on a small mixture-of-experts model: tokens/s, peak memory and
model state per rank, and the all-to-all traffic against its formula, written to docs/benchmark-moe.md.

Launches recipes/causal_lm.py on a Qwen3-MoE built from a config (8 experts, 2 per token; --hidden_size and --layers
size it) under ddp.yaml, fsdp.yaml and ep.yaml at each --processes, and fsdp_ep.yaml from 4 (ep.yaml with its sizes set
to the processes, fsdp_ep.yaml with ep_size half of them: copies written beside the runs), as the configs ship (bf16;
fp32 on a CPU without bf16 instructions, as a user's run there). Per run: tokens/s (the median of the train lines after
the first), the peak resident set per rank through training (its largest rank), the model state per rank (run.json's
memory account), and under ep.yaml and fsdp_ep.yaml the megabytes each rank sends per step (the run's `all_to_all_mb`,
counted from the routing: common.parallel.expert_parallel.Traffic) against the formula for even routing:

    4 x layers x tokens per rank per step x experts per token x (ep - 1) / ep x hidden size x bytes per element

(4: the dispatch and the combine, forward and backward). Ratios, not seconds, are the result: the configs run one
after another on the same machine.

    make benchmark-moe                                   # 2 and 4 processes, about 5 minutes on 2 cores
    python benchmarks/benchmark_moe.py --processes 2 --steps 4 --docs /tmp/moe.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from figures import markdown_table, write_page  # noqa: E402

from common.launch.peers import free_port  # noqa: E402


CONFIGS = ("ddp.yaml", "fsdp.yaml", "ep.yaml", "fsdp_ep.yaml")  # fsdp_ep.yaml from 4 processes: ep_size half of them
MB = 2**20


def moe_config(folder: str, hidden: int, layers: int) -> str:
    """A Qwen3-MoE config: 8 experts of width `hidden` x 2, top-2, the router's loss on."""
    path = os.path.join(folder, "moe.json")
    with open(os.path.join(REPO, "recipes/configs/tiny_qwen3_moe.json")) as handle:
        config = json.load(handle)
    heads = max(2, hidden // 64)
    config.update(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
    )
    with open(path, "w") as handle:
        json.dump(config, handle)
    return path


def expert_split(name: str, processes: int) -> int:
    """The ep_size a config runs at over `processes`: all of them (ep.yaml), half (fsdp_ep.yaml), none (1)."""
    return {"ep.yaml": processes, "fsdp_ep.yaml": processes // 2}.get(name, 1)


def config_for(name: str, processes: int, folder: str) -> str:
    """The shipped config, or an expert-parallel one with its sizes set for `processes`."""
    import yaml

    path = os.path.join(REPO, "accelerate_configs", name)
    if expert_split(name, processes) == 1:
        return path
    with open(path) as handle:
        config = yaml.safe_load(handle)
    config["num_processes"] = processes
    config["parallelism_config"].update(
        parallelism_config_dp_shard_size=processes, parallelism_config_ep_size=expert_split(name, processes)
    )
    out = os.path.join(folder, f"{name.removesuffix('.yaml')}_{processes}.yaml")
    with open(out, "w") as handle:
        yaml.safe_dump(config, handle)
    return out


def measure(name: str, processes: int, args, folder: str, data: str, model: str) -> dict:
    out = os.path.join(folder, f"{name.removesuffix('.yaml')}_{processes}")
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"),
        "launch",
        *("--config_file", config_for(name, processes, folder), "--num_processes", str(processes)),
        *("--main_process_port", str(free_port())),
        os.path.join(REPO, "recipes/causal_lm.py"),
        *("--config", os.path.join(REPO, "recipes/configs/causal_lm_demo.yaml"), "--model_config", model),
        *("--tokenizer_name_or_path", os.path.join(data, "tokenizer")),
        *(
            "--train_file",
            os.path.join(data, "train.jsonl"),
            "--validation_file",
            os.path.join(data, "validation.jsonl"),
        ),
        *("--output_dir", out, "--overwrite_output_dir", "--max_steps", str(args.steps), "--logging_steps", "1"),
        *("--block_size", str(args.block_size), "--per_device_train_batch_size", str(args.batch_size)),
        *("--gradient_accumulation_steps", "1", "--eval_steps", "0", "--save_steps", "0", "--report_to", "none"),
        *("--max_eval_samples", "16"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"error: {name} on {processes} processes failed:\n{result.stderr[-3000:]}")
    with open(os.path.join(out, "run.json")) as handle:
        record = json.load(handle)
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle if '"loss"' in line]
    assert record["participating_processes"] == processes, record["participating_processes"]
    with open(model) as handle:
        config = json.load(handle)
    c = 2 if record["compute_dtype"] == "bfloat16" else 4
    tokens = args.batch_size * args.block_size  # per rank per step (accumulation 1)
    ep = expert_split(name, processes)
    formula = 4 * config["num_hidden_layers"] * tokens * 2 * (ep - 1) / ep * config["hidden_size"] * c
    return {
        "config": name,
        "processes": processes,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]),
        "peak_mb": max(max(r["peak_memory_mb_per_rank"]) for r in rows),
        "model_state_mb": max(rank["model_state_mb"] for rank in record["memory_per_rank"]),
        "all_to_all_mb": statistics.mean(r["all_to_all_mb"] for r in rows) if "all_to_all_mb" in rows[0] else None,
        "formula_mb": formula / MB if ep > 1 else None,
        "parameters": record["total_parameters"],
        "dtype": record["compute_dtype"],
        "loss": rows[-1]["loss"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--docs", default=None, help="the page to write (docs/benchmark-moe.md)")
    args = parser.parse_args(argv)
    from common.data.synthetic import write_markov_corpus

    with tempfile.TemporaryDirectory() as folder:
        data = os.path.join(folder, "data")
        write_markov_corpus(data, train_docs=600, validation_docs=20, seed=0)
        model = moe_config(folder, args.hidden_size, args.layers)
        results = []
        for processes in args.processes:
            for name in (name for name in CONFIGS if name != "fsdp_ep.yaml" or processes >= 4 and processes % 2 == 0):
                results.append(measure(name, processes, args, folder, data, model))
                print(json.dumps(results[-1]), flush=True)
    rows = []
    for r in results:
        ddp = next(x for x in results if x["processes"] == r["processes"] and x["config"] == "ddp.yaml")
        rows.append(
            [
                f"`{r['config']}`",
                r["processes"],
                f"{r['tokens_per_s']:.0f}",
                f"{r['tokens_per_s'] / ddp['tokens_per_s']:.2f}",
                f"{r['peak_mb']:.0f}",
                f"{r['model_state_mb']:.1f}",
                f"{r['model_state_mb'] / ddp['model_state_mb']:.2f}",
                "-" if r["all_to_all_mb"] is None else f"{r['all_to_all_mb']:.2f}",
                "-" if r["formula_mb"] is None else f"{r['formula_mb']:.2f}",
                f"{r['loss']:.4f}",
            ]
        )
    table = markdown_table(
        [
            "config",
            "processes",
            "tokens/s",
            "vs ddp",
            "peak MB per rank",
            "model state MB per rank",
            "vs ddp",
            "all-to-all MB per rank per step",
            "formula (even routing)",
            f"loss at step {args.steps}",
        ],
        rows,
    )
    first = results[0]
    body = (
        f"A Qwen3-MoE of {first['parameters'] / 1e6:.1f}M parameters (8 experts, 2 per token, hidden size "
        f"{args.hidden_size}, {args.layers} layers) trained by `recipes/causal_lm.py` for {args.steps} steps, "
        f"{args.batch_size} rows of {args.block_size} tokens per rank per step, in {first['dtype']}; each config "
        "after the other on the same machine (processes beyond its cores share them: compare within a row group).\n\n"
        f"{table}\n\n"
        "The all-to-all column is the run's own `all_to_all_mb` (each off-rank (token, expert) pair counted from the "
        "routing, four crossings); the formula assumes the router spreads the tokens evenly, so the gap is the "
        "routing's imbalance across ranks. ddp.yaml holds the whole model on each rank; fsdp.yaml, ep.yaml and "
        "fsdp_ep.yaml 1/N of it: ep.yaml without gathering any expert, fsdp_ep.yaml gathering its group's experts "
        "over the N / ep_size groups (its all-to-alls inside a group of ep_size ranks).\n"
    )
    if args.docs:
        write_page(
            args.docs,
            "Expert parallelism: ep.yaml and fsdp_ep.yaml against ddp.yaml and fsdp.yaml on a small MoE",
            body,
        )
    else:
        print(body)


if __name__ == "__main__":
    main()
