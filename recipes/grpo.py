"""Online RL with GRPO (Group Relative Policy Optimization): the model learns from a reward it is given, not from
answers to copy.

Each step samples --num_generations (G) completions of each of its prompts (--temperature, --top_p,
--max_completion_length), scores them with --reward_funcs (common.objectives.rewards: built-ins such as `accuracy`
against an `answer` column, your own Python function, a reward model folder from recipes/reward_model.py),
turns each group's rewards into advantages (--scale_rewards) and takes the clipped policy loss
(--loss_type dapo, TRL's default, or grpo, dr_grpo, bnpo; --epsilon, --epsilon_high; GSPO's
--importance_sampling_level sequence; --delta; common.objectives.grpo), reusing a rollout for --num_iterations steps.
--advantage_estimator rloo trains as TRL's RLOOTrainer: the leave-one-out baseline, the KL in the reward. With
--beta > 0 a KL term keeps the policy near the reference, held as DPO's is (adapters off under --use_peft, else a
frozen copy sharded like the policy).

The data: a `prompt` column, text or a conversation (rendered with the chat template); the other columns go to
the reward functions. --per_device_train_batch_size counts completions, as TRL's: a step trains on processes x
batch x accumulation completions, G per prompt.

Rollouts (common.objectives.rollout) depend on (seed, step, prompt) only, not on the number of processes or the config,
and sample from whole weights on every rank: under FSDP2, ZeRO-3 and tensor parallelism a copy gathered once
per rollout, so decoding runs at the unsharded model's speed and ranks never wait on each other's lengths.

    make grpo CONFIG=accelerate_configs/zero3.yaml
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/grpo.py --config recipes/configs/grpo_demo.yaml

The demo (`make grpo`) teaches a tiny Llama, from the reward alone, to answer "what is 3 plus 4 ?" with the
number, and prints the held-out reward before -> after.
"""

import functools
import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch

from common.data.chat_template import read_chat_template
from common.data.loading import load_raw_datasets
from common.launch.accelerator import declare_micro_batch
from common.launch.errors import UsageError
from common.launch.internals import start_accumulation_window
from common.models.loading import load_model, load_tokenizer
from common.models.lora import LoraArguments, apply_lora
from common.objectives.grpo import (
    batch_std,
    completion_figures,
    count_global,
    group_advantages,
    leave_one_out_advantages,
    normalise_advantages,
    policy_loss,
    rloo_loss,
    rollout_kl,
    rollout_log_probs,
    token_log_probs,
    whole_groups,
)
from common.objectives.reference import build_reference, disable_dropout
from common.objectives.rewards import Rewards, evaluate_rewards, load_rewards, trainer_state
from common.objectives.rollout import (
    CompletionLog,
    GenerationWeights,
    Rollout,
    Sampler,
    SamplingSettings,
    prompt_order,
    stop_token_ids,
    tokenize_prompts,
)
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.options.ranges import Range
from common.parallel.sequence_parallel import RowSums, split_rows
from common.run import run_recipe, start_run
from common.training.loop import create_optimizer, create_scheduler


