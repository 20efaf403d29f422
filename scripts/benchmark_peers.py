"""The recipe against the alternatives on one job, in one run: tokens/s and the ratios.

  recipe    recipes/causal_lm.py, as users launch it (metrics, non-finite guard, progress bar on)
  bare      scripts/peers/bare_loop.py: the plainest accelerate loop (prepare, forward, backward,
            clip, step, schedule; nothing else)
  trainer   scripts/peers/trainer_loop.py: transformers' Trainer, with its defaults

and the DPO job, on `make dpo`'s preference pairs:

  recipe    recipes/dpo.py, as users launch it (its reference model a frozen copy, as under DDP)
  trl       scripts/peers/trl_dpo_loop.py: TRL's DPOTrainer (trl installed by `make benchmark-peers`
            only), with its defaults for what the job leaves open

Same model config (a Llama, built from a config), data (the demo's Markov corpus packed into
blocks), per-device batch, steps, learning rate and linear schedule, gradient clipping at 1.0,
optimizer (torch's fused AdamW, no weight decay) and precision (the accelerate config's; bf16
in ddp.yaml). Each is launched --rounds times, the order rotated each round so that the three
share the machine's slow and fast moments, and timed over the steps after --warmup (on rank
0, after the launch's start-up); tokens/s is the median over the rounds. The DPO job's pairs are
counted as their tokens (prompt and answer, chosen and rejected side, unpadded, at the data's mean):
the same pairs for both, so the ratio is that of pairs per second. Its loss at step 1, before any
update, is log 2 for both (the recipe's from a one-step launch): the same loss type and no extra term,
which is all that step can show, since the reference equals the policy there.

    make benchmark-peers                                  # ddp.yaml: 2 processes, bf16
    make benchmark-peers ARGS="--rounds 5 --steps 60"

With --docs the table goes to docs/benchmark-peers.md (scripts/figures.py).
"""

from __future__ import annotations

import argparse
import importlib.util
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
PAIRS = os.path.join(REPO, "outputs", "data", "preference")
DPO_CONTENDERS = ("recipe", "trl")
DPO_BLOCK, DPO_BETA = 32, 0.1  # recipes/configs/dpo_demo.yaml's; no pair of the data is longer


def model_config(hidden: int, layers: int, folder: str) -> str:
    path = os.path.join(folder, "model.json")
    with open(path, "w") as handle:
        json.dump(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": hidden,
                "intermediate_size": hidden * 8 // 3 // 64 * 64 or 64,
                "num_hidden_layers": layers,
                "num_attention_heads": max(hidden // 64, 1),
                "num_key_value_heads": max(hidden // 64, 1),
                "max_position_embeddings": 2048,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-6,
            },
            handle,
        )
    return path


# The recipes' side of both jobs: nothing but training in the timed steps, and the peers' schedule and clipping.
RECIPE_JOB = [
    "--eval_steps",
    "0",
    "--save_steps",
    "0",
    "--warmup_steps",
    "0",
    "--lr_scheduler_type",
    "linear",
    "--weight_decay",
    "0",
    "--max_grad_norm",
    "1.0",
    "--report_to",
    "none",
    "--seed",
    "0",
]


def accelerate_launch(script: list, args, launcher_args=()) -> subprocess.CompletedProcess:
    """`script` under `accelerate launch` with the job's config and number of processes (and `launcher_args`)."""
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"),
        "launch",
        "--config_file",
        os.path.join(REPO, "accelerate_configs", args.config),
        "--num_processes",
        str(args.num_processes),
        *launcher_args,
        *script,
    ]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True)


def check_ran(what: str, result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        raise SystemExit(f"error: the {what} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")


def check_processes(what: str, measured: dict, args) -> dict:
    """`measured`, once it is known to come from every process (a launch can silently train each rank alone)."""
    if measured["processes"] != args.num_processes:
        raise SystemExit(
            f"error: the {what} run trained on {measured['processes']} process(es), not {args.num_processes}"
        )
    return measured


def recipe_windows(out: str, args, rate: str, per_window: int) -> dict:
    """A recipe's run.json and logged windows (rows with `rate`), and the seconds of those after the warm-up
    (every logging window is --warmup steps of `per_window` units, counted at `rate` per second)."""
    with open(os.path.join(out, "run.json")) as handle:
        record = json.load(handle)
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle if f'"{rate}"' in line]
    timed = [row for row in rows if row["step"] > args.warmup]
    return {"run": record, "rows": rows, "timed": timed, "seconds": sum(per_window / row[rate] for row in timed)}


