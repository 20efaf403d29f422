"""On-policy distillation (GKD): a student learns a teacher's distribution over every token of its own completions.

The teacher (--teacher_model_name_or_path: frozen, in eval mode, held as DPO's reference copy is, sharded as the
config shards the student) scores each token the student is trained on, and the loss is the generalised
Jensen-Shannon divergence between the two distributions (--beta: 0 forward KL, 1 reverse KL), averaged over the
global batch's completion tokens (common.objectives.distill). A step is on-policy with probability --lmbda: its
rows keep their prompts and the student samples their completions (--temperature, --max_new_tokens; the rollouts'
sampler, from whole weights under every config); the other steps train on the data's own answers, or with --seq_kd
on the teacher's samples. Every token carries the teacher's signal, not one reward per completion. TRL's
GKDTrainer's names and defaults (lmbda 0.5, beta 0.5, temperature 0.9, max_new_tokens 128).

The data: a `messages` column, as for sft.py (TRL's GKDTrainer's); the prompt of a row is its conversation before
the last assistant turn. Or prompts only, as TRL's DistillationTrainer takes them: a `prompt` column (text, or a
conversation rendered with its generation prompt) and no answers, every step on-policy (--lmbda 1, its default
there; with --seq_kd the other steps on the teacher's samples). Teacher and student must share a tokenizer (refused
in one line otherwise). Evaluates the student's loss on the held-out answers and the exact match of its greedy
answers; on prompts only, the divergence to the teacher over the student's own completions of the held-out prompts.

    make distill CONFIG=accelerate_configs/zero3.yaml
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/distill.py \
        --config recipes/configs/distill_demo.yaml --teacher_model_name_or_path outputs/sft_demo/final

LoRA (peft): --use_peft trains the student's adapters only (see recipes/causal_lm.py).
"""

import itertools
import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from transformers import DataCollatorForSeq2Seq

from common.data.chat import OVERLONG, answer_token_counts, end_of_turn_ids, generation_references, tokenize_sft
from common.data.chat_template import read_chat_template
from common.data.loading import load_raw_datasets, make_dataloaders
from common.launch.errors import UsageError
from common.models.loading import load_model, load_tokenizer
from common.models.lora import LoraArguments, apply_lora
from common.objectives.distill import (
    build_teacher,
    check_resumed_data,
    check_teacher_tokenizer,
    check_vocabularies,
    completed_window,
    count_window,
    distillation_loss,
    held_out_divergence,
    on_policy,
    prompts_only,
    tokenize_prompt_rows,
    turn_end_ids,
)
from common.objectives.reference import disable_dropout
from common.objectives.rollout import GenerationWeights, SamplingSettings, stop_token_ids
from common.objectives.scoring import completion_logits
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.options.ranges import Range
from common.run import run_recipe, start_run
from common.training.evaluation import evaluate_generation, size_max_new_tokens
from common.training.loop import TrainBatches, create_optimizer, create_scheduler, evaluate_loss, total_training_steps


@dataclass
class DistillArguments:
    reads_data_in_memory = True  # not fields: --streaming and --auto_find_batch_size are refused
    no_auto_batch_size = "its trial step would not count the on-policy generation"
    scores_whole_rows = "each token's distribution against the teacher's"  # sequence parallelism, pipelines refused
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The teacher: a model folder (or Hub id) with the student's tokenizer."}
    )
    lmbda: Annotated[float | None, Range(low=0, high=1, why="unset: 0.5 on conversations, 1 on prompts")] = field(
        default=None,
        metadata={
            "help": "The share of steps trained on the student's own completions (on-policy): unset, 0.5 (TRL's "
            "GKDTrainer) on conversations, 1 on prompt-only data (its DistillationTrainer)."
        },
    )
    beta: Annotated[float, Range(low=0, high=1)] = field(
        default=0.5, metadata={"help": "The generalised JSD's interpolation: 0 forward KL, 1 reverse KL."}
    )
    temperature: Annotated[float, Range(above=0)] = field(
        default=0.9, metadata={"help": "The sampling temperature of the on-policy (and --seq_kd) completions."}
    )
    max_new_tokens: Annotated[int, Range(low=1)] = field(
        default=128, metadata={"help": "The longest sampled completion, in tokens."}
    )
    seq_kd: bool = field(
        default=False, metadata={"help": "Off-policy steps train on the teacher's samples, not the data's answers."}
    )
    disable_dropout: bool = True
    messages_column: str = "messages"
    chat_template: str | None = field(
        default=None, metadata={"help": "A chat template file or text; replaces the tokenizer's (and is saved)."}
    )
    overlong: str = field(
        default="drop", metadata={"help": f"Examples longer than --block_size: {' or '.join(OVERLONG)}."}
    )
    max_generation_samples: Annotated[int | None, Range(low=1, why="unset: all of them")] = field(
        default=None,
        metadata={
            "help": "Held-out conversations the evaluation answers (prompts it completes, on prompt-only data)."
        },
    )
    rollout_weights: Literal["auto", "copy", "stages"] = field(
        default="auto", metadata={"help": "What the student samples from where the config shards it (grpo.py's)."}
    )


