"""The GRPO objective: group advantages, per-token log-probabilities, the clipped policy loss behind --loss_type.

As TRL's GRPOTrainer computes it (the release docs/rl.md names). For a prompt's G completions with rewards
r_1..r_G, the advantage of completion i is
    A_i = r_i - mean(r)                                   --scale_rewards none (Dr. GRPO; TRL's false)
    A_i = (r_i - mean(r)) / (std(r) + 1e-4)               --scale_rewards group (GRPO, TRL's default; true)
    A_i = (r_i - mean(r)) / (std of the batch's r + 1e-4) --scale_rewards batch (over every rank's completions)
(std unbiased, as torch.std and TRL). A completion no reward function scored (each returned None) has no reward: it
is left out of its group's mean and std, and its advantage is 0. logp is a token's log-probability at the sampling
temperature, log_softmax(logits / T), for the policy, the policy that sampled (--num_iterations) and the reference
alike, as TRL scores them. Each completion token t then has, with the ratio rho = exp(logp - logp_old) to the
policy that sampled it,
    l_t = -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta KL_t,
    KL_t = exp(ref - logp) - (ref - logp) - 1             (the k3 estimator; only with --beta > 0)
and the loss sums l_t over the completion tokens (`mask`: a truncated completion's are 0 under
--mask_truncated_completions), divided as --loss_type says:
    grpo     each completion's mean over its tokens, averaged over the global batch's completions
    dr_grpo  the sum over the global batch / (its completions x --max_completion_length)
    dapo     the sum over the global batch / its completion tokens (TRL's default)
    bnpo     each micro-batch's sum / its own tokens (TRL's definition: it depends on how the batch is split)
"Global batch" is every rank's micro-batches of one optimizer step: `Normaliser` holds its counts, so
that after accelerate divides by the accumulation steps and the strategy averages over ranks, the
gradient is the one of the loss above whatever the split (bnpo aside). With --num_iterations 1 the
old policy is the current one (rho = 1, its gradient the policy gradient), as TRL.

GSPO (--importance_sampling_level sequence, TRL's): rho is one ratio per completion, the exponential of the mean of
its tokens' log-ratios, clipped as above and taken by every one of its tokens (TRL pairs it with --loss_type grpo,
GSPO's own average; under dapo, bnpo and dr_grpo a completion weighs by its length, as TRL warns). --delta (TRL's
two-sided clipping, INTELLECT-2): rho is also capped at delta in the unclipped term, so a negative advantage's loss
is bounded (the clip figures read the capped ratio, as TRL's).

RLOO (--advantage_estimator rloo, as TRL's RLOOTrainer computes it): the baseline of completion i is the mean of
its group's other scored rewards, A_i = r_i - mean_{j != i} r_j (a group with one scored completion: 0), over the
global batch normalised with --normalize_advantages, after --reward_clip_range clamps the rewards and, with --beta,
the KL penalty enters the reward: r_i - beta * sum_t (logp_old - ref) over its tokens (k1, at the sampling policy).
Its loss is per completion, on the ratio of whole-completion probabilities, exp(sum_t logp - sum_t logp_old),
clipped as above, averaged over the global batch's completions; no KL term in the loss, no --loss_type.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from common.launch import mesh
from common.objectives.scoring import completion_logits
from common.parallel import sequence_parallel


LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo")
SCALINGS = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")
ESTIMATORS = ("grpo", "rloo")
STD_EPSILON = 1e-4  # TRL's


def whole_groups(per_device: int, group: int):
    """GRPO's rule on a step's accumulation steps, for `common.run.Run.check_accumulation`: each process samples
    whole groups, so G divides its completions per step (per device x accumulation)."""

    def rule(accumulation: int) -> str | None:
        completions = per_device * accumulation
        if completions % group == 0:
            return None
        return (
            f"a step trains --per_device_train_batch_size x --gradient_accumulation_steps = {completions} completions "
            f"per process, not a multiple of --num_generations {group}: each process samples whole groups"
        )

    return rule


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased std of the values that are not NaN (NaN where fewer than 2 are), as TRL's nanstd."""
    mean = values.nanmean(dim=dim, keepdim=True) if dim is not None else values.nanmean()
    variance = ((values - mean) ** 2).nanmean(dim=dim) if dim is not None else ((values - mean) ** 2).nanmean()
    count = (~values.isnan()).sum(dim=dim) if dim is not None else (~values.isnan()).sum()
    return torch.where(count > 1, (variance * count / (count - 1).clamp(min=1)).sqrt(), math.nan)