def launch(
    contender: str,
    args,
    config: str,
    folder: str,
    round_: int,
    recipe_args=(),
    name: str | None = None,
    launcher_args=(),
    peer_args=(),
) -> dict:
    """One launch of `contender` (the recipe with `recipe_args` added, a peer with `peer_args`, under
    `accelerate launch` with `launcher_args`); returns its seconds and tokens over the timed steps, or {"refused": the recipe's one-line
    error} when the recipe refused its arguments."""
    out = os.path.join(folder, f"{name or contender}_{round_}")
    job = ["--block_size", str(args.block_size), "--learning_rate", str(args.learning_rate)]
    data = [
        "--train_file",
        os.path.join(DATA, "train.jsonl"),
        "--validation_file",
        os.path.join(DATA, "validation.jsonl"),
    ]
    if contender == "recipe":
        script = [
            os.path.join(REPO, "recipes", "causal_lm.py"),
            "--model_config",
            config,
            "--tokenizer_name_or_path",
            os.path.join(DATA, "tokenizer"),
            *data,
            *job,
            "--output_dir",
            out,
            "--per_device_train_batch_size",
            str(args.batch_size),
            "--max_steps",
            str(args.steps),
            "--logging_steps",
            str(args.warmup),
            "--max_eval_samples",
            "200",
            *RECIPE_JOB,
            *recipe_args,
        ]
    else:
        script = [
            os.path.join(REPO, "scripts", "peers", f"{contender}_loop.py"),
            "--model_config",
            config,
            "--tokenizer",
            os.path.join(DATA, "tokenizer"),
            *data,
            *job,
            "--batch_size",
            str(args.batch_size),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--out",
            out + ".json",
            *peer_args,
        ]
    result = accelerate_launch(script, args, launcher_args)
    refusal = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if result.returncode != 0 and contender == "recipe" and refusal:
        return {"refused": refusal[0]}
    check_ran(contender, result)
    if contender == "recipe":
        return check_processes(contender, recipe_figures(out, args), args)
    with open(out + ".json") as handle:
        return check_processes(contender, json.load(handle), args)


def recipe_figures(out: str, args) -> dict:
    """The recipe's own logged windows after the warm-up."""
    window = args.warmup * args.batch_size * args.block_size * args.num_processes  # every token of a block is a label
    logged = recipe_windows(out, args, "tokens_per_s", window)
    last = logged["timed"][-1]
    # the model's training FLOPs per token (common.flops), read off the recipe's log: the same for every contender
    tflops, mfu = last.get("tflops_per_device"), last.get("mfu")
    return {
        "seconds": logged["seconds"],
        "tokens": window * len(logged["timed"]),
        "loss": last["loss"],
        "flops_per_token": tflops and tflops * 1e12 / last["tokens_per_s_per_device"],
        "peak_tflops": mfu and tflops / mfu,
        "processes": logged["run"]["participating_processes"],
        "peak_mb": max(last["peak_memory_mb_per_rank"]),
    }


def mfu(tokens_per_s: float, args, figures: dict) -> float:
    """MFU at `tokens_per_s` on the job: `figures` (recipe_figures') FLOPs per token over the device's peak."""
    return tokens_per_s / args.num_processes * figures["flops_per_token"] / 1e12 / figures["peak_tflops"]