@dataclass
class GRPOArguments:
    reads_data_in_memory = (
        True  # not fields: --streaming and --auto_find_batch_size are refused (common.options.parsing)
    )
    no_auto_batch_size = "its trial step would not count the rollout's generation"
    scores_whole_rows = "each completion's log-probabilities"  # pipelines refused (common.parallel.pipeline)
    scores_split_rows = True  # sequence/context parallelism: each rank a slice of every row (split_rows)
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "accuracy (the last number against an `answer` column), format (--format_pattern), length "
            "(shorter is better), path/to/file.py:function, module:function, or a reward model folder."
        },
    )
    reward_weights: list[float] | None = field(default=None, metadata={"help": "One per function (1 each unset)."})
    format_pattern: str = field(
        default=r"-?\d+(?:\.\d+)?", metadata={"help": "The `format` reward's regular expression (the whole answer)."}
    )
    num_generations: Annotated[int, Range(low=2)] = field(default=8, metadata={"help": "Completions per prompt (G)."})
    max_completion_length: Annotated[int, Range(low=1)] = field(
        default=256,
        metadata={
            "help": "The longest completion, in tokens. --block_size bounds prompt + completion: a prompt keeps "
            "--block_size less this (a longer prompt is left out, counted in run.json's prompts_dropped)."
        },
    )
    temperature: Annotated[float, Range(above=0, why="greedy completions of a prompt are all alike: no advantage")] = (
        1.0
    )
    top_p: Annotated[float, Range(above=0, high=1)] = 1.0
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = field(
        default="dapo", metadata={"help": "How the token losses are averaged (common.objectives.grpo)."}
    )
    scale_rewards: Literal["group", "batch", "none", "true", "false"] = field(
        default="group",
        metadata={
            "help": "The advantages' divisor: the group's reward std, the batch's, or none (TRL's true and false: "
            "group and none)."
        },
    )
    epsilon: Annotated[float, Range(above=0, below=1)] = 0.2
    epsilon_high: Annotated[float | None, Range(above=0, why="unset: --epsilon")] = field(
        default=None, metadata={"help": "The upper clip (DAPO suggests 0.28); unset: --epsilon."}
    )
    importance_sampling_level: Literal["token", "sequence"] = field(
        default="token",
        metadata={
            "help": "The ratio to the sampling policy per token, or per completion (GSPO: the mean of its tokens' "
            "log-ratios; TRL pairs it with --loss_type grpo)."
        },
    )
    delta: Annotated[float | None, Range(above=0, why="unset: one-sided clipping")] = field(
        default=None,
        metadata={"help": "Two-sided clipping: the ratio's cap in the unclipped term (TRL: above 1 + --epsilon)."},
    )
    advantage_estimator: Literal["grpo", "rloo"] = field(
        default="grpo",
        metadata={
            "help": "grpo: the group's mean as baseline, TRL's GRPOTrainer; rloo: the mean of the other completions "
            "of the prompt, the KL in the reward, one ratio per completion: TRL's RLOOTrainer (which defaults to "
            "--num_generations 2 and --beta 0.05)."
        },
    )
    normalize_advantages: bool = field(
        default=False, metadata={"help": "RLOO: the advantages normalised over the global batch (TRL's RLOOConfig)."}
    )
    reward_clip_range: list[float] | None = field(
        default=None, metadata={"help": "RLOO: two numbers, the rewards clamped into [low, high] (TRL's RLOOConfig)."}
    )
    beta: Annotated[float, Range(low=0)] = field(
        default=0.0, metadata={"help": "The KL term's weight; 0 (TRL's default): no reference model is held."}
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "With --beta: each token's KL term times its importance ratio (differentiable, 1 on-policy), the "
            "unbiased reverse-KL gradient (TRL's default, DeepSeek-V3.2); false: the plain k3 term."
        },
    )
    num_iterations: Annotated[int, Range(low=1)] = field(
        default=1, metadata={"help": "Optimizer steps per rollout (the sampling policy's log-probs kept)."}
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Completions cut by --max_completion_length count for no loss."}
    )
    chat_template: str | None = field(
        default=None, metadata={"help": "A chat template file or text; replaces the tokenizer's (and is saved)."}
    )
    rollout_weights: Literal["auto", "copy", "stages"] = field(
        default="auto",
        metadata={
            "help": "Where the config shards the weights (FSDP2, ZeRO-3, tensor parallel), what the rollouts sample "
            "from: a whole copy gathered once per rollout, or a slice of the layers per process generating as a "
            "ring (no copy); auto: the copy where it fits in free memory (run.json says what was chosen and why)."
        },
    )
    disable_dropout: bool = True
    log_completions: bool = field(
        default=False, metadata={"help": "Append every rollout's completions and rewards to completions.jsonl."}
    )

    def __post_init__(self):
        self.scale_rewards = {"true": "group", "false": "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.reward_clip_range is not None and (
            len(self.reward_clip_range) != 2 or self.reward_clip_range[0] > self.reward_clip_range[1]
        ):
            raise UsageError(f"--reward_clip_range {self.reward_clip_range}: two numbers, low then high (e.g. -1 1)")
        if self.advantage_estimator == "rloo":
            grpo_only = {
                "--loss_type": self.loss_type != "dapo",
                "--scale_rewards": self.scale_rewards != "group",
                "--importance_sampling_level": self.importance_sampling_level != "token",
                "--delta": self.delta is not None,
            }
            named = [name for name, given in grpo_only.items() if given]
            if named:
                raise UsageError(
                    f"{', '.join(named)}: GRPO's, not in RLOO's objective (TRL's RLOOConfig has none of them); "
                    "drop them, or use --advantage_estimator grpo"
                )
        else:
            rloo_only = {
                "--normalize_advantages": self.normalize_advantages,
                "--reward_clip_range": self.reward_clip_range is not None,
            }
            named = [name for name, given in rloo_only.items() if given]
            if named:
                raise UsageError(
                    f"{', '.join(named)}: RLOO's (TRL's RLOOConfig); add --advantage_estimator rloo, or drop them "
                    "(GRPO's advantages take --scale_rewards)"
                )


