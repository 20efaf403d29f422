"""Supervised fine-tuning (instruction tuning) on chat-formatted data.

Conversations (a `messages` column) are rendered with the tokenizer's chat template,
or --chat_template's; the loss covers assistant turns only (content and end-of-turn
token), whatever the template. Prompt-completion data (`prompt`/`completion`
columns, text or lists of messages) learns the completion only.

With --packing (default) a batch's conversations are concatenated into one row with
per-conversation position ids, so no compute goes to padding (a batch that would waste at
most 20% on padding stays padded: faster there, common.data.packing.PackOrPad), and attention runs per
conversation (common.data.packing's sdpa_varlen: no conversation attends to another, and
conversations of similar length share an attention call); --packing false pads instead.
Evaluates loss and the exact-match accuracy of greedy answers.

    make sft CONFIG=accelerate_configs/ddp.yaml
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/sft.py \
        --config recipes/configs/sft_demo.yaml --packing false

LoRA (peft): --use_peft trains low-rank adapters only (--lora_r, --lora_alpha,
--lora_target_modules, --save_merged_model; see recipes/causal_lm.py).

The demo trains a tiny Llama from scratch on generated arithmetic questions
("what is 7 plus 5 ?"), whose answers are checkable.
"""

import math
from dataclasses import dataclass, field
from typing import Annotated

from transformers import DataCollatorForSeq2Seq

from common.data.chat import OVERLONG, answer_token_counts, end_of_turn_ids, generation_references, tokenize_sft
from common.data.chat_template import read_chat_template
from common.data.loading import load_raw_datasets, make_dataloaders
from common.data.packing import PackOrPad
from common.launch.internals import attention_implementation
from common.models.loading import load_model, load_tokenizer
from common.models.lora import LoraArguments, apply_lora
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.options.ranges import Range
from common.parallel.sequence_parallel import context_parallel
from common.run import run_recipe, start_run
from common.training.batch_size import fit_batch_size
from common.training.evaluation import evaluate_generation, size_max_new_tokens
from common.training.loop import TrainBatches, create_optimizer, create_scheduler, evaluate_loss, total_training_steps


@dataclass
class SFTArguments:
    reads_data_in_memory = True  # not a field: --streaming is refused here (common.options.parsing)
    messages_column: str = "messages"
    chat_template: str | None = field(
        default=None,
        metadata={"help": "A chat template file or text; replaces the tokenizer's (and is saved with it)."},
    )
    overlong: str = field(
        default="drop",
        metadata={
            "help": f"Examples longer than --block_size: {' or '.join(OVERLONG)} (dropped examples are counted in run.json)."
        },
    )
    packing: bool = field(default=True, metadata={"help": "Flatten each batch into one row (no padding)."})
    max_new_tokens: Annotated[int | None, Range(low=1, why="unset: sized from the reference answers")] = field(
        default=None,
        metadata={
            "help": "Longest greedy answer for exact match, in tokens; default: the longest reference answer's, with its "
            "end-of-turn token, at most 512 (an answer cut by the limit is scored as wrong and counted)."
        },
    )
    max_generation_samples: Annotated[int | None, Range(low=1, why="unset: all of them")] = field(
        default=None, metadata={"help": "Eval conversations to generate for."}
    )


def main(
    model_args: ModelArguments,
    data_args: DataArguments,
    sft_args: SFTArguments,
    lora_args: LoraArguments,
    args: TrainingArguments,
):
    run = start_run(model_args, data_args, sft_args, lora_args, args)
    accelerator = run.accelerator

    # Data: chat template, assistant-only labels; block_size is the maximum length.
    tokenizer = load_tokenizer(model_args)
    if sft_args.chat_template:
        tokenizer.chat_template = read_chat_template(sft_args.chat_template)
    raw = load_raw_datasets(data_args, args.seed)
    datasets, dropped = tokenize_sft(
        raw,
        tokenizer,
        sft_args.messages_column,
        data_args.block_size,
        sft_args.overlong,
        accelerator,
        data_args.preprocessing_num_workers,
    )
    padding = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    collate = PackOrPad(padding) if sft_args.packing else padding
    train_loader, eval_loader = make_dataloaders(
        datasets,
        args.per_device_train_batch_size,
        args.per_device_eval_batch_size,
        args.seed,
        collate_fn=collate,
        eval_collate_fn=padding,
    )  # eval keeps one row per conversation, so every one is counted once
    references = generation_references(
        raw["validation"], raw["train"].column_names, sft_args.messages_column, sft_args.max_generation_samples
    )
    stop_ids = end_of_turn_ids(datasets["validation"])
    longest_answer = max(answer_token_counts(tokenizer, references), default=1)
    max_new_tokens = size_max_new_tokens(sft_args.max_new_tokens, longest_answer, accelerator)

    model = apply_lora(load_model(model_args, tokenizer, args.seed, args, packed_rows=sft_args.packing), lora_args)
    layout = str(collate) if sft_args.packing else "padded"
    accelerator.print(f"{layout} batches, attention: {attention_implementation(model)}")
    optimizer = create_optimizer(model, args)
    train_loader = fit_batch_size(accelerator, model, train_loader, args)  # --auto_find_batch_size
    max_steps = total_training_steps(args, train_loader, accelerator)
    scheduler = create_scheduler(optimizer, args, max_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    # Resume from the checkpoint (if any), write run.json, start the metrics. {"step": 0} for a fresh run.
    state = run.begin(
        model,
        optimizer,
        scheduler,
        tokenizer,
        max_steps,
        dropped_examples=dropped,
        batches=layout,
        generation={"max_new_tokens": max_new_tokens, "longest_reference_answer_tokens": longest_answer},
    )
    step, metrics, nonfinite, profiler = state["step"], run.metrics, run.nonfinite, run.profiler

    def evaluate():
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
        accelerator,
        train_loader,
        args.gradient_accumulation_steps,
        max_steps,
        resume_from=state,
        metrics=metrics,
        budget=run.budget,
    )  # ends after step max_steps, or where --max_train_seconds runs out
    for batch in batches:
        with accelerator.accumulate(model), context_parallel(accelerator, batch):  # fsdp_cp.yaml splits the rows
            loss = model(**batch).loss
            metrics.record_batch(loss, batch)
            nonfinite.record(loss)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)  # 0: off
                if not nonfinite.skip_step(step + 1, grad_norm):  # every rank decides the same
                    optimizer.step()
                    scheduler.step()  # once per optimizer step
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        metrics.advance()
        profiler.step()
        if step % args.logging_steps == 0:
            metrics.log_train(step, scheduler.get_last_lr()[0], grad_norm)
        if args.eval_steps and step % args.eval_steps == 0 and not run.budget.done(step, max_steps):
            evaluate()
        if args.save_steps and step % args.save_steps == 0:
            run.save_checkpoint(step, {"data": batches.position})

    after = evaluate()
    before = metrics.eval_at_start()  # --eval_on_start's figures, this run's or the resumed run's
    final_dir = run.finish()
    start = f"{before['eval_exact_match']:.3f} untrained -> " if before else ""
    cut = (
        f" ({after['eval_truncated_generations']} cut at --max_new_tokens {max_new_tokens})"
        if after["eval_truncated_generations"]
        else ""
    )
    accelerator.print(
        f"exact match {start}{after['eval_exact_match']:.3f} on {after['eval_generated']} questions"
        f"{cut}; saved to {final_dir}"
    )
    return after


if __name__ == "__main__":
    run_recipe(main, ModelArguments, DataArguments, SFTArguments, LoraArguments, TrainingArguments)
