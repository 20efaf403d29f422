"""Fine-tune an encoder (BERT family) for text classification.

Labels come from the data (--label_column); metrics from `evaluate` (accuracy and
F1 ship with the project, so they load offline). Evaluates every --eval_steps,
exports the best model by --metric_for_best_model to output_dir/best, stops early
after --early_stopping_patience evaluations without improvement, and exports the
last model to output_dir/final.

    make sequence_classification CONFIG=accelerate_configs/ddp.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/sequence_classification.py \
        --config recipes/configs/sequence_classification_demo.yaml \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2

Your own data: --train_file/--validation_file with --text_column and --label_column.
LoRA (peft): --use_peft trains low-rank adapters and the new classification head only
(--lora_r, --lora_alpha, --lora_target_modules, --save_merged_model; see recipes/causal_lm.py).
"""

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from common.data.loading import load_raw_datasets, make_dataloaders, tokenize_for_classification
from common.models.loading import load_model, load_tokenizer
from common.models.lora import LoraArguments, apply_lora
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.options.ranges import Range
from common.parallel.sequence_parallel import context_parallel
from common.run import run_recipe, start_run
from common.training.batch_size import fit_batch_size
from common.training.evaluation import BestModelTracker, evaluate_classification, load_metric
from common.training.loop import TrainBatches, create_optimizer, create_scheduler, total_training_steps


@dataclass
class ClassificationArguments:
    reads_data_in_memory = True  # not a field: --streaming is refused here (common.options.parsing)
    scores_whole_rows = "one class per example"  # sequence parallelism refused (common.parallel.sequence_parallel)
    label_column: str = "label"
    metrics: list[str] = field(default_factory=lambda: ["accuracy", "f1"])
    f1_average: Literal["binary", "macro", "micro", "weighted"] = "macro"
    metric_for_best_model: str = "eval_accuracy"
    greater_is_better: bool = True
    early_stopping_patience: Annotated[int | None, Range(low=1, why="unset: never stop early")] = field(
        default=None, metadata={"help": "Evaluations without improvement before stopping."}
    )


def main(
    model_args: ModelArguments,
    data_args: DataArguments,
    task_args: ClassificationArguments,
    lora_args: LoraArguments,
    args: TrainingArguments,
):
    run = start_run(model_args, data_args, task_args, lora_args, args)
    accelerator = run.accelerator
    metric_modules = {name: load_metric(name) for name in task_args.metrics}

    # Data: tokenize (block_size is the maximum length), pad per batch.
    tokenizer = load_tokenizer(model_args)
    raw = load_raw_datasets(data_args, args.seed)
    datasets, label_names = tokenize_for_classification(
        raw,
        tokenizer,
        data_args.text_column,
        task_args.label_column,
        data_args.block_size,
        accelerator,
        data_args.preprocessing_num_workers,
    )
    train_loader, eval_loader = make_dataloaders(
        datasets,
        args.per_device_train_batch_size,
        args.per_device_eval_batch_size,
        args.seed,
        collate_fn=DataCollatorWithPadding(tokenizer),
    )

    model = load_model(
        model_args,
        tokenizer,
        args.seed,
        args,
        auto_class=AutoModelForSequenceClassification,
        num_labels=len(label_names),
        id2label=dict(enumerate(label_names)),
        label2id={name: i for i, name in enumerate(label_names)},
    )
    model = apply_lora(model, lora_args)  # --use_peft: LoRA adapters and the new head train, the rest is frozen
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
        labels=label_names,
        eval_examples=len(datasets["validation"]),
    )
    step, metrics, nonfinite, profiler = state["step"], run.metrics, run.nonfinite, run.profiler
    best = BestModelTracker(
        task_args.metric_for_best_model, task_args.greater_is_better, task_args.early_stopping_patience
    )
    best.load_state_dict(state.get("best", {}))

    def evaluate_and_track():
        results = metrics.log_eval(
            step, evaluate_classification(model, eval_loader, accelerator, metric_modules, task_args.f1_average)
        )
        if best.update(step, results):
            run.export("best")
        return results

    if step == 0 and args.eval_on_start:  # the starting model's scores (not a best model to keep)
        metrics.log_eval(
            step, evaluate_classification(model, eval_loader, accelerator, metric_modules, task_args.f1_average)
        )

    # Training loop.
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
            evaluate_and_track()
            if best.should_stop:
                accelerator.print(
                    f"early stopping at step {step}: best {best.metric}={best.best_value:.4f} at step {best.best_step}"
                )
                break
        if args.save_steps and step % args.save_steps == 0:
            run.save_checkpoint(step, {"data": batches.position, "best": best.state_dict()})

    final = evaluate_and_track()
    run.finish()
    accelerator.print(
        f"eval_accuracy={final.get('eval_accuracy', float('nan')):.4f} best "
        f"{best.metric}={best.best_value:.4f} at step {best.best_step}"
    )
    return final


if __name__ == "__main__":
    run_recipe(main, ModelArguments, DataArguments, ClassificationArguments, LoraArguments, TrainingArguments)