def launch_dpo(contender: str, args, config: str, folder: str, round_: int, steps=None) -> dict:
    """One launch of the DPO job: seconds and pairs over the timed steps, the loss at step 1 (TRL's; the
    recipe's when `steps` is 1, a one-step launch that logs it)."""
    steps = steps or args.steps
    out = os.path.join(folder, f"dpo_{contender}_{round_}_{steps}")
    job = ["--block_size", str(DPO_BLOCK), "--learning_rate", str(args.learning_rate), "--beta", str(DPO_BETA)]
    train = os.path.join(PAIRS, "train.jsonl")
    if contender == "recipe":
        script = [
            os.path.join(REPO, "recipes", "dpo.py"),
            "--model_config",
            config,
            "--tokenizer_name_or_path",
            os.path.join(PAIRS, "tokenizer"),
            "--train_file",
            train,
            "--validation_file",
            os.path.join(PAIRS, "validation.jsonl"),
            "--max_eval_samples",
            "16",
            *job,
            "--output_dir",
            out,
            "--per_device_train_batch_size",
            str(args.batch_size),
            "--max_steps",
            str(steps),
            "--logging_steps",
            str(min(args.warmup, steps)),
            *RECIPE_JOB,
        ]
    else:
        script = [
            os.path.join(REPO, "scripts", "peers", "trl_dpo_loop.py"),
            "--model_config",
            config,
            "--tokenizer",
            os.path.join(PAIRS, "tokenizer"),
            "--train_file",
            train,
            "--validation_file",
            os.path.join(PAIRS, "validation.jsonl"),
            *job,
            "--batch_size",
            str(args.batch_size),
            "--steps",
            str(steps),
            "--warmup",
            str(args.warmup),
            "--out",
            out + ".json",
        ]
    check_ran(f"DPO {contender}", accelerate_launch(script, args))
    if contender == "trl":
        with open(out + ".json") as handle:
            return check_processes(f"DPO {contender}", json.load(handle), args)
    window = args.warmup * args.batch_size * args.num_processes  # pairs (the recipe's samples_per_s counts pairs)
    logged = recipe_windows(out, args, "samples_per_s", window)
    cut = logged["run"]["pairs_cut_or_dropped"]
    if any(cut.values()):
        raise SystemExit(f"error: the recipe cut or dropped pairs ({cut}): the two would not train on the same pairs")
    rows = logged["rows"]
    return check_processes(
        f"DPO {contender}",
        {
            "seconds": logged["seconds"],
            "pairs": window * len(logged["timed"]),
            "first_loss": rows[0]["loss"] if rows[0]["step"] == 1 else None,
            "processes": logged["run"]["participating_processes"],
        },
        args,
    )


def tokens_per_pair() -> float:
    """The pairs' mean tokens, both sides (prompt and answer each, unpadded), under the data's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(PAIRS, "tokenizer"))
    with open(os.path.join(PAIRS, "train.jsonl")) as handle:
        pairs = [json.loads(line) for line in handle]
    return 2 * statistics.fmean(
        len(tokenizer.apply_chat_template(pair["prompt"] + pair[side], return_dict=True)["input_ids"])
        for pair in pairs
        for side in ("chosen", "rejected")
    )


def dpo_job(args, config: str, folder: str) -> tuple[str, str]:
    """The recipe's DPO against TRL's DPOTrainer, rounds interleaved: the printed table and the page's section."""
    speeds = {name: [] for name in DPO_CONTENDERS}
    first = {"recipe": launch_dpo("recipe", args, config, folder, 0, steps=1)["first_loss"]}
    per_pair = tokens_per_pair()
    for round_ in range(args.rounds):
        for contender in DPO_CONTENDERS[round_ % 2 :] + DPO_CONTENDERS[: round_ % 2]:
            result = launch_dpo(contender, args, config, folder, round_)
            first.setdefault(contender, result.get("first_loss"))
            speeds[contender].append(result["pairs"] / result["seconds"] * per_pair)
            print(f"round {round_ + 1}: dpo {contender:6s} {speeds[contender][-1]:10.0f} tokens/s", flush=True)
    speed = {name: statistics.median(values) for name, values in speeds.items()}
    header = ["DPO run", "tokens/s (median)", "pairs/s", "recipe / this", "loss at step 1", "each round's tokens/s"]
    rows = [
        [
            name,
            f"{speed[name]:.0f}",
            f"{speed[name] / per_pair:.1f}",
            f"{speed['recipe'] / speed[name]:.2f}x",
            f"{first[name]:.6f}",
            ", ".join(f"{v:.0f}" for v in speeds[name]),
        ]
        for name in DPO_CONTENDERS
    ]
    ratio = f"recipe / TRL DPOTrainer: {speed['recipe'] / speed['trl']:.3f}x"
    return markdown_table(header, rows) + "\n" + ratio, "\n\n".join(
        [
            f"`{args.config}` on {args.num_processes} processes; the same Llama; `make dpo`'s pairs ({per_pair:.1f} tokens "
            f"a pair, both sides), per-device batch {args.batch_size} pairs, beta {DPO_BETA}, sigmoid loss; {args.steps} "
            f"steps, timed after step {args.warmup}; {args.rounds} rounds, interleaved.",
            markdown_table(header, rows),
            f"**{ratio}** (above 1: the recipe is faster).",
            "Both score a pair's chosen and rejected side in one forward of the policy and one of a frozen copy "
            "(the reference), with the sigmoid loss (log 2 at step 1, where the reference equals the policy) and no "
            "activation checkpointing (TRL's default is on; here it is turned off for both). For what the job leaves "
            "open each keeps its defaults: TRL's DPOTrainer computes, every step, the entropy, the token accuracy and "
            "the mean logits of each side for its log, and wraps the model in DDP with find_unused_parameters=True "
            "(Trainer's default without checkpointing); the recipe's log carries the loss, the rewards and the "
            "gradient norm. The two initialise the model each its own way and shuffle the pairs each its own way, "
            "so their later losses are not comparable step by step.",
        ]
    )


