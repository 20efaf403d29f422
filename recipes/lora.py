"""LoRA fine-tuning of a causal LM with peft: only the low-rank adapters train.

Rank, alpha, dropout and target modules come from the recipe YAML. Saves the
adapter only to output_dir/final (loads with PeftModel.from_pretrained on the
base model) and, with --save_merged_model, the merged full model to
output_dir/final_merged. Data handling is the causal-LM recipe's (packed blocks).

    make lora CONFIG=accelerate_configs/zero3.yaml
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/lora.py \
        --config recipes/configs/lora_demo.yaml --lora_r 16

The demo adapts the model `make demo` trained to a different Markov chain over the
same words (outputs/data/markov_shift).
"""

import math
from dataclasses import dataclass, field

from common.arguments import DataArguments, ModelArguments, TrainingArguments
from common.batch_size import fit_batch_size
from common.data import load_raw_datasets, make_dataloaders, tokenize_and_pack
from common.model import apply_lora, load_model, load_tokenizer
from common.run import run_recipe, start_run
from common.training import create_optimizer, create_scheduler, evaluate_loss, total_training_steps, TrainBatches


@dataclass
class LoraArguments:
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    save_merged_model: bool = field(default=False, metadata={"help": "Also export base+adapter merged."})


def main(model_args: ModelArguments, data_args: DataArguments, lora_args: LoraArguments, args: TrainingArguments):
    run = start_run(model_args, data_args, lora_args, args)
    accelerator = run.accelerator

    tokenizer = load_tokenizer(model_args)
    raw = load_raw_datasets(data_args, args.seed)
    datasets = tokenize_and_pack(raw, tokenizer, data_args.text_column, data_args.block_size,
                                 accelerator, data_args.preprocessing_num_workers)
    train_loader, eval_loader = make_dataloaders(
        datasets, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed)

    # The base model, frozen, with trainable LoRA adapters.
    model = apply_lora(load_model(model_args, tokenizer, args.seed, args.gradient_checkpointing), lora_args)
    optimizer = create_optimizer(model, args)
    train_loader = fit_batch_size(accelerator, model, train_loader, args)  # --auto_find_batch_size
    max_steps = total_training_steps(args, train_loader, accelerator.num_processes)
    scheduler = create_scheduler(optimizer, args, max_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    # Resume from the checkpoint (if any), write run.json, start the metrics. {"step": 0} for a fresh run.
    state = run.begin(model, optimizer, scheduler, tokenizer, max_steps)
    step, metrics, nonfinite, profiler = state["step"], run.metrics, run.nonfinite, run.profiler
    metrics.log_eval(step, evaluate_loss(model, eval_loader, accelerator))  # the base model's loss

    model.train()
    grad_norm = None
    batches = TrainBatches(accelerator, train_loader, args.gradient_accumulation_steps, max_steps, resume_from=state,
                           metrics=metrics)  # ends after step max_steps
    for batch in batches:
        with accelerator.accumulate(model):
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
        if args.eval_steps and step % args.eval_steps == 0 and step < max_steps:
            metrics.log_eval(step, evaluate_loss(model, eval_loader, accelerator))
        if args.save_steps and step % args.save_steps == 0:
            run.save_checkpoint(step, {"data": batches.position})

    final_eval = metrics.log_eval(step, evaluate_loss(model, eval_loader, accelerator))
    final_dir = run.finish(merge_adapter=lora_args.save_merged_model)
    accelerator.print(f"eval_loss={final_eval['eval_loss']:.4f} perplexity={math.exp(final_eval['eval_loss']):.3f} "
                      f"adapter saved to {final_dir}")
    return final_eval


if __name__ == "__main__":
    run_recipe(main, ModelArguments, DataArguments, LoraArguments, TrainingArguments)
