"""Packed rows that cost what their examples cost: attention per example, not per row.

A packed batch is one row holding several examples, with position ids restarting at
0 for each (transformers' `DataCollatorWithFlattening`). With plain `sdpa`,
transformers builds a dense block-diagonal mask over the whole row, so attention
costs grow with the square of the row (the whole batch). `sdpa_varlen`, registered
here, is sdpa run per example: the row's examples are gathered into a padded
[examples, longest example] batch, attended causally (the padding sits after each
example's tokens, so no real token sees it), and read back in row order. Attention
then costs what the padded batch's does, while every other layer runs on the real
tokens only; examples never attend to each other. Anything else (padded batches,
generation) goes to transformers' sdpa unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from common.internals import attention_implementation

NAME = "sdpa_varlen"
_PACKED = torch.empty(0, dtype=torch.bool)  # stands for "packed row, no dense mask"; plain sdpa would refuse it


def _mask(*args, **kwargs):
    # transformers asks for a packed row's mask with no padding mask and the causal shortcut
    # switched off; everything else (padding, generation, plain causal) is sdpa's own mask.
    if kwargs.get("attention_mask") is None and not kwargs.get("allow_is_causal_skip", True):
        return _PACKED
    return sdpa_mask(*args, **kwargs)


def _example_index(position_ids: torch.Tensor):
    """[examples, longest] indices into the row (padding repeats an example's first token) and
    the mask of real positions, from position ids that restart at 0 for each example."""
    positions = position_ids[0]
    starts = torch.nonzero(positions == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed rows must start each example at position 0")
    ends = torch.cat([starts[1:], starts.new_tensor([positions.numel()])])
    lengths = ends - starts
    offsets = torch.arange(int(lengths.max()), device=positions.device)
    real = offsets[None, :] < lengths[:, None]
    index = torch.where(real, starts[:, None] + offsets[None, :], starts[:, None])
    return index, real


def _sliding_window_mask(length: int, window: int, device) -> torch.Tensor:
    """Causal attention over the last `window` positions, as transformers' sliding-window mask:
    query i sees keys j with i - window < j <= i."""
    positions = torch.arange(length, device=device)
    offset = positions[:, None] - positions[None, :]
    return (offset >= 0) & (offset < window)


def sdpa_varlen_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if attention_mask is not _PACKED:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[0] != 1:
        raise ValueError(f"{NAME} needs one packed row and its position_ids; this model does not pass them to "
                         "its attention, so use attn_implementation='sdpa'")
    index, real = _example_index(position_ids)
    # [1, heads, tokens, dim] -> [examples, heads, longest, dim]
    q, k, v = (t[0][:, index].transpose(0, 1) for t in (query, key, value))
    window = kwargs.get("sliding_window")  # Mistral, Qwen2 and friends pass their layer's window
    mask = None if not window else _sliding_window_mask(q.shape[2], window, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0,
                                         is_causal=mask is None, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    # real positions, row-major, are the row's tokens in order: [1, tokens, heads, dim]
    return out.transpose(0, 1)[:, real].transpose(0, 1).unsqueeze(0), None


AttentionInterface.register(NAME, sdpa_varlen_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)


def use_per_example_attention(model) -> str:
    """Switch a model on sdpa to `sdpa_varlen` for packed training; returns the attention it uses."""
    current = attention_implementation(model)
    if current != "sdpa":
        return current
    model.set_attn_implementation(NAME)
    return NAME
