"""The recipe against the alternatives on one job, in one run: tokens/s and the ratios.

  recipe    recipes/causal_lm.py, as users launch it (metrics, non-finite guard, progress bar on)
  bare      benchmarks/peers/bare_loop.py: the plainest accelerate loop (prepare, forward, backward,
            clip, step, schedule; nothing else)
  trainer   benchmarks/peers/trainer_loop.py: transformers' Trainer, with its defaults

and the DPO job, on `make dpo`'s preference pairs:

  recipe    recipes/dpo.py, as users launch it (its reference model a frozen copy, as under DDP)
  trl       benchmarks/peers/trl_dpo_loop.py: TRL's DPOTrainer (trl installed by `make benchmark-peers`
            only), with its defaults for what the job leaves open

Same model config (a Llama, built from a config), data (the demo's Markov corpus packed into
blocks), per-device batch, steps, learning rate and linear schedule, gradient clipping at 1.0,
optimizer (torch's fused AdamW, no weight decay) and precision (the accelerate config's; bf16
in ddp.yaml). Each is launched --rounds times, the order rotated each round so that the three
share the machine's slow and fast moments, and timed over the steps after --warmup (on rank
0, after the launch's start-up); tokens/s is the median over the rounds. The DPO job's pairs are
counted as their tokens (prompt and answer, chosen and rejected side, unpadded, at the data's mean):
the same pairs for both, so the ratio is that of pairs per second. Its loss at step 1, before any
update, is log 2 for both (the recipe's from a one-step launch, or from its timed launch at --warmup 1):
the same loss type and no extra term, which is all that step can show, since the reference equals the
policy there.

and the GRPO job, on `make grpo`'s prompts, under each of --grpo_configs (ddp.yaml and zero3.yaml):

  recipe    recipes/grpo.py, as users launch it (the `accuracy` reward, rollouts from common.objectives.rollout)
  trl       benchmarks/peers/trl_grpo_loop.py: TRL's GRPOTrainer with plain `model.generate` (no vLLM), the
            same reward as a Python function (common.objectives.rewards.accuracy_reward)

the same G (--num_generations), --max_completion_length, --temperature (0.7, make demo-grpo's), loss type dapo,
beta 0, one iteration a rollout, per-device batch (completions, in both), steps and learning rate, from the same
initial weights. Its tokens/s counts the prompt and completion tokens of the completions trained on (padding
left out), each step from its rollout to its optimizer step; the loss and the mean reward at step 1 are
shown side by side (they differ by sampling: the page says why). Then both on the same completions (TRL's
peer drawing them with the recipe's sampler), fp32, two steps: each figure both log, side by side, and the
largest difference.

and the distillation job, on `make sft`'s arithmetic chats, with a teacher made here (the job's model, another seed):

  recipe    recipes/distill.py, as users launch it (the teacher held as DPO's reference, the student's samples)
  trl       benchmarks/peers/trl_gkd_loop.py: TRL's GKDTrainer (its generate on the rank's batch)

from the same initial weights, with GKDTrainer's defaults (lmbda 0.5, beta 0.5, temperature 0.9), at most
--max_completion_length sampled tokens, the same per-device batch, steps and learning rate; tokens/s counts the
tokens of the batches trained on (prompt and completion, padding left out), generation included.

    make benchmark-peers                                  # ddp.yaml: 2 processes, bf16; GRPO also zero3.yaml
    make benchmark-peers ARGS="--rounds 5 --steps 60"
    make benchmark-peers ARGS="--jobs grpo --grpo_configs zero3.yaml"

With --docs the table goes to docs/benchmark-peers.md (benchmarks/figures.py).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from figures import markdown_table, write_page  # noqa: E402


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "outputs", "data", "markov")
CONTENDERS = ("recipe", "bare", "trainer")
PAIRS = os.path.join(REPO, "outputs", "data", "preference")
DPO_CONTENDERS = ("recipe", "trl")
DPO_BLOCK, DPO_BETA = 32, 0.1  # recipes/configs/dpo_demo.yaml's; no pair of the data is longer
PROMPTS = os.path.join(REPO, "outputs", "data", "prompts")
GRPO_CONTENDERS = ("recipe", "trl")
GRPO_CONFIGS = ("ddp.yaml", "zero3.yaml")
GRPO_PROMPT_ROOM = 16  # the recipe's --block_size less --max_completion_length: the prompts have 8 tokens at most
CHATS = os.path.join(REPO, "outputs", "data", "arithmetic")
DISTILL_CONTENDERS = ("recipe", "trl")
# GKDTrainer's defaults, which distill.py shares (the job's --max_completion_length is their max_new_tokens)
DISTILL_LMBDA, DISTILL_BETA, DISTILL_TEMPERATURE, DISTILL_BLOCK = 0.5, 0.5, 0.9, 64
JOBS = ("causal", "dpo", "grpo", "distill")
# grpo-same: the GRPO job's comparison on the same completions alone, without its timed rounds
JOB_CHOICES = (*JOBS, "grpo-same")


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


@functools.cache
def falls_back_to_fp32(config: str) -> bool:
    """Whether `config` asks for bf16 on a CPU host without bf16 instructions, where the recipes train in fp32
    (common.launch.cpu_host) while the peers would emulate bf16, many times slower: every contender is then
    launched with --mixed_precision no."""
    import torch
    import yaml

    from common.launch.cpu_host import cpu_runs_bf16

    with open(os.path.join(REPO, "accelerate_configs", config)) as handle:
        asked = yaml.safe_load(handle).get("mixed_precision")
    return asked == "bf16" and not torch.cuda.is_available() and not cpu_runs_bf16()


def accelerate_launch(script: list, args, launcher_args=(), config: str | None = None) -> subprocess.CompletedProcess:
    """`script` under `accelerate launch` with `config` (the job's --config unless given) and the job's number of
    processes (and `launcher_args`), in fp32 where the recipes fall back to it (`falls_back_to_fp32`)."""
    config = config or args.config
    precision = (
        ["--mixed_precision", "no"] if falls_back_to_fp32(config) and "--mixed_precision" not in launcher_args else []
    )
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"),
        "launch",
        "--config_file",
        os.path.join(REPO, "accelerate_configs", config),
        "--num_processes",
        str(args.num_processes),
        *precision,
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
    `accelerate launch` with `launcher_args`); returns its seconds and tokens over the timed steps, or
    {"refused": the recipe's one-line error} when the recipe refused its arguments."""
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
            os.path.join(REPO, "benchmarks", "peers", f"{contender}_loop.py"),
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
    # the model's training FLOPs per token (common.training.flops), read off the recipe's log: the same for every
    # contender
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


@dataclass(frozen=True)
class TrlJob:
    """A recipe against its TRL trainer on one job: the two scripts, the data folder (train.jsonl,
    validation.jsonl, tokenizer/), the arguments both take, the recipe's own, and the run.json entry that
    counts what the recipe cut or dropped of the data (none allowed: both must train on the same rows)."""

    name: str
    recipe: str
    peer: str
    data: str
    both: tuple
    recipe_only: tuple
    dropped: str


def dpo_spec(args) -> TrlJob:
    both = ("--block_size", str(DPO_BLOCK), "--learning_rate", str(args.learning_rate), "--beta", str(DPO_BETA))
    return TrlJob("DPO", "dpo.py", "trl_dpo_loop.py", PAIRS, both, (), "pairs_cut_or_dropped")


def grpo_spec(args) -> TrlJob:
    both = (
        "--block_size",
        str(GRPO_PROMPT_ROOM + args.max_completion_length),
        "--learning_rate",
        str(args.learning_rate),
        "--num_generations",
        str(args.num_generations),
        "--max_completion_length",
        str(args.max_completion_length),
        "--temperature",
        str(args.temperature),
    )
    # what TRL's peer fixes in its GRPOConfig (the recipe's defaults, spelled out)
    recipe_only = ("--reward_funcs", "accuracy", "--loss_type", "dapo", "--beta", "0", "--num_iterations", "1")
    recipe_only += ("--top_p", "1.0", "--scale_rewards", "group")
    return TrlJob("GRPO", "grpo.py", "trl_grpo_loop.py", PROMPTS, both, recipe_only, "prompts_dropped")


def distill_spec(args, teacher: str) -> TrlJob:
    both = (
        "--block_size",
        str(DISTILL_BLOCK),
        "--learning_rate",
        str(args.learning_rate),
        "--lmbda",
        str(args.distill_lmbda),
    )
    both += ("--beta", str(DISTILL_BETA), "--temperature", str(DISTILL_TEMPERATURE))
    both += ("--max_new_tokens", str(args.max_completion_length), "--teacher_model_name_or_path", teacher)
    recipe_only = ("--max_generation_samples", "16")  # the held-out exact match after the timed steps: 16 questions
    return TrlJob("Distill", "distill.py", "trl_gkd_loop.py", CHATS, both, recipe_only, "dropped_examples")


def distill_teacher(config: str, folder: str) -> str:
    """The job's teacher: the job's model, initialised with another seed (a teacher unlike the student: the job
    times the two trainers, not what the student learns), saved with the chats' tokenizer, for both to load."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from common.models.loading import initialise_weights

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(CHATS, "tokenizer"))
    settings = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config, vocab_size=len(tokenizer), **settings))
    initialise_weights(model, 1)
    out = os.path.join(folder, "teacher")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def launch_trl_job(
    job: TrlJob,
    contender: str,
    args,
    config: str,
    folder: str,
    round_,
    accelerate_config=None,
    steps=None,
    launcher_args=(),
    peer_args=(),
) -> dict:
    """One launch of `job`'s recipe or TRL peer (with `peer_args`) under `accelerate_config` (the job's --config
    unless given; `launcher_args` to `accelerate launch`): seconds, samples (pairs, completions) and, for the
    recipe, input tokens over the timed steps, its logged lines ("rows") and the first ("first": TRL's; the
    recipe's when `steps` is 1, a one-step launch that logs it)."""
    steps = steps or args.steps
    accelerate_config = accelerate_config or args.config
    stem = os.path.splitext(accelerate_config)[0]
    out = os.path.join(folder, f"{job.name.lower()}_{contender}_{stem}_{round_}_{steps}")
    data = ["--train_file", os.path.join(job.data, "train.jsonl")]
    data += ["--validation_file", os.path.join(job.data, "validation.jsonl")]
    if contender == "recipe":
        script = [
            os.path.join(REPO, "recipes", job.recipe),
            "--model_config",
            config,
            "--tokenizer_name_or_path",
            os.path.join(job.data, "tokenizer"),
            *data,
            "--max_eval_samples",
            "16",
            *job.both,
            *job.recipe_only,
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
            os.path.join(REPO, "benchmarks", "peers", job.peer),
            "--model_config",
            config,
            "--tokenizer",
            os.path.join(job.data, "tokenizer"),
            *data,
            *job.both,
            "--batch_size",
            str(args.batch_size),
            "--steps",
            str(steps),
            "--warmup",
            str(args.warmup),
            "--out",
            out + ".json",
            *peer_args,
        ]
    what = f"{job.name} {contender} ({accelerate_config})"
    check_ran(what, accelerate_launch(script, args, launcher_args, config=accelerate_config))
    if contender == "trl":
        with open(out + ".json") as handle:
            return check_processes(what, json.load(handle), args)
    window = args.warmup * args.batch_size * args.num_processes  # samples: the recipe's samples_per_s counts them
    logged = recipe_windows(out, args, "samples_per_s", window)
    dropped = logged["run"][job.dropped]
    if any(dropped.values()):
        raise SystemExit(
            f"error: the {job.name} recipe cut or dropped rows ({dropped}): the two would not train on the same data"
        )
    rows = logged["rows"]
    return check_processes(
        what,
        {
            "seconds": logged["seconds"],
            "samples": window * len(logged["timed"]),
            # input tokens (padding left out): each window's tokens/s times its seconds
            "tokens": sum(row["tokens_per_s"] * window / row["samples_per_s"] for row in logged["timed"]),
            "first": rows[0] if rows[0]["step"] == 1 else None,
            "rows": rows,
            "distributed_type": logged["run"]["distributed_type"],
            "run": logged["run"],
            "processes": logged["run"]["participating_processes"],
        },
        args,
    )


def recipe_first_step(job: TrlJob, args, config: str, folder: str, timed: dict, accelerate_config=None) -> dict:
    """The recipe's logged line at step 1: its timed launch's when that logged it (--warmup 1), else a one-step
    launch's."""
    return (
        timed["first"] or launch_trl_job(job, "recipe", args, config, folder, 0, accelerate_config, steps=1)["first"]
    )


def interleaved(contenders: tuple, args, launch_one, tokens_per_s, label: str) -> dict:
    """`launch_one(contender, round_)` for each contender, --rounds times, the order rotated each round so that
    they share the machine's slow and fast moments: each one's results, in round order."""
    results = {name: [] for name in contenders}
    for round_ in range(args.rounds):
        shift = round_ % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            results[contender].append(launch_one(contender, round_))
            speed = tokens_per_s(results[contender][-1])
            print(f"round {round_ + 1}: {label} {contender:6s} {speed:10.0f} tokens/s", flush=True)
    return results


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
    job, per_pair = dpo_spec(args), tokens_per_pair()
    results = interleaved(
        DPO_CONTENDERS,
        args,
        lambda contender, round_: launch_trl_job(job, contender, args, config, folder, round_),
        lambda result: result["samples"] / result["seconds"] * per_pair,
        "dpo",
    )
    check_same_strategy("DPO", results)
    first = {
        "recipe": recipe_first_step(job, args, config, folder, results["recipe"][0])["loss"],
        "trl": results["trl"][0]["first_loss"],
    }
    speeds = {name: [r["samples"] / r["seconds"] * per_pair for r in runs] for name, runs in results.items()}
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
            f"`{args.config}` on {args.num_processes} processes; the same Llama; `make dpo`'s pairs ({per_pair:.1f} "
            f"tokens a pair, both sides), per-device batch {args.batch_size} pairs, beta {DPO_BETA}, sigmoid loss; "
            f"{args.steps} steps, timed after step {args.warmup}; {args.rounds} rounds, interleaved.",
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


def distill_job(args, config: str, folder: str) -> tuple[str, str]:
    """The recipe's distillation against TRL's GKDTrainer, rounds interleaved: the printed table and the page's
    section."""
    job = distill_spec(args, distill_teacher(config, folder))
    results = interleaved(
        DISTILL_CONTENDERS,
        args,
        lambda contender, round_: launch_trl_job(job, contender, args, config, folder, round_),
        lambda result: result["tokens"] / result["seconds"],
        "distill",
    )
    check_same_strategy("distillation", results)
    first = {
        "recipe": recipe_first_step(job, args, config, folder, results["recipe"][0])["loss"],
        "trl": results["trl"][0]["first_loss"],
    }
    speeds = {
        name: [(r["tokens"] / r["seconds"], r["samples"] / r["seconds"]) for r in runs]
        for name, runs in results.items()
    }
    median = {name: statistics.median(t for t, _ in values) for name, values in speeds.items()}
    on_policy = statistics.fmean(
        row["on_policy"] for result in results["recipe"] for row in result["rows"] if row["step"] > args.warmup
    )
    header = ["distillation run", "tokens/s (median)", "chats/s (median)", "recipe / this", "loss at step 1"]
    header.append("each round's tokens/s")
    rows = [
        [
            name,
            f"{median[name]:.0f}",
            f"{statistics.median(c for _, c in speeds[name]):.1f}",
            f"{median['recipe'] / median[name]:.2f}x",
            f"{first[name]:.6f}",
            ", ".join(f"{t:.0f}" for t, _ in speeds[name]),
        ]
        for name in DISTILL_CONTENDERS
    ]
    ratio = f"recipe / TRL GKDTrainer (tokens/s): {median['recipe'] / median['trl']:.3f}x"
    return markdown_table(header, rows) + "\n" + ratio, "\n\n".join(
        [
            f"`{args.config}` on {args.num_processes} processes; the same Llama, from the same initial weights (both "
            "initialised by common.models.loading.initialise_weights, seed 0), and the same teacher (the model "
            "initialised with seed 1: the job times the two trainers, not what the student learns); `make sft`'s "
            f"arithmetic chats; lmbda {args.distill_lmbda} (GKDTrainer's default {DISTILL_LMBDA}), beta "
            f"{DISTILL_BETA}, temperature "
            f"{DISTILL_TEMPERATURE}; at most {args.max_completion_length} sampled tokens; per-device batch "
            f"{args.batch_size} chats; {args.steps} steps, timed after step {args.warmup}; {args.rounds} rounds, "
            "interleaved.",
            markdown_table(header, rows),
            f"**{ratio}** (above 1: the recipe is faster).",
            "What is counted: tokens/s is the input tokens of the batches each trains on (prompt and completion, "
            "every rank's, padding left out: the recipe's `tokens_per_s`, the TRL peer's count of the batches its "
            "loss is computed on) over the seconds of the steps after the warm-up, on rank 0, on-policy generation "
            "included. Both sample an on-policy step's completions in one left-padded `generate` a micro-batch. "
            "Which steps are on-policy differs: the recipe draws each step from (seed, step) (its timed steps: "
            f"{on_policy:.2f} on-policy over the rounds), TRL draws Python's `random` at each micro-batch on each "
            "process.",
            f"Loss at step 1 (the recipe's from a one-step launch unless --warmup is 1): recipe / TRL = "
            f"{first['recipe'] / first['trl']:.4f} on {args.num_processes} processes. Where both train step 1 on the "
            "data's answers (neither sampled), from the same weights and chats, the two compute the same quantity, "
            "the generalised JSD summed over the global batch's answer tokens and divided by their count, and TRL's "
            "GKDTrainer logs it divided by the number of processes: its compute_loss divides each process's sum by "
            "the global count (num_items_in_batch) and, replacing Trainer's compute_loss, leaves out the "
            "multiplication by the number of processes that Trainer's own applies, so DDP's average of the "
            "gradients is the mean's divided by the number of processes too (Adam barely sees the scale; the "
            "clipping threshold does). TRL's DistillationTrainer divides num_items_in_batch by the number of "
            "processes instead; the recipe's is the mean whatever the split (docs/rl.md).",
        ]
    )


def check_same_strategy(name: str, results: dict) -> None:
    """Every launch of the contenders in `results` (lists of launch results) trained under one strategy."""
    seen = {result["distributed_type"] for runs in results.values() for result in runs}
    if len(seen) != 1:
        raise SystemExit(f"error: the {name} runs trained under different strategies ({sorted(seen)})")


def grpo_job(args, config: str, folder: str) -> tuple[str, list[str]]:
    """The recipe's GRPO against TRL's GRPOTrainer under each of --grpo_configs, rounds interleaved: the printed
    table and the page's paragraphs."""
    job, speeds, firsts, weights = grpo_spec(args), {}, {}, []
    for accelerate_config in args.grpo_configs:

        def launch_one(contender: str, round_: int, accelerate_config=accelerate_config) -> dict:
            return launch_trl_job(job, contender, args, config, folder, round_, accelerate_config)

        results = interleaved(
            GRPO_CONTENDERS,
            args,
            launch_one,
            lambda result: result["tokens"] / result["seconds"],
            f"grpo {accelerate_config}",
        )
        check_same_strategy(f"GRPO ({accelerate_config})", results)
        recipe = recipe_first_step(job, args, config, folder, results["recipe"][0], accelerate_config)
        trl = results["trl"][0]
        weights.append(f"`{accelerate_config}` {results['recipe'][0]['run']['rollout']['weights']}")
        firsts[accelerate_config] = {
            "recipe": (recipe["loss"], recipe["reward"]),
            "trl": (trl["first_loss"], trl["first_reward"]),
        }
        speeds[accelerate_config] = {
            name: [(r["tokens"] / r["seconds"], r["samples"] / r["seconds"]) for r in runs]
            for name, runs in results.items()
        }
    header = ["GRPO run", "config", "tokens/s (median)", "completions/s (median)", "recipe / this"]
    header += ["loss at step 1", "reward at step 1", "each round's tokens/s"]
    rows, ratios = [], []
    for accelerate_config, runs in speeds.items():
        median = {name: statistics.median(t for t, _ in values) for name, values in runs.items()}
        for name in GRPO_CONTENDERS:
            loss, reward = firsts[accelerate_config][name]
            rows.append(
                [
                    name,
                    f"`{accelerate_config}`",
                    f"{median[name]:.0f}",
                    f"{statistics.median(c for _, c in runs[name]):.1f}",
                    f"{median['recipe'] / median[name]:.2f}x",
                    f"{loss:.6f}",
                    f"{reward:.4f}",
                    ", ".join(f"{t:.0f}" for t, _ in runs[name]),
                ]
            )
        ratios.append(f"{accelerate_config} {median['recipe'] / median['trl']:.3f}x")
    ratio = f"recipe / TRL GRPOTrainer (tokens/s): {'; '.join(ratios)}"
    configs = " and ".join(f"`{name}`" for name in args.grpo_configs)
    return markdown_table(header, rows) + "\n" + ratio, [
        f"{configs} on {args.num_processes} processes; the same Llama, from the same initial weights (both "
        "initialised by common.models.loading.initialise_weights, seed 0); `make grpo`'s prompts (arithmetic "
        "questions, "
        f"the `accuracy` reward: 1 where the completion's last number is the answer); G = {args.num_generations} "
        f"completions a prompt, at most {args.max_completion_length} tokens, temperature {args.temperature}, loss type "
        "dapo, beta "
        f"0, one iteration a rollout; per-device batch {args.batch_size} completions; {args.steps} steps, timed "
        f"after step {args.warmup}; {args.rounds} rounds a config, interleaved.",
        markdown_table(header, rows),
        f"**{ratio}** (above 1: the recipe is faster).",
        "What is counted: tokens/s is the prompt and completion tokens of the completions trained on (every "
        "rank's, padding left out; the recipe's `tokens_per_s`, TRL's `num_tokens`) over the seconds of the steps "
        "after the warm-up, on rank 0, each step from its rollout (generation and rewards) to its optimizer step; "
        "completions/s counts the completions (processes x batch a step). The two sample different completions, "
        "so their lengths, and the tokens a completion, differ; tokens/s charges each run for the tokens it "
        "generated and trained on.",
        "Loss and reward at step 1 (each one's first logged step; the recipe's from a one-step launch unless "
        "--warmup is 1): the policies are the same there, yet the figures differ, because the samples do. The "
        "recipe's rollouts are a function of (seed, step, prompt): its prompts the next of a permutation seeded by "
        "(seed, epoch), each token the inverse of the CDF at a uniform drawn from a generator seeded by (seed, "
        "rollout, the prompt's row) (common.objectives.rollout); TRL shuffles the prompts with its own sampler and "
        "samples "
        f"with torch's global RNG in `generate`. Step 1's reward is the mean over {args.num_processes} x "
        f"{args.batch_size} completions of different prompts: a noisy estimate of one policy's reward. Its loss, "
        "with one iteration and beta 0, is minus the sum over completions of advantage x length, over the tokens: "
        "0 where each group's rewards are all equal (no advantage) or its completions all equally long, else of a "
        "sign and size that depend on which completions happened to be long.",
        "What each does besides the job: the recipe samples each prompt's G completions as one batch of G copies "
        "(no padding), choosing each token by its own logits processor (softmax, cumulative sum and a search, in "
        "float64); TRL generates a rank's completions in one left-padded batch with transformers' sampling, "
        "computes the logits of the completion tokens only (`logits_to_keep`) and, every step, their entropy for "
        "its log, and wraps the model in DDP with find_unused_parameters=True (Trainer's default without "
        "checkpointing). Under ZeRO-3 both sample from whole weights gathered once a rollout: TRL inside "
        "`unwrap_model_for_generation` (ds3_gather_for_generation, its default: the sharded model gathered in "
        "place, its hooks removed, for the rollout), the recipe into a separate whole copy "
        "(common.objectives.rollout.GenerationWeights), after emptying ZeRO-3's partition cache through DeepSpeed's "
        "engine "
        "(`empty_partition_cache`, which also runs a full `gc.collect()`). What the recipe's rollouts sampled from "
        f"(its run.json): {'; '.join(weights)}.",
    ]


SAME_SAMPLES_STEPS = 2
# TRL names a reward's figures after its function (accuracy_reward), the recipe after --reward_funcs' name (accuracy)
TRL_REWARD, RECIPE_REWARD = "rewards/accuracy_reward/", "rewards/accuracy/"
# Logged by both with another meaning, set apart: the recipe's `lr` is the rate after the step's scheduler step (the
# next step's), Trainer's `learning_rate` the rate the step used
NOT_FIGURES = {"step", "epoch", "step_time", "lr", "learning_rate"}


def same_samples(args, config: str, folder: str) -> tuple[str, list[str]]:
    """The recipe and TRL's GRPOTrainer on the same completions (TRL's peer with --recipe_samples: the recipe's
    sampler in place of `generate`), in fp32 under ddp.yaml, every step logged: each figure both log, step by step,
    and the largest difference. The printed table and the page's paragraphs."""
    job, every = grpo_spec(args), argparse.Namespace(**{**vars(args), "warmup": 1})
    fp32 = ("--mixed_precision", "no")
    common = dict(accelerate_config="ddp.yaml", steps=SAME_SAMPLES_STEPS, launcher_args=fp32)
    recipe = launch_trl_job(job, "recipe", every, config, folder, "same", **common)["rows"]
    trl = launch_trl_job(job, "trl", every, config, folder, "same", peer_args=("--recipe_samples",), **common)["logs"]
    trl = [{key.replace(TRL_REWARD, RECIPE_REWARD): value for key, value in log.items()} for log in trl]
    steps = list(range(1, SAME_SAMPLES_STEPS + 1))
    by_step = {
        name: {row["step"]: row for row in rows if row["step"] in steps}
        for name, rows in (("recipe", recipe), ("trl", trl))
    }
    if any(sorted(logged) != steps for logged in by_step.values()):
        raise SystemExit(f"error: the same-samples runs did not log steps {steps}: {by_step}")
    keys = {name: set(logged[1]) - NOT_FIGURES for name, logged in by_step.items()}
    shared = sorted(keys["recipe"] & keys["trl"])
    header = ["figure", *(f"step {step} {name}" for step in steps for name in ("recipe", "TRL")), "largest difference"]
    rows, worst = [], (0.0, None)
    for figure in shared:
        pairs = [(by_step["recipe"][step][figure], by_step["trl"][step][figure]) for step in steps]
        # against 1 where the figure is smaller (a loss near 0): the rounding of fp32 sums, not of the figure
        gap = max(abs(a - b) / max(1.0, abs(b)) for a, b in pairs)
        worst = max(worst, (gap, figure), key=lambda pair: pair[0])
        rows.append([f"`{figure}`", *(f"{value:.6g}" for pair in pairs for value in pair), f"{gap:.1e}"])
    table = markdown_table(header, rows)

    def rates(name: str, key: str) -> str:
        return ", ".join(f"{by_step[name][step][key]:.6g}" for step in steps)

    summary = (
        f"same completions, recipe against TRL GRPOTrainer: largest difference {worst[0]:.1e} ({worst[1]}) "
        f"over {len(shared)} figures at steps {steps[0]}-{steps[-1]}"
    )
    return table + "\n" + summary, [
        "### On the same completions",
        "Timed runs sample differently (each its own sampler), so their figures differ by sampling. Here TRL's "
        "GRPOTrainer draws "
        "its completions with the recipe's sampler (benchmarks/peers/trl_grpo_loop.py --recipe_samples: "
        "common.objectives.rollout.sample_group in place of `generate`; TRL's own prompt order, which at seed 0 "
        "and in the first epoch is the recipe's, and its own chat-template rendering), and everything after the "
        "sampling is TRL's: rewards, advantages, the log-probabilities at the temperature, loss, gradient, "
        f"optimizer step and log. Both in fp32 under `ddp.yaml` on {args.num_processes} processes, temperature "
        f"{args.temperature}, {SAME_SAMPLES_STEPS} steps, each logged. A figure's difference is |recipe - TRL| over "
        "the larger of |TRL| and 1; TRL's `rewards/accuracy_reward/*` are compared with the recipe's "
        "`rewards/accuracy/*`. The loss itself does not depend on the temperature here (one iteration, beta 0: "
        "every ratio is 1); the gradient norm and the entropy do, and step 2's figures follow from step 1's update.",
        table,
        f"**{summary}.**",
        "Logged by one only: "
        + "; ".join(
            f"{name}: {', '.join(f'`{k}`' for k in sorted(keys[name] - keys[other]))}"
            for name, other in (("recipe", "trl"), ("trl", "recipe"))
        )
        + ".",
        "The learning rate, logged by both with another meaning: the recipe's `lr` at steps "
        f"{', '.join(str(step) for step in steps)}: {rates('recipe', 'lr')} (the rate after the step's scheduler "
        f"step); TRL's `learning_rate`: {rates('trl', 'learning_rate')} (the rate the step used).",
    ]


def job_parser(description: str) -> argparse.ArgumentParser:
    """The job's options (config, processes, model size, batch, steps, rounds, --docs), shared with
    benchmarks/benchmark_options.py."""
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
        choices=JOB_CHOICES,
        default=list(JOBS),
        help="the jobs to run (the page holds the ones run); grpo-same: the GRPO job's comparison on the same "
        "completions only (grpo runs it after its timed rounds)",
    )
    parser.add_argument(
        "--grpo_configs",
        nargs="+",
        default=list(GRPO_CONFIGS),
        help="the GRPO job's accelerate configs in accelerate_configs/ (each timed on its own)",
    )
    parser.add_argument("--num_generations", type=int, default=8, help="the GRPO job's completions a prompt (G)")
    parser.add_argument(
        "--max_completion_length", type=int, default=16, help="the GRPO job's longest completion, in tokens"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="the GRPO job's sampling temperature (make demo-grpo's)"
    )
    parser.add_argument(
        "--distill_lmbda",
        type=float,
        default=DISTILL_LMBDA,
        help="the distillation job's share of on-policy steps (GKDTrainer's 0.5; 0 or 1 time one kind of step in "
        "both, whose draws of it differ otherwise)",
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
    fp32 = (
        " Every launch in fp32 (--mixed_precision no): this CPU has no bf16 instructions, so the recipes train in "
        "fp32 where the config asks bf16, and the peers would emulate bf16 many times slower."
        if falls_back_to_fp32(args.config)
        else ""
    )
    return (
        f"`{args.config}` on {args.num_processes} processes; a Llama of hidden size {args.hidden} and "
        f"{args.layers} layers built from a config; per-device batch {args.batch_size} x {args.block_size} "
        f"tokens; {args.steps} steps, timed after step {args.warmup}; {args.rounds} rounds, interleaved.{fp32}"
    )


CAUSAL_NOTES = (
    "What each does per optimizer step besides the model's work: the recipe and Trainer average the "
    "loss over the global batch's label tokens, which takes one all-reduce of the token count per step "
    "(right for any data; here every block is full, so a per-rank mean would give the same loss): "
    "Trainer's holds every rank at the start of each step, the recipe's runs a step ahead, during "
    "the previous step's work (common.training.loop.TrainBatches); the bare loop averages per rank. The "
    "recipe also keeps its metrics on the device (read on logging steps only), checks losses for "
    "non-finite values without a collective or a host read between logging steps (the clipped "
    "gradient norm decides on the device) and updates a progress bar. Under DDP the recipe's "
    "gradients are views into DDP's all-reduce buckets (gradient_as_bucket_view, common.launch.accelerator); "
    "the bare loop and Trainer keep torch's default, which copies every gradient into its bucket and "
    "the reduced values back at each step.",
    "What a profile of the three (py-spy, rank 0, 150 steps) shows besides: Trainer wraps the model in "
    "DDP with find_unused_parameters=True, its default for a model without activation checkpointing, "
    "so every forward is followed by a search of the autograd graph; the recipe and the bare loop "
    "take accelerate's default (False). The bare loop and Trainer keep the model's use_cache, so each "
    "training forward also fills a key/value cache nobody reads; the recipes turn it off "
    "(common.models.loading).",
)


def main(argv=None):
    args = job_choices(job_parser(__doc__)).parse_args(argv)
    check_job(args)
    for job, folder, what in (
        ("dpo", PAIRS, "preference pairs"),
        ("grpo", PROMPTS, "GRPO prompts"),
        ("grpo-same", PROMPTS, "GRPO prompts"),
        ("distill", CHATS, "arithmetic chats"),
    ):
        if job in args.jobs and not os.path.isfile(os.path.join(folder, "train.jsonl")):
            raise SystemExit(f"error: no {what} in {folder}; run `make benchmark-peers` (it writes them)")
    trl_jobs = [job for job in ("dpo", "grpo", "grpo-same", "distill") if job in args.jobs]
    if trl_jobs and importlib.util.find_spec("trl") is None:
        raise SystemExit(
            f"error: trl is not installed (the {' and '.join(trl_jobs)} job's peer); run `make benchmark-peers`, "
            "which installs it"
        )
    sections, load_at_start = [job_line(args)], os.getloadavg()[0]
    if args.torch_compile:
        sections.append(
            "All three compiled: the recipe with --torch_compile true (accelerate's regional compilation), the "
            "bare loop's Accelerator with the same dynamo plugin, Trainer with torch_compile=True (its own: the "
            "whole model). The compile happens in the warm-up steps, before the timed ones."
        )
    title, packages = "The recipes against a bare accelerate loop, Trainer and TRL", ("trl",) if trl_jobs else ()

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
        if "grpo" in args.jobs or "grpo-same" in args.jobs:
            sections.append("## GRPO: recipes/grpo.py against TRL's GRPOTrainer")
            if "grpo" in args.jobs:
                grpo_table, grpo_sections = grpo_job(args, config, folder)
                print(grpo_table)
                sections += grpo_sections
                publish([])
            same_table, same_sections = same_samples(args, config, folder)
            print(same_table)
            sections += same_sections
            publish([])
        if "distill" in args.jobs:
            distill_table, distill_section = distill_job(args, config, folder)
            print(distill_table)
            sections += ["## Distillation: recipes/distill.py against TRL's GKDTrainer", distill_section]
    sections.append(
        f"The host's load average (1 minute) was {load_at_start:.1f} when the run began and "
        f"{os.getloadavg()[0]:.1f} when it ended: other work on the cores slows some rounds more than others."
    )
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
    if (
        recipe and recipe["peak_tflops"]
    ):  # a GPU in common.training.flops' table: MFU from the recipe's FLOPs per token
        header.insert(2, "MFU")
        for row, name in zip(rows, timed):
            row.insert(2, f"{mfu(speed[name], args, recipe):.1%}")
        mfu_line = (
            f"MFU: training FLOPs per token {recipe['flops_per_token'] / 1e9:.2f} G (common.training.flops: "
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
    notes = list(CAUSAL_NOTES)
    spreads = [max(values) / min(values) - 1 for values in results.values() if len(values) > 1]
    if spreads:
        notes.append(
            f"The rounds' spread here: up to {max(spreads):.0%} between one contender's fastest and slowest round "
            "(the host is shared): compare ratios from one run."
        )
    return [markdown_table(header, rows), ratios] + ([mfu_line] if mfu_line else []) + notes


if __name__ == "__main__":
    main()
