"""Supervised fine-tuning (instruction tuning) on chat-formatted data.

Conversations (a `messages` column) are rendered with the tokenizer's chat template,
or --chat_template's; the loss covers assistant turns only (content and end-of-turn
token), whatever the template. Prompt-completion data (`prompt`/`completion`
columns, text or lists of messages) learns the completion only.

With --packing (default) a batch's conversations are concatenated into one row with
per-conversation position ids, so no compute goes to padding, and attention runs per
conversation (common.packing's sdpa_varlen: no conversation attends to another, and
attention costs what a padded batch's does); --packing false pads instead.
Evaluates loss and the exact-match accuracy of greedy answers.

    make sft CONFIG=accelerate_configs/ddp.yaml
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/sft.py \
        --config recipes/configs/sft_demo.yaml --packing false

The demo trains a tiny Llama from scratch on generated arithmetic questions
("what is 7 plus 5 ?"), whose answers are checkable.
"""

import math
from dataclasses import dataclass, field

from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from common.arguments import (DataArguments, ModelArguments, TrainingArguments, exits_on_usage_error,
                              parse_args, to_dict)
from common.batch_size import fit_batch_size
from common.checkpoints import export_final, load_checkpoint, save_checkpoint
from common.chat import OVERLONG, end_of_turn_ids, generation_references, read_chat_template, tokenize_sft
from common.data import load_raw_datasets, make_dataloaders
from common.evaluation import evaluate_generation
from common.metrics import MetricsLogger
from common.nonfinite import NonFiniteGuard
from common.profiling import StepProfiler
from common.model import count_parameters, export_dtype, load_model, load_tokenizer
from common.packing import use_per_example_attention
from common.run_info import record_run, start_run, tracker_config
from common.training import (create_optimizer, create_scheduler, evaluate_loss, total_training_steps,
                             TrainBatches)


@dataclass
class SFTArguments:
    reads_data_in_memory = True  # not a field: --streaming is refused here (common.arguments)
    messages_column: str = "messages"
    chat_template: str | None = field(
        default=None, metadata={"help": "A chat template file or text; replaces the tokenizer's (and is saved with it)."})
    overlong: str = field(default="drop", metadata={
        "help": f"Examples longer than --block_size: {' or '.join(OVERLONG)} (dropped examples are counted in run.json)."})
    packing: bool = field(default=True, metadata={"help": "Flatten each batch into one row (no padding)."})
    max_new_tokens: int = field(default=8, metadata={"help": "Greedy answer length for exact match."})
    max_generation_samples: int | None = field(default=None, metadata={"help": "Eval conversations to generate for."})


@exits_on_usage_error
def main(argv=None):
    model_args, data_args, sft_args, args = parse_args(
        (ModelArguments, DataArguments, SFTArguments, TrainingArguments), argv)
    accelerator, checkpoint = start_run(args)

    # Data: chat template, assistant-only labels; block_size is the maximum length.
    tokenizer = load_tokenizer(model_args)
    if sft_args.chat_template:
        tokenizer.chat_template = read_chat_template(sft_args.chat_template)
    raw = load_raw_datasets(data_args, args.seed)
    datasets, dropped = tokenize_sft(raw, tokenizer, sft_args.messages_column, data_args.block_size,
                                     sft_args.overlong, accelerator)
    padding = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    train_loader, eval_loader = make_dataloaders(
        datasets, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed,
        collate_fn=DataCollatorWithFlattening() if sft_args.packing else padding,
        eval_collate_fn=padding)  # eval keeps one row per conversation, so every one is counted once
    references = generation_references(raw["validation"], raw["train"].column_names, sft_args.messages_column,
                                       sft_args.max_generation_samples)
    stop_ids = end_of_turn_ids(datasets["validation"])

    model = load_model(model_args, tokenizer, args.seed, args.gradient_checkpointing)
    attention = use_per_example_attention(model) if sft_args.packing else model.config._attn_implementation
    accelerator.print(f"{'packed' if sft_args.packing else 'padded'} batches, attention: {attention}")
    parameters = count_parameters(model)
    optimizer = create_optimizer(model, args)
    train_loader = fit_batch_size(accelerator, model, train_loader, args)  # --auto_find_batch_size
    max_steps = total_training_steps(args, train_loader, accelerator.num_processes)
    scheduler = create_scheduler(optimizer, args, max_steps, accelerator.num_processes)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    # {"step": 0} for a fresh run. Loaded first: an earlier run's files change only once it has.
    state = load_checkpoint(accelerator, checkpoint)
    run = record_run(accelerator, model, optimizer, to_dict(model_args, data_args, sft_args, args), args.output_dir,
                     max_steps=max_steps, dropped_examples=dropped, attention=attention, **parameters)
    accelerator.init_trackers(args.run_name, tracker_config(run["args"]))
    step = state["step"]
    metrics = MetricsLogger(accelerator, args.output_dir, max_steps, start_step=step, model=model, optimizer=optimizer,
                            peak_tflops=args.peak_tflops)

    def evaluate():
        return metrics.log_eval(step, {**evaluate_loss(model, eval_loader, accelerator),
                                       **evaluate_generation(model, tokenizer, references, accelerator,
                                                             sft_args.max_new_tokens, stop_ids)})

    before = evaluate() if step == 0 else None

    model.train()
    grad_norm, skip_step = None, False
    nonfinite = NonFiniteGuard(accelerator, model, args.nonfinite, args.max_nonfinite_skips, metrics)
    batches = TrainBatches(accelerator, train_loader, args.gradient_accumulation_steps, max_steps, resume_from=state,
                           metrics=metrics)  # ends after step max_steps
    profiler = StepProfiler(accelerator, args.profile_steps, args.output_dir, args.profile_memory, start_step=step)
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            metrics.record_batch(loss, batch)
            nonfinite.record(loss)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)  # 0: off
                skip_step = nonfinite.skip_step(step + 1, grad_norm)  # every rank decides the same
            if not skip_step:
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        metrics.advance()
        profiler.step()
        if step % args.logging_steps == 0:
            metrics.log_train(step, scheduler.get_last_lr()[0], grad_norm)
        if args.eval_steps and step % args.eval_steps == 0 and step < max_steps:
            evaluate()
        if args.save_steps and step % args.save_steps == 0:
            save_checkpoint(accelerator, args.output_dir, step, {"data": batches.position}, args.save_total_limit,
                            tokenizer, export_dtype(model_args))
    profiler.stop()

    after = evaluate()
    final_dir = export_final(accelerator, model, tokenizer, args.output_dir, export_dtype(model_args))
    metrics.close()
    start = f"{before['eval_exact_match']:.3f} untrained -> " if before else ""
    accelerator.print(f"exact match {start}{after['eval_exact_match']:.3f} on {after['eval_generated']} questions; "
                      f"saved to {final_dir}")
    return after


if __name__ == "__main__":
    main()
