"""make demo-distill: one student distilled on-policy, one taught by SFT and one by GRPO, for the same wall time.

The teacher is the real chat model as `make demo-chat` fine-tuned it (SmolLM2-135M-Instruct answering arithmetic
questions with the bare number, outputs/sft_chat_demo/final). Each student is the untuned model with LoRA adapters
(the same rank, targets, learning rate, schedule and batch of 8 rows a process), trained on 2 processes (ddp.yaml)
on the same questions, those of the demo's validation chats left out:

    distill  recipes/distill.py on-policy (--lmbda 1): the student answers, the teacher scores every token of the
             student's answer (reverse KL, --beta 1); --distill_steps steps, whose seconds (run.json's
             training_time) are the budget of the two others;
    sft      recipes/sft.py on the teacher's greedy answers to the same questions (sequence-level distillation; the
             teacher answers each question once, before, timed apart), stopped by --max_train_seconds;
    grpo     recipes/grpo.py from `make demo-grpo`'s rewards (half a point for a bare number, a point more for the
             right one), stopped by --max_train_seconds.

Then one evaluator scores the untuned model, the teacher and the three students' merged exports alike, in this
process: greedy answers to the held-out questions (questions none of the students trained on), exact match of the
bare number (common.training.evaluation.evaluate_generation). The page (--docs) holds the figures, each run's
command and seconds.

    python benchmarks/demo_distill.py --docs docs/demo-distill.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from figures import markdown_table, write_page  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="outputs/models/SmolLM2-135M-Instruct", help="The untuned chat model.")
    parser.add_argument("--teacher", default="outputs/sft_chat_demo/final", help="make demo-chat's export.")
    parser.add_argument("--data", default="outputs/data/arithmetic", help="make demo-chat's chats.")
    parser.add_argument("--out", default="outputs/distill_demo_compare", help="The students' runs and their data.")
    parser.add_argument("--config", default="accelerate_configs/ddp.yaml")
    parser.add_argument("--distill_steps", type=int, default=24, help="The distilled student's steps: the budget.")
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--launch_args", default="", help="More `accelerate launch` flags (--main_process_port N).")
    parser.add_argument("--docs", default=None, help="Write the page here (docs/demo-distill.md).")
    return parser.parse_args(argv)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_jsonl(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def question(chat: dict) -> str:
    return chat["messages"][0]["content"]


def asks(chat: dict) -> tuple:
    """What a chat asks, whatever the order of a sum's terms ("what is 3 plus 5 ?" and "what is 5 plus 3 ?" alike)."""
    words = question(chat).split()  # what is A plus|minus B ?
    a, operation, b = int(words[2]), words[3], int(words[4])
    return (operation, *sorted((a, b))) if operation == "plus" else (operation, a, b)


def load(folder: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        folder
    )


def greedy_answers(folder: str, questions: list[str], max_new_tokens: int = 8) -> list[str]:
    """The model's greedy answers to one-turn questions through its own chat template, stopped at its end of turn."""
    import torch

    model, tokenizer = load(folder)
    tokenizer.padding_side = "left"
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    answers = []
    for start in range(0, len(prompts), 32):
        inputs = tokenizer(prompts[start : start + 32], padding=True, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers += tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return [answer.strip() for answer in answers]


def exact_match(folder: str, held_out: list[dict]) -> float:
    """The recipes' evaluator (greedy, stopped at the end of turn, an answer cut at 8 tokens never a match) on the
    held-out chats, in this process."""
    from accelerate import Accelerator

    from common.training.evaluation import evaluate_generation

    model, tokenizer = load(folder)
    references = [(chat["messages"][:-1], chat["messages"][-1]["content"]) for chat in held_out]
    figures = evaluate_generation(
        model, tokenizer, references, Accelerator(cpu=True), 8, stop_ids=[tokenizer.eos_token_id], batch_size=32
    )
    return figures["eval_exact_match"]


def launch(recipe: str, flags: list, args) -> tuple[list[str], float]:
    """The recipe under `accelerate launch` (2 processes, args.config); its command and wall seconds."""
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"),
        "launch",
        "--config_file",
        args.config,
        *shlex.split(args.launch_args),
        f"recipes/{recipe}",
        *[str(flag) for flag in flags],
    ]
    print("$ " + shown(command), flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"error: the {recipe} run failed (exit {result.returncode}); its output is above")
    return command, time.perf_counter() - started


def shown(command: list) -> str:
    """The launch as a user types it (`accelerate launch ...`, not this interpreter's path to it)."""
    return shlex.join(["accelerate", *command[1:]])


