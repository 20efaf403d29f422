"""Preference tuning with DPO (Direct Preference Optimization), the step after SFT.

The data are pairs: a prompt, a chosen and a rejected answer, as text or as conversations (TRL's
conversational format, or UltraFeedback's whole chats that share their prompt turns), rendered with
the tokenizer's chat template or --chat_template; the log-probabilities cover the answers only.
Each batch scores its chosen and rejected rows in one forward (common.data.preference).

The reference model (common.objectives.reference) is, with --use_peft, the policy with its adapters off (no
second copy); with --adapter_name_or_path (or a LoRA run's final/ as --model_name_or_path: DPO after
a LoRA SFT) the policy trains that adapter on and the reference is base + that adapter, frozen, a
second copy; otherwise a frozen copy sharded by the same strategy (FSDP2 shards, a ZeRO-3
partition), or with --precompute_ref_log_probs one pass over the data before training, kept in
output_dir for a resume. The loss (common.objectives.dpo): --loss_type sigmoid (DPO, --beta,
--label_smoothing), ipo or hinge, each with --rpo_alpha's NLL term if set; rewards/chosen,
rewards/rejected, rewards/accuracies and rewards/margins are logged on train and eval lines, as
TRL names them.

    make dpo CONFIG=accelerate_configs/zero3.yaml
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/dpo.py \
        --config recipes/configs/dpo_demo.yaml --use_peft

The demo (`make dpo`) teaches a tiny Llama, built from a config, to prefer the right sum over a
near miss ("what is 7 plus 5 ?": "12" over "13"), and prints the held-out preference accuracy.
"""

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from common.data.chat import answer_token_counts
from common.data.chat_template import read_chat_template
from common.data.loading import load_raw_datasets, make_dataloaders
from common.data.preference import PairBatches, answer_end_ids, chosen_references, tokenize_pairs
from common.launch.errors import UsageError
from common.models.loading import load_model, load_tokenizer
from common.models.lora import LoraArguments, apply_lora
from common.objectives.dpo import completion_lengths, completion_log_probs, evaluate_preferences, preference_loss
from common.objectives.reference import build_reference, disable_dropout
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.options.ranges import Range
from common.parallel.sequence_parallel import context_parallel
from common.run import run_recipe, start_run
from common.training.evaluation import evaluate_generation, size_max_new_tokens
from common.training.loop import TrainBatches, create_optimizer, create_scheduler, total_training_steps


