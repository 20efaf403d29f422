"""The recipe against the alternatives on one job, in one run: tokens/s and the ratios.

  recipe    recipes/causal_lm.py, as users launch it (metrics, non-finite guard, progress bar on)
  bare      scripts/peers/bare_loop.py: the plainest accelerate loop (prepare, forward, backward,
            clip, step, schedule; nothing else)
  trainer   scripts/peers/trainer_loop.py: transformers' Trainer, with its defaults

Same model config (a Llama, built from a config), data (the demo's Markov corpus packed into
blocks), per-device batch, steps, learning rate and linear schedule, gradient clipping at 1.0,
optimizer (torch's fused AdamW, no weight decay) and precision (the accelerate config's; bf16
in ddp.yaml). Each is launched --rounds times, the order rotated each round so that the three
share the machine's slow and fast moments, and timed over the steps after --warmup (on rank
0, after the launch's start-up); tokens/s is the median over the rounds.

    make benchmark-peers                                  # ddp.yaml: 2 processes, bf16
    make benchmark-peers ARGS="--rounds 5 --steps 60"

With --docs the table goes to docs/benchmark-peers.md (scripts/figures.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from figures import markdown_table, write_page  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "outputs", "data", "markov")
CONTENDERS = ("recipe", "bare", "trainer")


def model_config(hidden: int, layers: int, folder: str) -> str:
    path = os.path.join(folder, "model.json")
    with open(path, "w") as handle:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
                   "intermediate_size": hidden * 8 // 3 // 64 * 64 or 64, "num_hidden_layers": layers,
                   "num_attention_heads": max(hidden // 64, 1), "num_key_value_heads": max(hidden // 64, 1),
                   "max_position_embeddings": 2048, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}, handle)
    return path


def launch(contender: str, args, config: str, folder: str, round_: int, recipe_args=(), name: str | None = None) -> dict:
    """One launch of `contender` (the recipe with `recipe_args` added); returns its seconds and tokens over the
    timed steps, or {"refused": the recipe's one-line error} when the recipe refused its arguments."""
    out = os.path.join(folder, f"{name or contender}_{round_}")
    job = ["--block_size", str(args.block_size), "--learning_rate", str(args.learning_rate)]
    data = ["--train_file", os.path.join(DATA, "train.jsonl"), "--validation_file", os.path.join(DATA, "validation.jsonl")]
    if contender == "recipe":
        script = [os.path.join(REPO, "recipes", "causal_lm.py"), "--model_config", config, "--tokenizer_name_or_path",
                  os.path.join(DATA, "tokenizer"), *data, *job, "--output_dir", out, "--per_device_train_batch_size",
                  str(args.batch_size), "--max_steps", str(args.steps), "--logging_steps", str(args.warmup),
                  "--eval_steps", "0", "--save_steps", "0", "--max_eval_samples", "200", "--warmup_steps", "0",
                  "--lr_scheduler_type", "linear", "--weight_decay", "0", "--max_grad_norm", "1.0",
                  "--report_to", "none", "--seed", "0", *recipe_args]
    else:
        script = [os.path.join(REPO, "scripts", "peers", f"{contender}_loop.py"), "--model_config", config,
                  "--tokenizer", os.path.join(DATA, "tokenizer"), *data, *job, "--batch_size", str(args.batch_size),
                  "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", out + ".json"]
    command = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
               os.path.join(REPO, "accelerate_configs", args.config), "--num_processes", str(args.num_processes),
               *script]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    refusal = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if result.returncode != 0 and contender == "recipe" and refusal:
        return {"refused": refusal[0]}
    if result.returncode != 0:
        raise SystemExit(f"error: the {contender} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    if contender != "recipe":
        with open(out + ".json") as handle:
            measured = json.load(handle)
    else:
        measured = recipe_figures(out, args)
    if measured["processes"] != args.num_processes:  # a launch can silently train each rank alone
        raise SystemExit(f"error: the {contender} run trained on {measured['processes']} process(es), not "
                         f"{args.num_processes}")
    return measured


def recipe_figures(out: str, args) -> dict:
    """The recipe's own logged windows after the warm-up (every logging window is --warmup steps)."""
    with open(os.path.join(out, "run.json")) as handle:
        processes = json.load(handle)["participating_processes"]
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle if '"tokens_per_s"' in line]
    window = args.warmup * args.batch_size * args.block_size * args.num_processes  # every token of a block is a label
    timed = [row for row in rows if row["step"] > args.warmup]
    return {"seconds": sum(window / row["tokens_per_s"] for row in timed), "tokens": window * len(timed),
            "loss": timed[-1]["loss"], "processes": processes, "peak_mb": max(timed[-1]["peak_memory_mb_per_rank"]),
            "allocated_mb": max(timed[-1].get("memory_allocated_mb_per_rank") or [0])}