def group_advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: torch.Tensor | None = None):
    """(advantages, the std each completion's advantage is divided by: TRL's zero-std test) for `rewards` of
    consecutive groups of `group` completions (one prompt each), NaN where no function scored a completion (left out
    of its group's mean and std; advantage 0). `batch_std`: the std over the whole global batch (every rank's
    rewards), for --scale_rewards batch; `none` divides by nothing (its zero-std test: the group's std)."""
    grouped = rewards.view(-1, group)
    std = nanstd(grouped, dim=1).repeat_interleave(group)
    centred = (grouped - grouped.nanmean(dim=1, keepdim=True)).flatten()
    if scale == "group":
        advantages = centred / (std + STD_EPSILON)
    elif scale == "batch":
        std = batch_std.expand(centred.shape)
        advantages = centred / (std + STD_EPSILON)
    elif scale == "none":
        advantages = centred
    else:
        raise ValueError(f"scale_rewards {scale!r}: one of {SCALINGS}")
    return torch.nan_to_num(advantages, nan=0.0), std


def leave_one_out_advantages(rewards: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's (advantages, each group's reward std, for frac_reward_zero_std) for `rewards` of consecutive groups of
    `group` completions, as TRL's RLOOTrainer: each reward minus the mean of its group's other scored ones. NaN stays
    where no baseline or no reward exists (unscored, or alone in its group): `normalise_advantages` skips those,
    then they become 0."""
    grouped = rewards.view(-1, group)
    scored = (~grouped.isnan()).sum(dim=1, keepdim=True)
    baselines = (grouped.nansum(dim=1, keepdim=True) - grouped) / (scored - 1)
    return (grouped - baselines).flatten(), nanstd(grouped, dim=1).repeat_interleave(group)


def normalise_advantages(accelerator, advantages: torch.Tensor, normalise: bool) -> torch.Tensor:
    """RLOO's --normalize_advantages: minus the mean, over the std (+1e-4), of every data-parallel rank's advantages
    (NaN left out); then NaN -> 0. Every rank calls it when `normalise`."""
    if normalise:
        every = global_rows(accelerator, advantages)
        advantages = (advantages - every.nanmean()) / (nanstd(every) + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


@torch.no_grad()
def rollout_kl(model, reference, rollout, batch_size: int, pad_id: int, accelerator, temperature: float, masked):
    """RLOO's KL penalty: each completion's sum over its tokens of logp_old - ref (k1; the policy as it sampled), and
    the kl figure's (sum, tokens) on this rank, micro-batch by micro-batch (every rank calls it: a sharded model's
    forwards are collective). `masked`: --mask_truncated_completions (a truncated completion's tokens count 0)."""
    sums, total, tokens, rows = [], 0.0, 0.0, sequence_parallel.RowSums(accelerator)
    for start in range(0, len(rollout.rows), batch_size):
        batch = rollout.batch(rollout.rows[start : start + batch_size], pad_id, masked)
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        with sequence_parallel.split_rows(accelerator, batch) as part:
            with accelerator.autocast():
                policy = token_log_probs(model, part, temperature).float()
            reference_log_probs = reference.apply(functools.partial(token_log_probs, temperature=temperature), part)
        gap = (policy - reference_log_probs.float()) * part["mask"].float()
        sums += rows(gap).cpu().tolist()
        total, tokens = total + float(gap.sum()), tokens + float(part["mask"].sum())
    return torch.tensor(sums, dtype=torch.float32), (total, tokens)


# Positions whose fp32 log-softmax is made at once, per row: the fp32 copy of the logits is this many x vocabulary
SCORED_CHUNK = 256


def token_log_probs(model, batch: dict, temperature: float = 1.0, entropies: list | None = None) -> torch.Tensor:
    """(rows, positions) log-probability of each next token under `model` at the sampling `temperature`
    (log_softmax(logits / T)), in fp32; 0 where the target is -100 (prompt and padding). The LM head runs on the
    completions' positions only (`completion_logits`), and each row's fp32 log-softmax is made SCORED_CHUNK
    positions at a time, on that row's completion positions alone. Positions: length - 1 (position p predicts token
    p + 1), or on a slice of split rows its own positions. `entropies`: a list that gets the entropy of each scored
    next-token distribution at that temperature (no gradient; 0 elsewhere), in the same layout, for TRL's
    `entropy`."""
    logits, labels, columns = completion_logits(model, batch)
    width = labels.shape[1]
    rows, spread = [], []
    for row, row_labels in zip(logits, labels[:, columns]):
        kept = (row_labels != -100).nonzero().squeeze(1)
        picked, entropy = [], []
        for start in range(0, len(kept), SCORED_CHUNK):
            where = kept[start : start + SCORED_CHUNK]
            log_probs = (row[where].float() / temperature).log_softmax(-1)
            picked.append(log_probs.gather(-1, row_labels[where].unsqueeze(-1)).squeeze(-1))
            if entropies is not None:
                with torch.no_grad():
                    probs = log_probs.exp()
                    entropy.append(-torch.special.xlogy(probs, probs).sum(-1))  # 0 log 0 = 0
        positions = columns[kept]
        values = torch.cat(picked) if picked else logits.new_zeros(0, dtype=torch.float32)
        rows.append(logits.new_zeros(width, dtype=torch.float32).index_put((positions,), values))
        if entropies is not None:
            values = torch.cat(entropy) if entropy else logits.new_zeros(0, dtype=torch.float32)
            spread.append(logits.new_zeros(width, dtype=torch.float32).index_put((positions,), values))
    if entropies is not None:
        entropies.append(torch.stack(spread))
    scores = torch.stack(rows)
    if logits.requires_grad and not scores.requires_grad:  # no completion token here (a slice of prompts): the loss
        scores = scores + (logits[:, :1, :1].float() * 0.0).nan_to_num().sum()  # still reaches every weight, with 0
    return scores


def global_rows(accelerator, values: torch.Tensor) -> torch.Tensor:
    """`values` (one row per completion of this rank) of every data-parallel rank, one copy of each (a tensor-,
    context- or sequence-parallel group's ranks hold the same completions); every rank calls it."""
    gathered = accelerator.gather(values.to(accelerator.device).contiguous())
    gathered = gathered.view(accelerator.num_processes, -1, *values.shape[1:])
    return gathered[:: mesh.batch_sharers(accelerator)].flatten(0, 1).cpu()


def completion_figures(accelerator, rollout) -> tuple[dict, int]:
    """TRL's completions/* figures of a rollout over the global batch (mean, min and max length, of the completions
    that ended with a stop token too (0 where none did), the share cut by --max_completion_length), each a value
    every rank records alike; and the global batch's input tokens (prompts and completions: TRL's num_tokens counts
    them). Every rank calls it (one gather)."""
    local = torch.tensor(
        [[len(r["completion_ids"]), float(r["truncated"]), len(r["prompt_ids"])] for r in rollout.rows],
        dtype=torch.float64,
    ).reshape(-1, 3)
    every = global_rows(accelerator, local)
    lengths, cut = every[:, 0], every[:, 1].bool()
    ended = lengths[~cut] if (~cut).any() else torch.zeros(1, dtype=lengths.dtype)
    figures = {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": cut.double().mean(),
        "completions/mean_terminated_length": ended.mean(),
        "completions/min_terminated_length": ended.min(),
        "completions/max_terminated_length": ended.max(),
    }
    return {name: value.float().reshape(1) for name, value in figures.items()}, int(every[:, [0, 2]].sum())


def batch_std(accelerator, rewards: torch.Tensor) -> torch.Tensor:
    """The std (unbiased, of the scored) of the global batch's rewards: every data-parallel rank's (all ranks call
    it). --scale_rewards batch divides by it, and it is TRL's reward_std (TRL >= 0.27; before, the mean of the groups'
    stds)."""
    return nanstd(global_rows(accelerator, rewards))


def count_global(accelerator, rollout, accumulation: int, mask_truncated: bool) -> "Normaliser":
    """The Normaliser of a step over `rollout`: its completions and loss tokens summed over every rank (each once: the
    ranks of an sp/cp group, which each score a slice of the same rows, count them once between them)."""
    tokens = sum(len(row["completion_ids"]) for row in rollout.rows if not (mask_truncated and row["truncated"]))
    counts = torch.tensor([float(len(rollout.rows)), float(tokens)], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(counts)
    completions, tokens = (counts / mesh.sequence_shards(accelerator)).tolist()  # a split row's ranks hold it whole
    return Normaliser(completions, max(tokens, 1.0), accelerator.num_processes * accumulation)


@torch.no_grad()
def rollout_log_probs(model, rollout, batch_size: int, pad_id: int, accelerator, temperature: float = 1.0):
    """Each completion's token log-probabilities under `model` (the policy that sampled the rollout) at the sampling
    temperature, micro-batch by micro-batch as training reads them (every rank calls it: a sharded model's forwards
    are collective); a list of lists of floats."""
    values = []
    for batch in rollout.micro_batches(batch_size, pad_id, False, accelerator.device):
        with sequence_parallel.split_rows(accelerator, batch) as part, accelerator.autocast():
            log_probs = token_log_probs(model, part, temperature).float()
        log_probs = sequence_parallel.whole_row_values(accelerator, log_probs, part, batch["mask"].shape[1]).cpu()
        lengths = batch["mask"].sum(1).tolist()
        starts = batch["mask"].int().argmax(1).tolist()
        values += [row[start : start + length].tolist() for row, start, length in zip(log_probs, starts, lengths)]
    return values


@dataclass
class Normaliser:
    """What the global batch of one optimizer step holds: completions and completion tokens summed over every rank
    and micro-batch, and `shares`, the processes x accumulation steps a micro-batch's loss is averaged over (a
    tensor-parallel group's ranks each count the group's batch, and each is a share: the two cancel)."""

    completions: float
    tokens: float
    shares: int  # processes x accumulation steps: what accelerate and the strategy divide by

    def divisor(
        self, loss_type: str, lengths: torch.Tensor, max_completion_length: int, shards: int = 1
    ) -> torch.Tensor | float:
        """What a micro-batch's summed loss is divided by; `lengths`: its completions' loss tokens (bnpo's count),
        `shards`: the ranks that each hold a slice of its rows (bnpo: their gradients are averaged, as a whole row's
        would be summed, so each takes its share of the micro-batch's tokens)."""
        if loss_type == "dapo":
            return self.tokens / self.shares
        if loss_type == "dr_grpo":
            return self.completions * max_completion_length / self.shares
        if loss_type == "grpo":
            return self.completions / self.shares
        if loss_type == "bnpo":
            return lengths.sum().clamp(min=1) / shards
        raise ValueError(f"loss_type {loss_type!r}: one of {LOSS_TYPES}")


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    ref_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normaliser: Normaliser,
    loss_type: str,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    max_completion_length: int,
    entropy: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    rows: sequence_parallel.RowSums | None = None,
    bias_correction_kl: bool = True,
) -> tuple[torch.Tensor, dict]:
    """A micro-batch's share of the loss (see the module's text) and its figures for the train line, as TRL takes
    them (`MetricsLogger.record_per_call`): clip_ratio/low_mean, high_mean and region_mean over every rank's tokens
    (over the completions at the sequence level), clip_ratio/low_min and high_max over the completions' own token
    means, and with beta, kl. `log_probs`, `old_log_probs` and `ref_log_probs` are (rows, tokens), `advantages`
    (rows,), `mask` (rows, tokens) in {0, 1}; `entropy` (rows, tokens): each token's, for TRL's `entropy`. `rows`
    sums over whole rows (a slice's of split rows: common.parallel.sequence_parallel.RowSums). `bias_correction_kl`:
    the KL term times the importance ratio (before `delta`'s clip), as TRL's use_bias_correction_kl (its default)."""
    rows = rows or sequence_parallel.RowSums()
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    mask = mask.to(log_probs.dtype)
    lengths = rows(mask)
    log_ratio = log_probs - old
    if importance_sampling_level == "sequence":  # GSPO: one ratio per completion, (rows, 1)
        log_ratio = (rows(log_ratio * mask) / lengths.clamp(min=1)).unsqueeze(1)
    elif importance_sampling_level != "token":
        raise ValueError(f"importance_sampling_level {importance_sampling_level!r}: one of {IMPORTANCE_LEVELS}")
    ratio = torch.exp(log_ratio)
    importance = ratio  # the KL's correction: the ratio before the two-sided clip, as TRL's
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    if delta is not None:  # two-sided clipping
        ratio = ratio.clamp(max=delta)
    advantage = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    values = {}
    if beta:
        gap = ref_log_probs - log_probs
        kl = torch.exp(gap) - gap - 1
        if bias_correction_kl:  # the unbiased reverse-KL gradient: differentiable through the ratio, 1 on-policy
            kl = kl * importance
        per_token = per_token + beta * kl
    if loss_type == "grpo":  # each completion's token mean
        summed = ((per_token * mask).sum(1) / lengths.clamp(min=1)).sum()
    else:
        summed = (per_token * mask).sum()
    loss = summed / normaliser.divisor(loss_type, lengths, max_completion_length, rows.shards)
    values.update(clip_figures(ratio, advantage, mask, epsilon, epsilon_high, rows))
    tokens = mask.sum()
    if beta:
        values["kl"] = ("pooled", (kl.detach() * mask).sum(), tokens)
    if entropy is not None:
        values["entropy"] = ("pooled", (entropy * mask).sum(), tokens)
    return loss, values


def clip_figures(ratio, advantage, mask, epsilon: float, epsilon_high: float, rows=None) -> dict:
    """TRL's clip_ratio/* of a micro-batch: with a ratio per token (rows, tokens), means over the tokens, and low_min
    and high_max over the completions' own token means (`rows`: policy_loss's); with one per completion (rows, 1),
    over the completions."""
    rows = rows or sequence_parallel.RowSums()
    low = ((ratio < 1 - epsilon) & (advantage < 0)).to(mask.dtype)
    high = ((ratio > 1 + epsilon_high) & (advantage > 0)).to(mask.dtype)
    if ratio.shape[1] == 1:
        rows = float(ratio.shape[0])
        low, high = low.squeeze(1), high.squeeze(1)
        return {
            "clip_ratio/low_mean": ("pooled", low.sum(), rows),
            "clip_ratio/high_mean": ("pooled", high.sum(), rows),
            "clip_ratio/region_mean": ("pooled", (low + high).clamp(max=1).sum(), rows),
            "clip_ratio/low_min": ("min", _nan_extreme(low, "min"), 1),
            "clip_ratio/high_max": ("max", _nan_extreme(high, "max"), 1),
        }
    low, high, tokens = low * mask, high * mask, mask.sum()
    lengths = rows(mask)  # a completion with no loss token (masked as truncated) has no mean: NaN, left out
    return {
        "clip_ratio/low_mean": ("pooled", low.sum(), tokens),
        "clip_ratio/high_mean": ("pooled", high.sum(), tokens),
        "clip_ratio/region_mean": ("pooled", (low + high).clamp(max=1).sum(), tokens),
        "clip_ratio/low_min": ("min", _nan_extreme(rows(low) / lengths, "min"), 1),
        "clip_ratio/high_max": ("max", _nan_extreme(rows(high) / lengths, "max"), 1),
    }


def rloo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    ref_log_probs: None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normaliser: Normaliser,
    epsilon: float,
    epsilon_high: float,
    entropy: torch.Tensor | None = None,
    rows: sequence_parallel.RowSums | None = None,
) -> tuple[torch.Tensor, dict]:
    """RLOO's share of the loss for a micro-batch (see the module's text), as TRL's RLOOTrainer: the clipped ratio of
    whole completions' probabilities, one loss per completion, averaged over the global batch's completions (a
    completion with no loss token, masked as truncated, keeps its constant term: ratio 1, no gradient); its figures
    as `policy_loss`'s at the sequence level. Called as `policy_loss` is; `ref_log_probs` None: RLOO's KL term is in
    the reward (`rollout_kl`). On split rows (`rows`) each rank of a group takes its share of every completion's
    term."""
    assert ref_log_probs is None, "RLOO's KL is in the reward (rollout_kl), not in the loss"
    rows = rows or sequence_parallel.RowSums()
    mask = mask.to(log_probs.dtype)
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    # the sum of the tokens' log-ratios: TRL's difference of the two sums, without the rounding of sums near -20
    ratio = torch.exp(rows((log_probs - old) * mask)).unsqueeze(1)
    advantage = advantages.unsqueeze(1)
    per_completion = -torch.min(ratio * advantage, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantage)
    loss = per_completion.sum() / normaliser.divisor("grpo", None, 0) / rows.shards
    values = clip_figures(ratio, advantage, mask, epsilon, epsilon_high)
    if entropy is not None:
        values["entropy"] = ("pooled", (entropy * mask).sum(), mask.sum())
    return loss, values


def _nan_extreme(values: torch.Tensor, how: str) -> torch.Tensor:
    """The smallest or largest value that is not NaN (NaN if none is)."""
    kept = values.detach()[~values.detach().isnan()]
    if not kept.numel():
        return torch.tensor(math.nan)
    return kept.min() if how == "min" else kept.max()