def run_record(out: str) -> dict:
    with open(os.path.join(out, "run.json")) as handle:
        record = json.load(handle)
    if record["participating_processes"] != 2:
        raise SystemExit(f"error: {out} trained on {record['participating_processes']} process(es), not 2")
    return record


def signal(folder: str, name: str) -> str:
    """What the student's first and last logged windows said: its loss, and GRPO's rewards and the share of its
    groups whose completions all scored alike (no advantage, no gradient)."""
    with open(os.path.join(folder, "metrics.jsonl")) as handle:
        rows = [row for row in map(json.loads, handle) if "loss" in row]
    if not rows:
        return "no window logged"
    first, last = rows[0], rows[-1]
    if name != "grpo":
        return f"loss {first['loss']:.3f} -> {last['loss']:.3f}"
    said = [f"{key} {first[key]:.2f} -> {last[key]:.2f}" for key in GRPO_FIGURES]
    return ", ".join(said)


GRPO_FIGURES = ("rewards/format/mean", "rewards/exact_match/mean", "frac_reward_zero_std")


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.chdir(REPO)
    for path, make in ((args.base, "make real-model"), (args.teacher, "make demo-chat")):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"error: {path} has no model; run `{make}` first (make demo-distill does)")

    # The questions: the demo's validation chats held out (a sum in either order), the students trained on the others.
    held_out = read_jsonl(os.path.join(args.data, "validation.jsonl"))
    held = {asks(chat) for chat in held_out}
    train = [chat for chat in read_jsonl(os.path.join(args.data, "train.jsonl")) if asks(chat) not in held]
    data = os.path.join(args.out, "data")
    chats = write_jsonl(os.path.join(data, "chats", "train.jsonl"), train)
    held_file = write_jsonl(os.path.join(data, "chats", "validation.jsonl"), held_out)
    prompts = write_jsonl(
        os.path.join(data, "prompts", "train.jsonl"),
        [{"prompt": chat["messages"][:1], "answer": chat["messages"][1]["content"]} for chat in train],
    )
    held_prompts = write_jsonl(
        os.path.join(data, "prompts", "validation.jsonl"),
        [{"prompt": chat["messages"][:1], "answer": chat["messages"][1]["content"]} for chat in held_out],
    )
    unique = sorted({question(chat) for chat in train})
    started = time.perf_counter()
    taught = dict(zip(unique, greedy_answers(args.teacher, unique)))
    teacher_seconds = time.perf_counter() - started
    teacher_answers = write_jsonl(
        os.path.join(data, "teacher_answers", "train.jsonl"),
        [
            {"messages": [chat["messages"][0], {"role": "assistant", "content": taught[question(chat)]}]}
            for chat in train
        ],
    )
    right = sum(taught[question(chat)] == chat["messages"][1]["content"] for chat in train) / len(train)
    print(
        f"{len(train)} training chats ({len(unique)} questions, {len(held)} held out in either order); the teacher "
        "answered each "
        f"question once in {teacher_seconds:.1f} s, {right:.2f} of the training chats right",
        flush=True,
    )

    student = [
        "--model_name_or_path", args.base, "--use_peft", "true", "--lora_r", 16, "--lora_alpha", 32,
        "--lora_target_modules", "all-linear", "--save_merged_model", "true",
        "--learning_rate", args.learning_rate, "--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", 2,
        "--per_device_train_batch_size", 8, "--logging_steps", 4, "--eval_steps", 0, "--save_steps", 0,
        "--eval_on_start", "false", "--report_to", "none", "--seed", 42, "--overwrite_output_dir",
    ]  # fmt: skip
    runs = {}
    out = os.path.join(args.out, "distill")
    runs["distill"] = launch(
        "distill.py",
        [*student, "--train_file", chats, "--validation_file", held_file, "--output_dir", out, "--block_size", 96,
         "--teacher_model_name_or_path", args.teacher, "--lmbda", 1, "--beta", 1, "--max_new_tokens", 8,
         "--max_steps", args.distill_steps, "--max_generation_samples", 16, "--max_eval_samples", 16],
        args,
    )  # fmt: skip
    budget = run_record(out)["training_time"]["train_seconds"]
    runs["sft"] = launch(
        "sft.py",
        [*student, "--train_file", teacher_answers, "--validation_file", held_file, "--block_size", 96,
         "--output_dir", os.path.join(args.out, "sft"), "--max_steps", 10000, "--max_train_seconds", budget,
         "--max_generation_samples", 16, "--max_eval_samples", 16],
        args,
    )  # fmt: skip
    runs["grpo"] = launch(
        "grpo.py",
        [*student, "--train_file", prompts, "--validation_file", held_prompts, "--block_size", 64,
         "--output_dir", os.path.join(args.out, "grpo"), "--max_steps", 10000, "--max_train_seconds", budget,
         "--reward_funcs", "format", "exact_match", "--reward_weights", 0.5, 1.0, "--num_generations", 8,
         "--max_completion_length", 8, "--temperature", 0.7, "--max_eval_samples", 16],
        args,
    )  # fmt: skip

    scores = {"untuned": exact_match(args.base, held_out), "teacher": exact_match(args.teacher, held_out)}
    rows = []
    for name, (command, wall) in runs.items():
        folder = os.path.join(args.out, name)
        record = run_record(folder)
        timing = record["training_time"]
        scores[name] = exact_match(os.path.join(folder, "final_merged"), held_out)
        steps = timing.get("stopped_by_time_budget", {}).get("step", record["max_steps"])
        rows.append(
            [name, steps, f"{timing['train_seconds']:.1f}", f"{wall:.0f}", signal(folder, name), f"{scores[name]:.3f}"]
        )
        print(f"{name}: {steps} steps in {timing['train_seconds']:.1f} s, exact match {scores[name]:.3f}", flush=True)
    print(
        f"held-out exact match: untuned {scores['untuned']:.3f}, teacher {scores['teacher']:.3f}; "
        + ", ".join(f"{name} {scores[name]:.3f}" for name in runs),
        flush=True,
    )
    if args.docs:
        write_docs(args, runs, rows, scores, len(train), len(unique), len(held_out), teacher_seconds, right)
    return {"scores": scores, "rows": rows, "budget": budget}