def main(
    model_args: ModelArguments,
    data_args: DataArguments,
    grpo_args: GRPOArguments,
    lora_args: LoraArguments,
    args: TrainingArguments,
):
    run = start_run(model_args, data_args, grpo_args, lora_args, args)
    accelerator = run.accelerator
    if grpo_args.importance_sampling_level == "sequence" and grpo_args.loss_type != "grpo":  # as TRL warns
        accelerator.print(
            f"note: --importance_sampling_level sequence with --loss_type {grpo_args.loss_type} weighs each completion "
            "by its length; GSPO's own objective is --loss_type grpo"
        )
    group, accumulation = grpo_args.num_generations, args.gradient_accumulation_steps
    run.check_accumulation(whole_groups(args.per_device_train_batch_size, group))  # on every world the launch allows

    # Data: prompts (with their other columns, for the rewards), the rewards.
    tokenizer = load_tokenizer(model_args)
    if grpo_args.chat_template:
        tokenizer.chat_template = read_chat_template(grpo_args.chat_template)
    raw = load_raw_datasets(data_args, args.seed)
    prompts, dropped = tokenize_prompts(
        raw,
        tokenizer,
        data_args.block_size,
        grpo_args.max_completion_length,
        accelerator,
        data_args.preprocessing_num_workers,
    )
    functions, names, weights = load_rewards(
        grpo_args.reward_funcs,
        grpo_args.reward_weights,
        grpo_args.format_pattern,
        grpo_args.max_completion_length,
        accelerator.device,
        torch.float32,
        raw["train"].column_names,  # `answer` where the built-ins read it
    )
    rewards = Rewards(functions, names, weights, tokenizer, accelerator)
    per_rollout = args.per_device_train_batch_size * accumulation // group  # prompts per process
    order = prompt_order(accelerator, len(prompts["train"]), per_rollout, args.seed)
    max_steps = (
        args.max_steps if args.max_steps > 0 else args.num_train_epochs * order.per_epoch * grpo_args.num_iterations
    )

    model = apply_lora(load_model(model_args, tokenizer, args.seed, args), lora_args)
    if grpo_args.disable_dropout:
        disable_dropout(model)
    reference = build_reference(model_args, tokenizer, args, lora_args.use_peft, False) if grpo_args.beta else None
    optimizer = create_optimizer(model, args)
    scheduler = create_scheduler(optimizer, args, max_steps)
    declare_micro_batch(accelerator, args.per_device_train_batch_size)  # no data loader to read it from
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if reference is not None:
        reference.prepare(run, model, {}, None, args.per_device_eval_batch_size)
    weights_for_rollouts = GenerationWeights(  # a rank samples its rollout's completions in one decoding call
        accelerator,
        model,
        grpo_args.rollout_weights,
        args.per_device_train_batch_size * accumulation,
        data_args.block_size or grpo_args.max_completion_length,
    )
    settings = SamplingSettings(
        grpo_args.temperature,
        grpo_args.top_p,
        grpo_args.max_completion_length,
        stop_token_ids(tokenizer, weights_for_rollouts.policy),
        tokenizer.pad_token_id,
    )
    sampler = Sampler(weights_for_rollouts, prompts["train"], order, group, args.seed, settings, accelerator)

    rows = RowSums(accelerator)  # sums over whole completions, also where each rank holds a slice of them

    # Resume from the checkpoint (if any), write run.json, start the metrics. {"step": 0} for a fresh run.
    state = run.begin(
        model,
        optimizer,
        scheduler,
        tokenizer,
        max_steps,
        prompts_dropped=dropped,
        rollout=weights_for_rollouts.record(),
        reward_funcs=names,
        reward_weights=weights,
        reference_model=reference.record() if reference is not None else None,
        rows_split_over=rows.shards,  # zero3_ulysses.yaml, fsdp_cp.yaml: the ranks scoring a slice of each row each
    )
    step, metrics, nonfinite, profiler = state["step"], run.metrics, run.nonfinite, run.profiler
    tokens_seen = state.get("num_tokens", 0)  # prompts' and completions' tokens so far (TRL's num_tokens)
    completion_log = (
        CompletionLog(accelerator, args.output_dir, tokenizer, step, grpo_args.num_iterations)
        if grpo_args.log_completions
        else None
    )
    saved = state.get("rollout")  # a run stopped inside --num_iterations: the rollout it was training on
    # every log-probability at the temperature the completions were sampled at, as TRL scores them
    temperature = grpo_args.temperature
    scored_at_temperature = functools.partial(token_log_probs, temperature=temperature)
    steps_per_epoch = order.per_epoch * grpo_args.num_iterations
    rloo = grpo_args.advantage_estimator == "rloo"  # TRL's RLOOTrainer: the KL in the reward, a ratio per completion
    clip = dict(epsilon=grpo_args.epsilon, epsilon_high=grpo_args.epsilon_high or grpo_args.epsilon)
    objective = functools.partial(
        policy_loss,
        loss_type=grpo_args.loss_type,
        beta=grpo_args.beta,
        bias_correction_kl=grpo_args.use_bias_correction_kl,
        max_completion_length=grpo_args.max_completion_length,
        importance_sampling_level=grpo_args.importance_sampling_level,
        delta=grpo_args.delta,
        **clip,
    )
    if rloo:
        objective = functools.partial(rloo_loss, **clip)
    kl_in_loss = reference is not None and not rloo  # RLOO's is in the reward, taken at the rollout

    def evaluate():
        return metrics.log_eval(
            step,
            evaluate_rewards(
                sampler,
                rewards,
                prompts["validation"],
                step,
                args.per_device_eval_batch_size,
                data_args.max_eval_samples,
                trainer_state(step, max_steps, steps_per_epoch),
                completion_log,
            ),
        )

    if step == 0 and args.eval_on_start:
        evaluate()

    model.train()
    grad_norm = None
    run.budget.start()  # --max_train_seconds counts from here
    while step < max_steps and not run.budget.stopped:
        index, first_iteration = divmod(step, grpo_args.num_iterations)
        if saved is not None:  # resumed inside a rollout: the same completions, advantages and old log-probs
            rollout, saved = Rollout.from_state(saved, accelerator), None
            metrics.record_latest("num_tokens", tokens_seen)  # as the checkpoint counted them
        else:
            # G completions of each of this rank's prompts, then their rewards (every rank together) and advantages
            rollout = sampler.rollout(index, step, metrics.show_phase)
            reward, table = rewards(rollout.rows, prompts["train"], trainer_state(step, max_steps, steps_per_epoch))
            if rloo:  # TRL's RLOOTrainer: the rewards clamped, less the KL penalty, then the leave-one-out baseline
                clip_range = grpo_args.reward_clip_range
                score = reward if clip_range is None else reward.clamp(*clip_range)
                if reference is not None:
                    kl, (kl_sum, kl_tokens) = rollout_kl(
                        model,
                        reference,
                        rollout,
                        args.per_device_train_batch_size,
                        tokenizer.pad_token_id,
                        accelerator,
                        temperature,
                        grpo_args.mask_truncated_completions,
                    )
                    score = score - grpo_args.beta * kl
                    metrics.record_per_call({"kl": ("pooled", kl_sum, kl_tokens)})
                advantages, stds = leave_one_out_advantages(score, group)
                rollout.advantages = normalise_advantages(accelerator, advantages, grpo_args.normalize_advantages)
            else:
                rollout.advantages, stds = group_advantages(
                    reward, group, grpo_args.scale_rewards, batch_std(accelerator, reward)
                )
            if completion_log is not None:
                completion_log(rollout, reward, table, rewards)
            lengths, tokens = completion_figures(accelerator, rollout)
            tokens_seen += tokens
            metrics.record_values(
                {
                    **rewards.values(reward, table),
                    "frac_reward_zero_std": (stds.abs() <= 1e-8).float(),  # TRL's isclose(std, 0)
                    **lengths,
                    "rollout/near_tie_ratio": torch.tensor([float(r["near_ties"] > 0) for r in rollout.rows]),
                    **{f"rollout/{k}_per_device": torch.tensor([v]) for k, v in rollout.timing.items()},
                }
            )
            metrics.record_latest("num_tokens", tokens_seen)
            if grpo_args.num_iterations > 1:  # the sampling policy's log-probs, for the later iterations' ratios
                rollout.old_log_probs = rollout_log_probs(
                    model, rollout, args.per_device_train_batch_size, tokenizer.pad_token_id, accelerator, temperature
                )
        normaliser = count_global(accelerator, rollout, accumulation, grpo_args.mask_truncated_completions)

        for _ in range(first_iteration, grpo_args.num_iterations):  # each pass over the rollout: one optimizer step
            start_accumulation_window(accelerator)  # the pass's last micro-batch syncs and steps
            for batch in rollout.micro_batches(
                args.per_device_train_batch_size,
                tokenizer.pad_token_id,
                grpo_args.mask_truncated_completions,
                accelerator.device,
            ):
                # zero3_ulysses.yaml, fsdp_cp.yaml: this rank's slice of every row (the group holds the same rows)
                with accelerator.accumulate(model), split_rows(accelerator, batch) as batch:
                    entropy = []  # each token's, at the sampling temperature (TRL's entropy)
                    with accelerator.autocast():
                        log_probs = token_log_probs(model, batch, temperature, entropy)
                    ref_log_probs = reference.apply(scored_at_temperature, batch) if kl_in_loss else None
                    loss, values = objective(
                        log_probs,
                        batch.get("old_log_probs"),
                        ref_log_probs,
                        batch["advantages"],
                        batch["mask"],
                        normaliser,
                        entropy=entropy[0],
                        rows=rows,
                    )
                    loss = loss + run.router_loss()  # a MoE's router loss, as the model weighs it (0: a dense model)
                    metrics.record_batch(loss, batch, extra_forwards=int(kl_in_loss))
                    metrics.record_per_call(values)
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
                inside = step % grpo_args.num_iterations  # passes of this rollout done, if not all of them
                position = {"rollout": index + (0 if inside else 1), "global_batch": order.prompts * group}
                run.save_checkpoint(
                    step,
                    {
                        "data": position,
                        "rollout": rollout.state(accelerator, inside) if inside else None,
                        "num_tokens": tokens_seen,
                    },
                )
            if run.budget.done(step, max_steps):  # at max_steps, or where --max_train_seconds runs out
                break

    after = evaluate()
    before = metrics.eval_at_start()  # --eval_on_start's figures, this run's or the resumed run's
    final_dir = run.finish()
    start = f"{format_figure(before['eval_reward'])} before -> " if before else ""
    each = ", ".join(f"{name} {format_figure(after['eval_rewards/' + name + '/mean'])}" for name in names)
    accelerator.print(
        f"held-out reward {start}{format_figure(after['eval_reward'])} over {after['eval_prompts']} prompts ({each}); "
        f"saved to {final_dir}"
    )
    return after


def format_figure(value) -> str:
    return "none scored" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    run_recipe(main, ModelArguments, DataArguments, GRPOArguments, LoraArguments, TrainingArguments)