def main(
    model_args: ModelArguments,
    data_args: DataArguments,
    distill_args: DistillArguments,
    lora_args: LoraArguments,
    args: TrainingArguments,
):
    run = start_run(model_args, data_args, distill_args, lora_args, args)
    accelerator = run.accelerator
    accumulation = args.gradient_accumulation_steps

    # Data: chats with labels on the assistant turns, as sft.py's; each train row's index seeds its samples.
    tokenizer = load_tokenizer(model_args)
    if distill_args.chat_template:
        tokenizer.chat_template = read_chat_template(distill_args.chat_template)
    teacher_path = distill_args.teacher_model_name_or_path
    if not teacher_path:
        raise UsageError("--teacher_model_name_or_path is required: the model whose distribution the student learns")
    check_teacher_tokenizer(tokenizer, teacher_path)
    raw = load_raw_datasets(data_args, args.seed)
    prompts = prompts_only(raw["train"].column_names, distill_args.messages_column)
    lmbda = distill_args.lmbda if distill_args.lmbda is not None else 1.0 if prompts else 0.5
    if prompts and lmbda < 1 and not distill_args.seq_kd:
        raise UsageError(
            f"--lmbda {lmbda} on prompt-only data: it has no answers for the other steps to train on; use --lmbda 1 "
            "(every step on the student's completions), or --seq_kd (the others on the teacher's)"
        )
    if prompts:  # TRL's DistillationTrainer's data: the completions are all sampled
        datasets, dropped = tokenize_prompt_rows(
            raw,
            tokenizer,
            data_args.block_size,
            distill_args.max_new_tokens,
            distill_args.overlong,
            accelerator,
            data_args.preprocessing_num_workers,
        )
        stop_ids = turn_end_ids(tokenizer, not isinstance(raw["train"][0]["prompt"], str))
        held_out, count = datasets["validation"], distill_args.max_generation_samples  # the prompts it completes
        datasets["validation"] = held_out.select(range(min(count or len(held_out), len(held_out))))
    else:
        datasets, dropped = tokenize_sft(
            raw,
            tokenizer,
            distill_args.messages_column,
            data_args.block_size,
            distill_args.overlong,
            accelerator,
            data_args.preprocessing_num_workers,
        )
        datasets["train"] = datasets["train"].add_column("row", list(range(len(datasets["train"]))))
        stop_ids = end_of_turn_ids(datasets["validation"])
    padding = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    train_loader, eval_loader = make_dataloaders(
        datasets, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed, collate_fn=padding
    )
    references = [] if prompts else generation_references(
        raw["validation"], raw["train"].column_names, distill_args.messages_column, distill_args.max_generation_samples
    )  # fmt: skip
    longest_answer = max(answer_token_counts(tokenizer, references), default=1)
    max_new_tokens = size_max_new_tokens(None, longest_answer, accelerator)

    model = apply_lora(load_model(model_args, tokenizer, args.seed, args), lora_args)
    teacher = build_teacher(model_args, teacher_path, tokenizer, args)
    check_vocabularies(model, teacher.model)
    if distill_args.disable_dropout:
        disable_dropout(model)
    optimizer = create_optimizer(model, args)
    max_steps = total_training_steps(args, train_loader, accelerator)
    scheduler = create_scheduler(optimizer, args, max_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    teacher.prepare(run, model, {}, None, args.per_device_eval_batch_size)
    # what the on-policy completions are sampled from: the student (whole on every rank), or under --seq_kd the
    # teacher for the other steps
    length = data_args.block_size or distill_args.max_new_tokens
    rows = args.per_device_train_batch_size  # a micro-batch's prompts are sampled together
    students = GenerationWeights(accelerator, model, distill_args.rollout_weights, rows, length)
    teachers = GenerationWeights(accelerator, teacher.model, "copy", rows, length) if distill_args.seq_kd else None
    settings = SamplingSettings(  # a sample ends at EOS or where the data's answers end (<|im_end|>, <|eot_id|>...)
        distill_args.temperature,
        1.0,
        distill_args.max_new_tokens,
        sorted(set(stop_token_ids(tokenizer, students.policy)) | set(stop_ids)),
        tokenizer.pad_token_id,
    )

    # Resume from the checkpoint (if any), write run.json, start the metrics. {"step": 0} for a fresh run.
    kind = "prompts" if prompts else "conversations"
    check_resumed_data(run.checkpoint, kind)
    state = run.begin(
        model,
        optimizer,
        scheduler,
        tokenizer,
        max_steps,
        dropped_examples=dropped,
        teacher={"model": teacher_path, **teacher.record(), **({"samples": teachers.record()} if teachers else {})},
        rollout=students.record(),
        distillation={"data": kind, "lmbda": lmbda},
        generation=None
        if prompts
        else {"max_new_tokens": max_new_tokens, "longest_reference_answer_tokens": longest_answer},
    )
    step, metrics, nonfinite, profiler = state["step"], run.metrics, run.nonfinite, run.profiler

    def evaluate():
        if prompts:  # no answers: the divergence over the student's own held-out completions
            figures = held_out_divergence(
                model, teacher, eval_loader, students, settings, args.seed, step, distill_args.beta, accelerator
            )
            return metrics.log_eval(step, figures)
        return metrics.log_eval(
            step,
            {
                **evaluate_loss(model, eval_loader, accelerator),
                **evaluate_generation(
                    model,
                    tokenizer,
                    references,
                    accelerator,
                    max_new_tokens,
                    stop_ids,
                    args.per_device_eval_batch_size,
                    longest_answer,
                ),
            },
        )

    if step == 0 and args.eval_on_start:
        evaluate()

    model.train()
    grad_norm = None
    batches = TrainBatches(
        accelerator, train_loader, accumulation, max_steps, resume_from=state, metrics=metrics, budget=run.budget
    )  # ends after step max_steps, or where --max_train_seconds runs out
    micro_batches = iter(batches)
    while window := list(itertools.islice(micro_batches, accumulation)):  # one optimizer step's micro-batches
        student_samples = on_policy(args.seed, step, lmbda)
        source = students if student_samples else teachers  # None: the data's own answers
        if source is not None:  # the student's weights of this step, or the frozen teacher's
            version = step if student_samples else 0
            window = completed_window(window, source, version, settings, args.seed, step, accelerator)
            window = count_window(accelerator, window, accumulation)  # the completions' tokens, every rank's
        for batch in window:
            with accelerator.accumulate(model):
                # both models' logits at the completion's positions only, each scoring the target there
                inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}
                with accelerator.autocast():
                    student_logits, labels, columns = completion_logits(model, inputs)
                teacher_logits = teacher.apply(lambda scorer, b: completion_logits(scorer, b)[0], inputs)
                loss = distillation_loss(
                    student_logits, teacher_logits, labels[:, columns], distill_args.beta, batch["num_items_in_batch"]
                )
                metrics.record_batch(loss, batch, extra_forwards=1)
                metrics.record_values({"on_policy": student_logits.new_tensor([float(student_samples)])})
                nonfinite.record(loss)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                    if not nonfinite.skip_step(step + 1, grad_norm):  # every rank decides the same
                        optimizer.step()
                        scheduler.step()  # once per optimizer step
                optimizer.zero_grad()
        step += 1
        metrics.advance()
        profiler.step()
        if step % args.logging_steps == 0:
            metrics.log_train(step, scheduler.get_last_lr()[0], grad_norm)
        if args.eval_steps and step % args.eval_steps == 0 and not run.budget.done(step, max_steps):
            evaluate()
        if args.save_steps and step % args.save_steps == 0:
            run.save_checkpoint(step, {"data": batches.position, "distillation_data": kind})

    after = evaluate()
    before = metrics.eval_at_start()  # --eval_on_start's figures, this run's or the resumed run's
    final_dir = run.finish()
    if prompts:
        start = f"{before['eval_loss']:.4f} untrained -> " if before else ""
        accelerator.print(
            f"held-out divergence to the teacher {start}{after['eval_loss']:.4f} over the student's completions of "
            f"{after['eval_prompts']} prompts; saved to {final_dir}"
        )
        return after
    start = f"{before['eval_exact_match']:.3f} untrained -> " if before else ""
    accelerator.print(
        f"exact match {start}{after['eval_exact_match']:.3f} on {after['eval_generated']} questions; "
        f"saved to {final_dir}"
    )
    return after


if __name__ == "__main__":
    run_recipe(main, ModelArguments, DataArguments, DistillArguments, LoraArguments, TrainingArguments)