def job_parser(description: str) -> argparse.ArgumentParser:
    """The job's options (config, processes, model size, batch, steps, rounds, --docs), shared with
    scripts/benchmark_options.py."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
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


def job_choices(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--jobs",
        nargs="+",
        choices=("causal", "dpo"),
        default=["causal", "dpo"],
        help="the jobs to run (the page holds the ones run)",
    )
    parser.add_argument(
        "--torch_compile",
        action="store_true",
        help="the causal job with torch.compile in all three, as each one's users turn it on: the recipe's "
        "--torch_compile (accelerate's regional compilation), the bare loop's Accelerator with the same "
        "dynamo plugin, Trainer's torch_compile=True",
    )
    return parser


def check_job(args) -> None:
    if args.steps <= args.warmup or (args.steps - args.warmup) % args.warmup:
        raise SystemExit(
            f"error: --steps {args.steps} must exceed --warmup {args.warmup} by a multiple of it "
            "(the recipe's logging windows are the timed stretches)"
        )
    if not os.path.isfile(os.path.join(DATA, "train.jsonl")):
        raise SystemExit(f"error: no demo data in {DATA}; run `make demo-data` (the benchmark targets do)")


def job_line(args) -> str:
    return (
        f"`{args.config}` on {args.num_processes} processes; a Llama of hidden size {args.hidden} and "
        f"{args.layers} layers built from a config; per-device batch {args.batch_size} x {args.block_size} "
        f"tokens; {args.steps} steps, timed after step {args.warmup}; {args.rounds} rounds, interleaved."
    )


CAUSAL_NOTES = (
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
    "one run.",
)


def main(argv=None):
    args = job_choices(job_parser(__doc__)).parse_args(argv)
    check_job(args)
    if "dpo" in args.jobs and not os.path.isfile(os.path.join(PAIRS, "train.jsonl")):
        raise SystemExit(f"error: no preference pairs in {PAIRS}; run `make benchmark-peers` (it writes them)")
    if "dpo" in args.jobs and importlib.util.find_spec("trl") is None:
        raise SystemExit(
            "error: trl is not installed (the DPO job's peer); run `make benchmark-peers`, which installs it"
        )
    sections = [job_line(args)]
    if args.torch_compile:
        sections.append(
            "All three compiled: the recipe with --torch_compile true (accelerate's regional compilation), the "
            "bare loop's Accelerator with the same dynamo plugin, Trainer with torch_compile=True (its own: the "
            "whole model). The compile happens in the warm-up steps, before the timed ones."
        )
    title, packages = (
        "The recipes against a bare accelerate loop, Trainer and TRL",
        ("trl",) if "dpo" in args.jobs else (),
    )

    def publish(more: list[str]) -> None:  # the page as it stands: a later launch cut short keeps the earlier ones
        if args.docs:
            write_page(args.docs, title, "\n\n".join(sections + more), packages=packages)

    with tempfile.TemporaryDirectory() as folder:
        config = model_config(args.hidden, args.layers, folder)
        if "causal" in args.jobs:
            sections += causal_job(args, config, folder, publish)
        if "dpo" in args.jobs:
            dpo_table, dpo_section = dpo_job(args, config, folder)
            print(dpo_table)
            sections += ["## DPO: recipes/dpo.py against TRL's DPOTrainer", dpo_section]
    publish([])


def causal_job(args, config: str, folder: str, publish) -> list[str]:
    """The causal-LM recipe against the bare loop and Trainer, rounds interleaved: the page's paragraphs
    (`publish` gets them after each launch, with the contenders timed so far)."""
    results, figures = {name: [] for name in CONTENDERS}, {}
    compiled = ["--torch_compile", "true"] if args.torch_compile else []
    for round_ in range(args.rounds):
        order = CONTENDERS[round_ % 3 :] + CONTENDERS[: round_ % 3]
        for contender in order:
            result = launch(contender, args, config, folder, round_, recipe_args=compiled, peer_args=compiled)
            figures.setdefault(contender, result)
            results[contender].append(result["tokens"] / result["seconds"])
            print(
                f"round {round_ + 1}: {contender:8s} {results[contender][-1]:10.0f} tokens/s "
                f"(loss {result['loss']:.3f})",
                flush=True,
            )
            publish(causal_sections(args, results, figures, quiet=True))
    return causal_sections(args, results, figures)


def causal_sections(args, results: dict, figures: dict, quiet=False) -> list[str]:
    """The table, the ratios and MFU for the contenders timed so far (medians over their rounds)."""
    timed = [name for name in CONTENDERS if results[name]]
    speed = {name: statistics.median(results[name]) for name in timed}
    header = ["run", "tokens/s (median)", "recipe / this", "each round's tokens/s"]
    rows = [
        [
            name,
            f"{speed[name]:.0f}",
            f"{speed['recipe'] / speed[name]:.2f}x" if "recipe" in speed else "-",
            ", ".join(f"{v:.0f}" for v in results[name]),
        ]
        for name in timed
    ]
    recipe = figures.get("recipe")
    mfu_line = None
    if recipe and recipe["peak_tflops"]:  # a GPU in common.flops' table: MFU from the recipe's FLOPs per token
        header.insert(2, "MFU")
        for row, name in zip(rows, timed):
            row.insert(2, f"{mfu(speed[name], args, recipe):.1%}")
        mfu_line = (
            f"MFU: training FLOPs per token {recipe['flops_per_token'] / 1e9:.2f} G (common.flops: "
            f"6N + 12 L H Q T) x tokens/s per device / the device's dense bf16 peak, "
            f"{recipe['peak_tflops']:.1f} TFLOP/s. The recipe's peak memory (CUDA allocator): "
            f"{recipe['peak_mb'] / 1024:.1f} GiB."
        )
    peers = {"bare": "bare loop", "trainer": "Trainer"}
    ratios = "; ".join(
        f"recipe / {label}: **{speed['recipe'] / speed[name]:.3f}x**"
        for name, label in peers.items()
        if name in speed and "recipe" in speed
    )
    ratios = ratios and ratios + " (above 1: the recipe is faster)."
    missing = [name for name in CONTENDERS if name not in speed]
    if missing:
        ratios += f" Not timed (the run was cut short): {', '.join(missing)}."
    if not quiet:
        print(markdown_table(header, rows))
        print(ratios.replace("**", ""))
    return [markdown_table(header, rows), ratios] + ([mfu_line] if mfu_line else []) + list(CAUSAL_NOTES)


if __name__ == "__main__":
    main()
