"""The GRPO objective: group advantages, per-token log-probabilities, the clipped policy loss behind --loss_type.

For a prompt's G completions with rewards r_1..r_G, the advantage of completion i is
    A_i = r_i - mean(r)                                   --scale_rewards none (Dr. GRPO)
    A_i = (r_i - mean(r)) / (std(r) + 1e-4)               --scale_rewards group (GRPO, TRL's default)
    A_i = (r_i - mean(r)) / (std of the batch's r + 1e-4) --scale_rewards batch (over every rank's completions)
(std unbiased, as torch.std and TRL). Each completion token t then has, with the ratio
rho = exp(logp - logp_old) to the policy that sampled it,
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo")
SCALINGS = ("group", "batch", "none")
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


def group_advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: torch.Tensor | None = None):
    """(advantages, each group's std, the std the advantages were divided by, per group: TRL's reward_std) for
    `rewards` of consecutive groups of `group` completions (one prompt each). `batch_std`: the std over the whole
    global batch (every rank's rewards), for --scale_rewards batch; `none` divides by nothing (its figure: the
    group's std)."""
    grouped = rewards.view(-1, group)
    std = grouped.std(dim=1)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    if scale == "group":
        return centred / (std.repeat_interleave(group) + STD_EPSILON), std, std
    if scale == "batch":
        return centred / (batch_std + STD_EPSILON), std, batch_std.expand(std.shape)
    if scale == "none":
        return centred, std, std
    raise ValueError(f"scale_rewards {scale!r}: one of {SCALINGS}")


def token_log_probs(model, batch: dict) -> torch.Tensor:
    """(rows, length - 1) log-probability of each next token under `model`, in fp32, row by row (an fp32 copy of
    one row's logits at a time); 0 where `labels` is -100 (prompt and padding)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    rows = [
        -F.cross_entropy(row[:-1].float(), row_labels, ignore_index=-100, reduction="none")
        for row, row_labels in zip(logits, labels)
    ]
    return torch.stack(rows)


def batch_std(accelerator, rewards: torch.Tensor) -> torch.Tensor:
    """The std (unbiased) of the global batch's rewards: every data-parallel rank's (all ranks call it)."""
    from common.launch import mesh

    gathered = accelerator.gather(rewards.to(accelerator.device)).view(accelerator.num_processes, -1)
    return gathered[:: mesh.replicas(accelerator)].flatten().std().cpu()


def count_global(accelerator, rollout, accumulation: int, mask_truncated: bool) -> "Normaliser":
    """The Normaliser of a step over `rollout`: its completions and loss tokens summed over every rank."""
    tokens = sum(len(row["completion_ids"]) for row in rollout.rows if not (mask_truncated and row["truncated"]))
    counts = torch.tensor([float(len(rollout.rows)), float(tokens)], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(counts)
    completions, tokens = counts.tolist()
    return Normaliser(completions, max(tokens, 1.0), accelerator.num_processes * accumulation)


@torch.no_grad()
def rollout_log_probs(model, rollout, batch_size: int, pad_id: int, accelerator) -> list[list[float]]:
    """Each completion's token log-probabilities under `model` (the policy that sampled the rollout), micro-batch
    by micro-batch as training reads them (every rank calls it: a sharded model's forwards are collective)."""
    values = []
    for batch in rollout.micro_batches(batch_size, pad_id, False, accelerator.device):
        with accelerator.autocast():
            log_probs = token_log_probs(model, batch).float().cpu()
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

    def divisor(self, loss_type: str, mask: torch.Tensor, max_completion_length: int) -> torch.Tensor | float:
        if loss_type == "dapo":
            return self.tokens / self.shares
        if loss_type == "dr_grpo":
            return self.completions * max_completion_length / self.shares
        if loss_type == "grpo":
            return self.completions / self.shares
        if loss_type == "bnpo":
            return mask.sum().clamp(min=1)
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
) -> tuple[torch.Tensor, dict]:
    """A micro-batch's share of the loss (see the module's text) and its per-token figures for the train line:
    TRL's clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean and, with beta, kl. `log_probs`,
    `old_log_probs` and `ref_log_probs` are (rows, tokens), `advantages` (rows,), `mask` (rows, tokens) in {0, 1}."""
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    ratio = torch.exp(log_probs - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    advantage = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    values = {}
    if beta:
        gap = ref_log_probs - log_probs
        kl = torch.exp(gap) - gap - 1
        per_token = per_token + beta * kl
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":  # each completion's token mean
        summed = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum()
    else:
        summed = (per_token * mask).sum()
    loss = summed / normaliser.divisor(loss_type, mask, max_completion_length)
    kept = mask.bool()
    low = (ratio < 1 - epsilon) & (advantage < 0)
    high = (ratio > 1 + epsilon_high) & (advantage > 0)
    values["clip_ratio/low_mean"] = low[kept].float()
    values["clip_ratio/high_mean"] = high[kept].float()
    values["clip_ratio/region_mean"] = (low | high)[kept].float()
    if beta:
        values["kl"] = kl.detach()[kept]
    return loss, values