def write_docs(args, runs, rows, scores, train, unique, held_out, teacher_seconds, right) -> None:
    record = run_record(os.path.join(args.out, "distill"))
    batch = record["effective_batch_size"]  # rows a step, the same for the three (8 a process)
    ranked = " > ".join(f"{row[0]} {row[-1]}" for row in sorted(rows, key=lambda row: -float(row[-1])))
    header = ["student", "steps", "training seconds", "launch seconds", "first -> last logged window", "exact match"]
    body = f"""\
The teacher: SmolLM2-135M-Instruct as `make demo-chat` fine-tuned it (`{args.teacher}`), on all of the demo's
arithmetic chats: the questions below are ones it trained on. Each student: the untuned model (`{args.base}`) with LoRA
adapters (rank 16, all linear layers), learning rate {args.learning_rate:g} (constant after 2 warm-up steps), 8 rows a
process, on 2 processes (`{args.config}`, {record["mixed_precision"]}), trained on {train} of those chats ({unique}
questions): those that ask what one of the {held_out} validation chats asks (a sum in either order) are left out, so
every student's score below is on questions it never trained on. The distilled student trains {args.distill_steps}
steps; its training seconds (run.json's `training_time`, from its first step to its last) are the budget of the SFT
and GRPO students (`--max_train_seconds`: each stops at the first step that ends past it, so it may train up to one
step longer). The SFT student's data, the teacher's greedy answer to each of the {unique} questions ({right:.2f} of the
training chats answered right), took the teacher {teacher_seconds:.1f} s in one process before the runs, counted in
no budget.

Exact match on the validation questions (greedy answers through the model's own chat template, the bare number or
nothing: one evaluator, common.training.evaluation.evaluate_generation, for every model): untuned
**{scores["untuned"]:.3f}**, teacher **{scores["teacher"]:.3f}**.

{markdown_table(header, rows)}

Ranked at the same seconds: {ranked}.

What each step holds differs, which is the comparison: a distillation step samples {batch} answers (8 a process, at
temperature 0.9, up to 8 tokens) and has the teacher score every token of them; an SFT step trains on {batch} of the
teacher's answers; a GRPO step samples 8 answers to each of {batch // 8} questions (temperature 0.7) and scores each
answer once. The launch seconds add the start-up, the model loading and the recipes' own short evaluations. The logged
windows (4 steps each): the distilled student's loss is the divergence to the teacher over its own answers, the SFT
student's the cross-entropy of the teacher's answers; GRPO's are the means of its two rewards (format: a bare number,
right or wrong; exact_match: the right one) and `frac_reward_zero_std`, the share of its question groups whose 8 answers
all scored alike, which give no advantage and so no gradient. The GRPO student has the students' shared settings, not
`make demo-grpo`'s (its system turn asking for the number only, 4 questions a step, learning rate 3.5e-4): from the
untuned model's sentences a bare number is rare, and where it learns the format before the answers its groups score
alike and its steps stop moving it.

The runs:

"""
    body += "\n".join(f"```bash\n{shown(command)}\n```\n" for command, _ in runs.values())
    write_page(args.docs, "Distillation against SFT and GRPO at the same wall time", body)


if __name__ == "__main__":
    main()
