"""Model FLOPs per batch, and the device's peak, for achieved TFLOP/s and MFU.

Training FLOPs of a token, as PaLM and torchtitan count them (`6N + 12 L H Q T`), from
the model itself rather than from a formula per architecture:

* matrix multiplies: every Linear (and GPT-2's Conv1D) weight, lm_head included, the input
  embedding (a lookup) not; a mixture-of-experts model's stacked expert weights by the share a token
  reaches (experts per token / experts). Forward 2 FLOPs per weight, the backward's input gradient 2,
  its weight gradient 2 for trainable weights only: 6N for full training, 4N + 2N_trainable
  for LoRA, whose frozen base weights get no gradient. (Autograd also skips the input
  gradients below the first trainable weight, so for LoRA this is a slight overcount:
  layer 0's q/k/v inputs, about 1/layers of the attention projections.)
* attention scores and their weighted sum: 12 x layers x heads x head_dim x T per token
  (forward 4, backward 8), T the length of the row the token is in, as PaLM counts it
  (a causal kernel that skips the masked half does less work than this).

Tokens are the real ones (attention_mask), so padding lowers MFU instead of inflating it.
MFU needs the device's dense peak for the compute dtype: `--peak_tflops`, or the table
below for a known GPU in bf16/fp16. On CPU (or an unknown device) MFU is left empty; the
achieved TFLOP/s are still logged.
"""

from __future__ import annotations

import torch

from common.launch.internals import full_numel
from common.training import experts


# Dense (no sparsity) bf16/fp16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets.
# Matched in order against torch.cuda.get_device_name(): more specific names first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A6000", 154.8),
)


def _matmul_weights(model):
    """(weight, the share of it a token multiplies): each Linear (and Conv1D) weight whole; a mixture-of-experts
    model's stacked expert weights (one tensor per projection) by its experts per token over its experts."""
    from transformers.pytorch_utils import Conv1D

    config = getattr(model, "config", None)
    routed = experts.num_experts(config) if config is not None else 0
    share = experts.experts_per_token(config) / routed if routed else 0.0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            yield module.weight, 1.0
        elif share and type(module).__name__.endswith("Experts"):
            yield from ((p, share) for p in module.parameters(recurse=False) if p.dim() == 3)


def matmul_weights_per_token(model) -> float:
    """The matmul weights one token multiplies (each once: tied weights count once): every Linear and Conv1D
    weight, a mixture-of-experts model's stacked experts by its experts per token over its experts."""
    weights = {id(w): (w, share) for w, share in _matmul_weights(model)}.values()
    return sum(full_numel(w) * share for w, share in weights)


class ModelFlops:
    """`per_batch(batch)`: training FLOPs of one micro-batch (`forward_only`: of a forward pass over it), as a
    tensor on the batch's device or a number (no synchronisation)."""

    def __init__(self, model, shards: int = 1):
        """`shards`: sp_size under sequence parallelism, where a batch holds each row's slice of 1/shards of
        its tokens, which attend to the whole row."""
        self.shards = shards
        weights = {id(w): (w, share) for w, share in _matmul_weights(model)}.values()  # tied weights count once
        total = sum(full_numel(w) * share for w, share in weights)
        trainable = sum(full_numel(w) * share for w, share in weights if w.requires_grad)
        self.dense_per_token = 4 * total + 2 * trainable
        self.forward_dense_per_token = 2 * total  # a forward pass alone (a frozen copy: DPO's reference model)
        config = getattr(model, "config", None)
        layers = getattr(config, "num_hidden_layers", 0) or 0
        heads = getattr(config, "num_attention_heads", 0) or 0
        head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // max(heads, 1))
        self.attention_per_token_and_position = 12 * layers * heads * head_dim

    def per_token(self, sequence_length: int, forward_only: bool = False) -> int:
        if forward_only:  # the attention's share of a training step is its forward and twice that backward
            return self.forward_dense_per_token + self.attention_per_token_and_position // 3 * sequence_length
        return self.dense_per_token + self.attention_per_token_and_position * sequence_length

    def per_batch(self, batch: dict, forward_only: bool = False) -> torch.Tensor | float:
        input_ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        if mask is None:  # a number, not a new device tensor: copying one to a GPU waits for its stream
            return float(input_ids.numel() * self.per_token(input_ids.shape[-1] * self.shards, forward_only))
        return mask.sum().double() * self.per_token(input_ids.shape[-1], forward_only)


def device_peak_tflops(device, compute_dtype: str | None, override: float | None) -> float | None:
    """The dense peak MFU is measured against, or None where it is not known."""
    if override:
        return override
    if getattr(device, "type", "") != "cuda" or compute_dtype not in ("bfloat16", "float16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)
