"""GRPO's loss and its gradient, TRL's against the recipe's, on the same per-token log-probabilities: TRL 1.16's own
`GRPOTrainer._compute_loss` (run on an object holding just the attributes it reads, its log-probabilities handed in
where its model would compute them) against common.objectives.grpo.policy_loss, over --beta with and without
`use_bias_correction_kl`, token- and sequence-level ratios, off-policy old log-probabilities, `delta`, and the grpo
and bnpo averages. Prints one JSON line per case: the largest gap in the loss and in its gradient with respect to the
log-probabilities, relative to the largest gradient. trl is installed by `make benchmark-peers`:

    .venv/bin/python benchmarks/peers/trl_loss_check.py
"""

import collections
import itertools
import json
import os
import sys
from types import SimpleNamespace

import torch
from trl import GRPOTrainer


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common.objectives.grpo import Normaliser, policy_loss  # noqa: E402


def trl_loss(log_probs, old, ref, advantages, mask, case: dict) -> torch.Tensor:
    """TRL's _compute_loss on a stand-in for the trainer: only what that function reads, for one process, one
    accumulation step, in training, without vLLM, entropy masks or bonuses, or an auxiliary loss."""
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (log_probs, torch.zeros_like(log_probs), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=case["level"],
        beta=case["beta"],
        args=SimpleNamespace(use_bias_correction_kl=case["bias_correction_kl"], delta=case["delta"]),
        loss_type=case["loss_type"],
        epsilon_low=0.2,
        epsilon_high=0.28,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        accelerator=SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x),
    )
    rows, length = log_probs.shape
    inputs = {
        "prompt_ids": torch.zeros(rows, 3, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
        "completion_ids": torch.zeros(rows, length, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
    }
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def main():
    generator = torch.Generator().manual_seed(0)
    rows, length = 6, 9
    current = -torch.rand(rows, length, generator=generator, dtype=torch.float64) * 3
    old = current + 0.3 * torch.randn(rows, length, generator=generator, dtype=torch.float64)  # off-policy
    ref = current + 0.5 * torch.randn(rows, length, generator=generator, dtype=torch.float64)
    advantages = torch.randn(rows, generator=generator, dtype=torch.float64)
    mask = torch.ones(rows, length, dtype=torch.float64)
    for row, end in enumerate((9, 4, 7, 1, 9, 6)):  # completions of different lengths
        mask[row, end:] = 0
    cases = itertools.product((0.0, 0.04), (True, False), ("token", "sequence"), (None, 1.5), ("grpo", "bnpo"))
    for beta, correction, level, delta, loss_type in cases:
        case = dict(beta=beta, bias_correction_kl=correction, level=level, delta=delta, loss_type=loss_type)
        grads, losses = [], []
        for side in ("trl", "recipe"):
            log_probs = current.clone().requires_grad_()
            if side == "trl":
                loss = trl_loss(log_probs, old, ref, advantages, mask, case)
            else:
                loss, _ = policy_loss(
                    log_probs, old, ref, advantages, mask, Normaliser(rows, float(mask.sum()), 1), loss_type, 0.2,
                    0.28, beta, length, importance_sampling_level=level, delta=delta, bias_correction_kl=correction,
                )  # fmt: skip
            loss.backward()
            grads.append(log_probs.grad)
            losses.append(loss.item())
        scale = float(grads[0].abs().max())
        print(
            json.dumps(
                {
                    **case,
                    "loss_gap": abs(losses[0] - losses[1]),
                    "grad_gap": float((grads[0] - grads[1]).abs().max()) / max(scale, 1e-30),
                    "grad_scale": scale,
                }
            )
        )


if __name__ == "__main__":
    main()
