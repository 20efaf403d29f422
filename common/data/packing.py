"""Packed rows that cost what their examples cost: attention per example, not per row.

A packed batch is one row holding several examples, with position ids restarting at
0 for each (transformers' `DataCollatorWithFlattening`). With plain `sdpa`,
transformers builds a dense block-diagonal mask over the whole row, so attention
costs grow with the square of the row (the whole batch). `sdpa_varlen`, registered
here (`register`), is sdpa run per example: the row's examples are gathered into padded
[examples, longest example] batches, attended causally (the padding sits after each
example's tokens, so no real token sees it), and read back in row order. Examples of
similar length share a batch (sorted by length, a new batch where an example is shorter
than 0.8 of its batch's longest), so attention costs about what the examples' own
attention costs, not the padded batch's, when lengths vary; every other layer runs on
the real tokens only, and examples never attend to each other. Anything else (padded
batches, generation) goes to transformers' sdpa unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from common.launch.internals import attention_implementation


NAME = "sdpa_varlen"
_PACKED = torch.empty(0, dtype=torch.bool)  # stands for "packed row, no dense mask"; plain sdpa would refuse it


def _mask(*args, **kwargs):
    # transformers asks for a packed row's mask with no padding mask and the causal shortcut
    # switched off; everything else (padding, generation, plain causal) is sdpa's own mask.
    if kwargs.get("attention_mask") is None and not kwargs.get("allow_is_causal_skip", True):
        return _PACKED
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


SIMILAR = 0.8  # an example joins a length group while it is at least this fraction of the group's longest
# The last row's groups: every attention layer of a forward (and its recomputation under activation
# checkpointing) gets the same position_ids tensor, so the groups, and the host read of the example
# lengths they need, are worked out once per row, not once per layer. Holding the tensor keeps its
# identity from being reused by another.
_last_row: list = [None, None]


def _example_groups(position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Examples of similar length grouped: per group, [examples, its longest] indices into the row
    (padding repeats an example's first token) and the mask of real positions, from position ids
    that restart at 0 for each example."""
    if _last_row[0] is not position_ids:
        _last_row[:] = [position_ids, _groups(position_ids)]
    return _last_row[1]


def _groups(position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    positions = position_ids[0]
    starts = torch.nonzero(positions == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed rows must start each example at position 0")
    ends = torch.cat([starts[1:], starts.new_tensor([positions.numel()])])
    lengths = (ends - starts).tolist()
    by_length = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, current = [], [by_length[0]]
    for example in by_length[1:]:
        if lengths[example] >= SIMILAR * lengths[current[0]]:
            current.append(example)
        else:
            groups.append(current)
            current = [example]
    groups.append(current)
    result = []
    for group in groups:
        chosen = torch.tensor(group, device=positions.device)
        length = starts.new_tensor([lengths[i] for i in group])
        offsets = torch.arange(lengths[group[0]], device=positions.device)
        real = offsets[None, :] < length[:, None]
        result.append((torch.where(real, starts[chosen][:, None] + offsets[None, :], starts[chosen][:, None]), real))
    return result


def _sliding_window_mask(length: int, window: int, device) -> torch.Tensor:
    """Causal attention over the last `window` positions, as transformers' sliding-window mask:
    query i sees keys j with i - window < j <= i."""
    positions = torch.arange(length, device=device)
    offset = positions[:, None] - positions[None, :]
    return (offset >= 0) & (offset < window)


def sdpa_varlen_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if attention_mask is not _PACKED:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[0] != 1:
        raise ValueError(
            f"{NAME} needs one packed row and its position_ids; this model does not pass them to "
            "its attention, so use attn_implementation='sdpa'"
        )
    window = kwargs.get("sliding_window")  # Mistral, Qwen2 and friends pass their layer's window
    pieces, order = [], []
    for index, real in _example_groups(position_ids):
        # [1, heads, tokens, dim] -> [examples, heads, longest, dim]
        q, k, v = (t[0][:, index].transpose(0, 1) for t in (query, key, value))
        mask = None if not window else _sliding_window_mask(q.shape[2], window, q.device)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout if module.training else 0.0,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        pieces.append(out.transpose(0, 1)[:, real])  # [heads, the group's tokens, dim]
        order.append(index[real])
    order = torch.cat(order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # back in the row's order: [1, tokens, heads, dim]
    return torch.cat(pieces, dim=1)[:, inverse].transpose(0, 1).unsqueeze(0), None


@functools.cache
def register() -> None:
    """Make sdpa_varlen transformers' to choose (its attention and its mask), once per process; done here, not at
    import, so that a recipe's --help does not wait for transformers' modeling code."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, sdpa_varlen_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)


def use_per_example_attention(model) -> str:
    """Switch a model on sdpa to `sdpa_varlen` for packed training; returns the attention it uses."""
    current = attention_implementation(model)
    if current != "sdpa":
        return current
    register()
    model.set_attn_implementation(NAME)
    return NAME


class PackOrPad:
    """The SFT collator with --packing: a batch becomes one packed row when padding it would waste
    more than `waste` of the padded batch's tokens, and stays a padded batch otherwise. Packing
    saves the padding's compute but pays for gathering each example's attention (about a quarter
    of the speed on a CPU when no padding is saved), so on data of nearly equal lengths the padded
    layout, the faster one there, is kept. Both give the same loss and gradients."""

    def __init__(self, padded, waste: float = 0.2):
        from transformers import DataCollatorWithFlattening

        self.padded, self.packed, self.waste = padded, DataCollatorWithFlattening(), waste

    def __str__(self) -> str:
        return f"packed (padded where padding would waste at most {self.waste:.0%})"

    def __call__(self, features: list[dict]) -> dict:
        lengths = [len(feature["input_ids"]) for feature in features]
        if 1 - sum(lengths) / (len(lengths) * max(lengths)) > self.waste:
            return self.packed(features)
        return self.padded(features)