@dataclass
class DPOArguments:
    reads_data_in_memory = (
        True  # not fields: --streaming and --auto_find_batch_size are refused (common.options.parsing)
    )
    no_auto_batch_size = "its trial step would not count the reference model nor score pairs"
    scores_whole_rows = (
        "each answer's log-probability"  # sequence parallelism refused (common.parallel.sequence_parallel)
    )
    chat_template: str | None = field(
        default=None,
        metadata={"help": "A chat template file or text; replaces the tokenizer's (and is saved with it)."},
    )
    beta: Annotated[float, Range(above=0)] = field(
        default=0.1,
        metadata={"help": "How far the policy may move from the reference: the rewards are beta x log-ratio."},
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = field(
        default="sigmoid", metadata={"help": "sigmoid (DPO), ipo (on per-token log-probs) or hinge (SLiC)."}
    )
    label_smoothing: Annotated[float, Range(low=0, below=0.5)] = field(
        default=0.0, metadata={"help": "The share of pairs assumed mislabelled (conservative DPO; sigmoid loss only)."}
    )
    rpo_alpha: Annotated[float, Range(low=0)] = field(
        default=0.0,
        metadata={
            "help": "Adds this times the chosen answer's negative log-likelihood per token to each pair's loss (RPO): "
            "keeps the chosen answer likely, where DPO alone can drift to answers neither side gave; 0: off."
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
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Score every pair with the reference once before training (no reference model in memory after)."
        },
    )
    max_generation_samples: Annotated[int, Range(low=0)] = field(
        default=0,
        metadata={
            "help": "Held-out prompts answered greedily at each evaluation (at most this many; sft.py's flag of the "
            "same name), scored by exact match against the chosen answer (where that is the right one: a task "
            "metric); 0: none."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Dropout off in the policy, so that it scores pairs as its reference does (TRL's default)."},
    )

    def __post_init__(self):
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise UsageError(f"--label_smoothing is for --loss_type sigmoid; drop it for {self.loss_type}")


def main(
    model_args: ModelArguments,
    data_args: DataArguments,
    dpo_args: DPOArguments,
    lora_args: LoraArguments,
    args: TrainingArguments,
):
    run = start_run(model_args, data_args, dpo_args, lora_args, args)
    accelerator = run.accelerator

    # Data: pairs, completion-only labels; block_size is the longest side of a pair.
    tokenizer = load_tokenizer(model_args)
    if dpo_args.chat_template:
        tokenizer.chat_template = read_chat_template(dpo_args.chat_template)
    raw = load_raw_datasets(data_args, args.seed)
    datasets, cut = tokenize_pairs(
        raw,
        tokenizer,
        data_args.block_size,
        dpo_args.max_prompt_length,
        dpo_args.overlong,
        accelerator,
        data_args.preprocessing_num_workers,
    )
    collate = PairBatches(tokenizer.pad_token_id)
    train_loader, eval_loader = make_dataloaders(
        datasets, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed, collate_fn=collate
    )
    references = chosen_references(raw["validation"], dpo_args.max_generation_samples)  # the task metric, if asked
    stop_ids = answer_end_ids(tokenizer, references)
    longest_answer = max(answer_token_counts(tokenizer, references), default=1)
    max_new_tokens = size_max_new_tokens(None, longest_answer, accelerator)

    model = apply_lora(load_model(model_args, tokenizer, args.seed, args), lora_args)
    if dpo_args.disable_dropout:  # the reference scores in eval mode: dropout off in both
        disable_dropout(model)
    reference = build_reference(model_args, tokenizer, args, lora_args.use_peft, dpo_args.precompute_ref_log_probs)
    optimizer = create_optimizer(model, args)
    max_steps = total_training_steps(args, train_loader, accelerator)
    scheduler = create_scheduler(optimizer, args, max_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    reference.prepare(run, model, datasets, collate, args.per_device_eval_batch_size)

    # Resume from the checkpoint (if any), write run.json, start the metrics. {"step": 0} for a fresh run.
    state = run.begin(
        model, optimizer, scheduler, tokenizer, max_steps, pairs_cut_or_dropped=cut, reference_model=reference.record()
    )
    reference.score_before_training()  # --precompute_ref_log_probs: once per run (a resumed one read its table)
    step, metrics, nonfinite, profiler = state["step"], run.metrics, run.nonfinite, run.profiler
    objective = dict(
        beta=dpo_args.beta,
        loss_type=dpo_args.loss_type,
        label_smoothing=dpo_args.label_smoothing,
        rpo_alpha=dpo_args.rpo_alpha,
    )

    def evaluate():
        scores = evaluate_preferences(model, reference, eval_loader, accelerator, **objective)
        if references:
            scores.update(
                evaluate_generation(
                    model,
                    tokenizer,
                    references,
                    accelerator,
                    max_new_tokens,
                    stop_ids,
                    args.per_device_eval_batch_size,
                    longest_answer,
                )
            )
        return metrics.log_eval(step, scores)

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
            ref_log_probs = reference.log_probs(batch, "train")
            losses, rewards = preference_loss(
                completion_log_probs(model, batch), ref_log_probs, completion_lengths(batch), **objective
            )
            # pairs per micro-batch are equal on every rank: the global batch's mean; plus a MoE's router loss
            loss = losses.mean() + run.router_loss()  # (as the model weighs it; 0 for a dense model)
            # its examples are pairs (two rows each); the reference's forward counts in the FLOPs
            metrics.record_batch(loss, batch, examples=len(losses), extra_forwards=reference.forwards_per_batch)
            metrics.record_values(rewards)
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
    start = f"{before['eval_prefers_chosen']:.3f} before -> " if before else ""
    accelerator.print(
        f"prefers the chosen answer {start}{after['eval_prefers_chosen']:.3f} of {after['eval_pairs']} "
        f"held-out pairs (reward accuracy {after['eval_rewards/accuracies']:.3f}, eval_loss "
        f"{after['eval_loss']:.4f}); saved to {final_dir}"
    )
    if references:
        start = f"{before['eval_exact_match']:.3f} before -> " if before and "eval_exact_match" in before else ""
        accelerator.print(
            f"greedy answers equal to the chosen one: {start}{after['eval_exact_match']:.3f} of "
            f"{after['eval_generated']}"
        )
    return after


if __name__ == "__main__":
    run_recipe(main, ModelArguments, DataArguments, DPOArguments, LoraArguments, TrainingArguments)