def job_parser(description: str) -> argparse.ArgumentParser:
    """The job's options (config, processes, model size, batch, steps, rounds, --docs), shared with
    scripts/benchmark_options.py."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--config", default="ddp.yaml", help="an accelerate config in accelerate_configs/")
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", default=None, help="write the table to this markdown page")
    return parser


def check_job(args) -> None:
    if args.steps <= args.warmup or (args.steps - args.warmup) % args.warmup:
        raise SystemExit(f"error: --steps {args.steps} must exceed --warmup {args.warmup} by a multiple of it "
                         "(the recipe's logging windows are the timed stretches)")
    if not os.path.isfile(os.path.join(DATA, "train.jsonl")):
        raise SystemExit(f"error: no demo data in {DATA}; run `make demo-data` (the benchmark targets do)")


def job_line(args) -> str:
    return (f"`{args.config}` on {args.num_processes} processes; a Llama of hidden size {args.hidden} and "
            f"{args.layers} layers built from a config; per-device batch {args.batch_size} x {args.block_size} "
            f"tokens; {args.steps} steps, timed after step {args.warmup}; {args.rounds} rounds, interleaved.")


def main(argv=None):
    args = job_parser(__doc__).parse_args(argv)
    check_job(args)
    results = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as folder:
        config = model_config(args.hidden, args.layers, folder)
        for round_ in range(args.rounds):
            order = CONTENDERS[round_ % 3:] + CONTENDERS[:round_ % 3]
            for contender in order:
                result = launch(contender, args, config, folder, round_)
                results[contender].append(result["tokens"] / result["seconds"])
                print(f"round {round_ + 1}: {contender:8s} {results[contender][-1]:10.0f} tokens/s "
                      f"(loss {result['loss']:.3f})", flush=True)

    speed = {name: statistics.median(values) for name, values in results.items()}
    header = ["run", "tokens/s (median)", "recipe / this", "each round's tokens/s"]
    rows = [[name, f"{speed[name]:.0f}", f"{speed['recipe'] / speed[name]:.2f}x",
             ", ".join(f"{v:.0f}" for v in results[name])] for name in CONTENDERS]
    print(markdown_table(header, rows))
    print(f"recipe / bare loop: {speed['recipe'] / speed['bare']:.3f}x; recipe / Trainer: "
          f"{speed['recipe'] / speed['trainer']:.3f}x")
    if args.docs:
        write_page(args.docs, "The recipe against a bare accelerate loop and Trainer", "\n\n".join([
            job_line(args), markdown_table(header, rows),
            f"recipe / bare loop: **{speed['recipe'] / speed['bare']:.3f}x**; recipe / Trainer: "
            f"**{speed['recipe'] / speed['trainer']:.3f}x** (above 1: the recipe is faster).",
            "What each does per optimizer step besides the model's work: the recipe and Trainer average the "
            "loss over the global batch's label tokens, which takes one all-reduce of the token count per step "
            "(right for any data; here every block is full, so a per-rank mean would give the same loss): "
            "Trainer's holds every rank at the start of each step, the recipe's runs a step ahead, during "
            "the previous step's work (common.training.TrainBatches); the bare loop averages per rank. The "
            "recipe also keeps its metrics on the device (read on logging steps only), checks losses for "
            "non-finite values without a collective or a host read between logging steps (the clipped "
            "gradient norm decides on the device) and updates a progress bar. Under DDP the recipe's "
            "gradients are views into DDP's all-reduce buckets (gradient_as_bucket_view, common.accelerator); "
            "the bare loop and Trainer keep torch's default, which copies every gradient into its bucket and "
            "the reduced values back at each step.",
            "What a profile of the three (py-spy, rank 0, 150 steps) shows besides: Trainer wraps the model in "
            "DDP with find_unused_parameters=True, its default for a model without activation checkpointing, "
            "so every forward is followed by a search of the autograd graph; the recipe and the bare loop "
            "take accelerate's default (False). The bare loop and Trainer keep the model's use_cache, so each "
            "training forward also fills a key/value cache nobody reads; the recipes turn it off "
            "(common.model). The rounds' spread is a few percent on a shared 2-core host: compare ratios from "
            "one run."]))


if __name__ == "__main__":
    main()
