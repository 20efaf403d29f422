"""Train a decoder language model from scratch, or continue training a pretrained one.

Documents are tokenized and packed into fixed-length blocks (EOS between
documents), so no compute is spent on padding. Evaluates loss and perplexity,
checkpoints every --save_steps, resumes, and exports a Hugging Face folder to
output_dir/final.

The strategy comes from the accelerate config alone; this file never changes:

    make demo                                         # demo data, 2 CPU processes, DDP
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/causal_lm.py \
        --config recipes/configs/causal_lm_demo.yaml
    accelerate launch --config_file accelerate_configs/single.yaml recipes/causal_lm.py \
        --config recipes/configs/causal_lm_demo.yaml --max_steps 50 --output_dir outputs/try
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/causal_lm.py \
        --config recipes/configs/causal_lm_demo.yaml --resume_from_checkpoint latest

Your own data and model: --train_file my.jsonl (or --dataset_name), and
--model_name_or_path gpt2 (continue training) or --model_config cfg.json
--tokenizer_name_or_path gpt2 (from scratch).

LoRA (peft): --use_peft trains low-rank adapters only (rank, alpha, dropout and target
modules from --lora_* or the recipe YAML) and saves the adapter to output_dir/final;
--save_merged_model also writes the merged model to output_dir/final_merged:

    make lora CONFIG=accelerate_configs/zero3.yaml    # recipes/configs/lora_demo.yaml
"""

import math

from common.data.loading import load_raw_datasets, make_dataloaders, tokenize_and_pack
from common.models.loading import load_model, load_tokenizer
from common.models.lora import LoraArguments, apply_lora
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.parallel.sequence_parallel import context_parallel
from common.run import run_recipe, start_run
from common.training.batch_size import fit_batch_size
from common.training.loop import TrainBatches, create_optimizer, create_scheduler, evaluate_loss, total_training_steps


def main(model_args: ModelArguments, data_args: DataArguments, lora_args: LoraArguments, args: TrainingArguments):
    run = start_run(model_args, data_args, lora_args, args)
    accelerator = run.accelerator

    # Data: tokenize and pack into blocks of block_size tokens.
    tokenizer = load_tokenizer(model_args)
    raw = load_raw_datasets(data_args, args.seed)
    datasets = tokenize_and_pack(
        raw, tokenizer, data_args.text_column, data_args.block_size, accelerator, data_args.preprocessing_num_workers
    )
    train_loader, eval_loader = make_dataloaders(
        datasets, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed
    )

    # Model (with --use_peft: frozen, with trainable LoRA adapters), optimizer, schedule.
    model = apply_lora(load_model(model_args, tokenizer, args.seed, args), lora_args)
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
        train_blocks=None if data_args.streaming else len(datasets["train"]),
    )
    step, metrics, nonfinite, profiler = state["step"], run.metrics, run.nonfinite, run.profiler
    if step == 0 and args.eval_on_start:
        metrics.log_eval(step, evaluate_loss(model, eval_loader, accelerator))  # the starting model's loss

    # Training loop: one optimizer step per gradient_accumulation_steps batches. Each batch
    # carries num_items_in_batch, so the loss is the mean over the global batch's label tokens.
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
            metrics.log_eval(step, evaluate_loss(model, eval_loader, accelerator))
        if args.save_steps and step % args.save_steps == 0:
            run.save_checkpoint(step, {"data": batches.position})

    final_eval = metrics.log_eval(step, evaluate_loss(model, eval_loader, accelerator))
    final_dir = run.finish()
    accelerator.print(
        f"eval_loss={final_eval['eval_loss']:.4f} perplexity={math.exp(final_eval['eval_loss']):.3f} "
        f"saved to {final_dir}"
    )
    return final_eval


if __name__ == "__main__":
    run_recipe(main, ModelArguments, DataArguments, LoraArguments, TrainingArguments)
