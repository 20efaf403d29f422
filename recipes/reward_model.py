"""Train a reward model on preference pairs: a sequence classifier with one output that scores the chosen
answer above the rejected one (TRL's RewardTrainer).

The pairs are DPO's (common.data.preference): a prompt, a chosen and a rejected answer as text or as
conversations (TRL's conversational format, or UltraFeedback's whole chats), rendered with the tokenizer's
chat template or --chat_template; an optional `margin` column (a number per pair) asks the chosen reward to
exceed the rejected one by that much. Each batch scores its chosen and rejected rows in one forward. A row's
reward is the score at its last token, also where the pad token is EOS (common.objectives.reward_model). The loss is
-log sigmoid(r_chosen - r_rejected - margin), plus --center_rewards_coefficient x (r_chosen + r_rejected)^2;
accuracy, margin, mean_reward, min_reward and max_reward are logged on train and eval lines, as TRL names them.

    make reward-model CONFIG=accelerate_configs/zero3.yaml
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/reward_model.py \
        --config recipes/configs/reward_model_demo.yaml

final/ is a Hugging Face sequence classifier with one output (its logit is the reward), which
AutoModelForSequenceClassification loads; with --use_peft the adapter with the score head saved beside it,
and with --save_merged_model also final_merged/. common.objectives.reward_model.load_reward_model and score read it as
training scored (GRPO's reward). The demo (`make reward-model`) trains a tiny Llama, built from a config, to
score the right sum above a near miss ("what is 7 plus 5 ?": "12" over "13"), and prints the held-out pair
accuracy before -> after.
"""

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from transformers import AutoModelForSequenceClassification

from common.data.chat_template import read_chat_template
from common.data.loading import load_raw_datasets, make_dataloaders
from common.data.preference import tokenize_pairs
from common.models.loading import load_model, load_tokenizer
from common.models.lora import LoraArguments, apply_lora
from common.objectives.reference import disable_dropout
from common.objectives.reward_model import (
    RewardBatches,
    attach_margins,
    check_reward_model_start,
    evaluate_rewards,
    pair_rewards,
    reward_loss,
)
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.options.ranges import Range
from common.parallel.sequence_parallel import context_parallel
from common.run import run_recipe, start_run
from common.training.loop import TrainBatches, create_optimizer, create_scheduler, total_training_steps


@dataclass
class RewardArguments:
    reads_data_in_memory = (
        True  # not fields: --streaming and --auto_find_batch_size are refused (common.options.parsing)
    )
    no_auto_batch_size = "its trial step runs the model's own loss, not a pair's"
    scores_whole_rows = "one reward per row"  # sequence parallelism refused (common.parallel.sequence_parallel)
    chat_template: str | None = field(
        default=None,
        metadata={"help": "A chat template file or text; replaces the tokenizer's (and is saved with it)."},
    )
    center_rewards_coefficient: Annotated[float, Range(low=0)] = field(
        default=0.0,
        metadata={
            "help": "Adds this times the mean of (r_chosen + r_rejected)^2 to the loss, keeping the rewards "
            "centred on 0 (TRL's; 0.01 is its advice); 0: off."
        },
    )
    max_prompt_length: Annotated[int | None, Range(low=1, why="unset: prompts are not cut")] = field(
        default=None, metadata={"help": "Prompts longer than this many tokens keep their last ones (counted)."}
    )
    overlong: Literal["drop", "truncate"] = field(
        default="drop",
        metadata={
            "help": "Pairs whose longer side is over --block_size: drop or truncate (cut at the answer's end); counted "
            "in run.json."
        },
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Dropout off in the model, as TRL's RewardTrainer has it by default."}
    )


def main(
    model_args: ModelArguments,
    data_args: DataArguments,
    reward_args: RewardArguments,
    lora_args: LoraArguments,
    args: TrainingArguments,
):
    check_reward_model_start(model_args)  # a classifier with another head: one line before anything starts
    run = start_run(model_args, data_args, reward_args, lora_args, args)
    accelerator = run.accelerator

    # Data: pairs (block_size is the longest side of a pair), each with its margin if the data has one.
    tokenizer = load_tokenizer(model_args)
    if reward_args.chat_template:
        tokenizer.chat_template = read_chat_template(reward_args.chat_template)
    raw = load_raw_datasets(data_args, args.seed)
    datasets, cut = tokenize_pairs(
        raw,
        tokenizer,
        data_args.block_size,
        reward_args.max_prompt_length,
        reward_args.overlong,
        accelerator,
        data_args.preprocessing_num_workers,
    )
    margins = attach_margins(raw, datasets)
    train_loader, eval_loader = make_dataloaders(
        datasets,
        args.per_device_train_batch_size,
        args.per_device_eval_batch_size,
        args.seed,
        collate_fn=RewardBatches(tokenizer.pad_token_id),
    )

    # A sequence classifier with one output: its score is the reward (with --use_peft the head trains too).
    model = load_model(
        model_args, tokenizer, args.seed, args, auto_class=AutoModelForSequenceClassification, num_labels=1
    )
    model = apply_lora(model, lora_args)
    if reward_args.disable_dropout:
        disable_dropout(model)
    optimizer = create_optimizer(model, args)
    max_steps = total_training_steps(args, train_loader, accelerator)
    scheduler = create_scheduler(optimizer, args, max_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    # Resume from the checkpoint (if any), write run.json, start the metrics. {"step": 0} for a fresh run.
    state = run.begin(
        model, optimizer, scheduler, tokenizer, max_steps, pairs_cut_or_dropped=cut, margin_column=margins
    )
    step, metrics, nonfinite, profiler = state["step"], run.metrics, run.nonfinite, run.profiler
    center = reward_args.center_rewards_coefficient

    def evaluate():
        return metrics.log_eval(step, evaluate_rewards(model, eval_loader, accelerator, center))

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
            chosen, rejected = pair_rewards(model, batch)  # one forward scores both sides
            losses, values = reward_loss(chosen, rejected, batch.get("margin"), center)
            loss = losses.mean()  # pairs per micro-batch are equal on every rank: the global batch's mean
            metrics.record_batch(loss, batch, examples=len(losses))  # its examples are pairs (two rows each)
            metrics.record_values(values)
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
    start = f"{before['eval_accuracy']:.3f} before -> " if before else ""
    accelerator.print(
        f"held-out pair accuracy {start}{after['eval_accuracy']:.3f} of {after['eval_pairs']} pairs (eval_loss "
        f"{after['eval_loss']:.4f}, margin {after['eval_margin']:.3f}); saved to {final_dir}"
    )
    return after


if __name__ == "__main__":
    run_recipe(main, ModelArguments, DataArguments, RewardArguments, LoraArguments, TrainingArguments)
