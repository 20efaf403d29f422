"""The DPO objective: completions' log-probabilities, the losses behind --loss_type, TRL's reward metrics, evaluation.

For a pair with policy log-probabilities (summed over the completion's tokens) pi_c, pi_r and the
reference's ref_c, ref_r, and z = (pi_c - ref_c) - (pi_r - ref_r):
    sigmoid  -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)   (DPO; eps: --label_smoothing)
    ipo      (z - 1 / (2 beta))^2, on log-probabilities averaged over the completion's tokens (IPO, as TRL)
    hinge    max(0, 1 - beta z)                                           (SLiC)
With --rpo_alpha a, each loss adds a (-pi_c / n_c): the chosen answer's negative log-likelihood per token,
per pair (RPO, Pang et al. 2024; TRL's loss_type [sigmoid, sft] averages it over the batch's tokens
instead), which keeps the chosen answer likely while the margin grows.
The rewards are beta (pi - ref) per side (TRL's rewards/chosen, rewards/rejected), their difference
rewards/margins, and rewards/accuracies the share of pairs whose chosen reward is the higher.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.launch import mesh


LOSS_TYPES = ("sigmoid", "ipo", "hinge")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def completion_log_probs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability of each row's label tokens, summed in fp32, split into the batch's
    chosen and rejected halves (`common.data.preference.PairBatches`)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    # row by row: an fp32 copy of one row's logits at a time, not of the batch's (2B x T x vocabulary)
    sums = [
        -F.cross_entropy(row[:-1].float(), row_labels, ignore_index=-100, reduction="sum")
        for row, row_labels in zip(logits, labels)
    ]
    return torch.stack(sums).chunk(2)


def completion_lengths(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Each side's number of label tokens (after the shift), as the log-probabilities are split."""
    return (batch["labels"][:, 1:] != -100).sum(1).clamp(min=1).chunk(2)


def preference_loss(
    policy: tuple,
    reference: tuple,
    lengths: tuple,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
    rpo_alpha: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """Per-pair losses and the reward metrics (per pair, detached) from (chosen, rejected)
    log-probabilities summed over each completion's `lengths` tokens."""
    chosen_nll = -policy[0] / lengths[0]
    if loss_type == "ipo":  # per token
        policy = tuple(p / n for p, n in zip(policy, lengths))
        reference = tuple(r / n for r, n in zip(reference, lengths))
    chosen_ratio, rejected_ratio = policy[0] - reference[0], policy[1] - reference[1]
    z = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    elif loss_type == "ipo":
        losses = (z - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * z)
    else:
        raise ValueError(f"loss_type {loss_type!r}: one of {LOSS_TYPES}")
    if rpo_alpha:
        losses = losses + rpo_alpha * chosen_nll
    chosen, rejected = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    rewards = dict(zip(REWARDS, (chosen, rejected, (chosen > rejected).float(), chosen - rejected)))
    return losses, rewards


@torch.no_grad()
def evaluate_preferences(
    model,
    reference,
    dataloader,
    accelerator,
    beta: float,
    loss_type: str,
    label_smoothing: float,
    rpo_alpha: float = 0.0,
) -> dict:
    """eval_loss, eval_rewards/* and eval_prefers_chosen (the share of pairs whose chosen answer the
    policy itself finds likelier: the preference accuracy that means something before training too,
    where every reward is 0) over every held-out pair, each counted once (gather_for_metrics)."""
    model.eval()
    sums, count = torch.zeros(len(REWARDS) + 2, dtype=torch.float64), 0
    for batch in dataloader:
        policy = completion_log_probs(model, batch)
        losses, rewards = preference_loss(
            policy,
            reference.log_probs(batch, "validation"),
            completion_lengths(batch),
            beta,
            loss_type,
            label_smoothing,
            rpo_alpha,
        )
        prefers = (policy[0] > policy[1]).float()
        values = mesh.gather_for_metrics(
            accelerator, torch.stack([losses.detach(), prefers, *rewards.values()], dim=1)
        )
        sums += values.double().sum(0).cpu()
        count += values.shape[0]
    model.train()
    means = (sums / max(count, 1)).tolist()
    return {
        "eval_loss": means[0],
        "eval_prefers_chosen": means[1],
        **{f"eval_{name}": value for name, value in zip(REWARDS, means[2:])},
        "eval_pairs": count,
    }
