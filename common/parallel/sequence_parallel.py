"""Rows split across ranks: DeepSpeed's Ulysses (zero3_ulysses.yaml) and torch's ring attention (fsdp_cp.yaml).

Under `parallelism_config_sp_size` N, accelerate hands the train loader to DeepSpeed's
UlyssesSPDataLoaderAdapter: the N ranks of a group take one rank's batch at a time, each the
N-th of every row's tokens (with `shift_labels`, the next-token targets of its slice, in place
of `labels`), and the attention layers exchange heads for sequence so every token still
attends to all the tokens before it. One optimizer step of N ranks therefore trains on what
one process trains with the same batch and accumulation: the data-parallel size is
processes / N (`common.launch.mesh.data_parallel_size`). What the recipes add here:

* rows the adapter can split (`SplittableRows`, the train collator's wrapper): lengths padded
  to a multiple of N, `position_ids`, padding only at the end (the attention is causal, so a
  real token never sees the padding after it) and no attention_mask (the adapter would cut
  it into slices the attention does not read);
* the loss's targets (`targets`): a slice's `shift_labels`, handed to the model as `labels`
  too, so `model(**batch).loss` is its summed token loss over `num_items_in_batch`;
* the loader's position (`batches`): a resumed run skips whole batches of the wrapped loader
  and then the adapter's slices of the one it stopped in;
* evaluation on whole rows (`whole_rows`): DeepSpeed turns the exchange off in eval mode, so
  the held-out loader is read without the adapter, one row per rank as under ZeRO-3.

Under `parallelism_config_cp_size` N (context parallelism, over FSDP2) the N ranks of a group are
handed the same batch; inside `context_parallel`, which a recipe's loop opens around each
micro-batch's forward and backward, torch splits every row into 2N chunks (rank r keeps chunks r
and 2N-1-r, so causal attention's work is even) and the attention passes keys and values round
the ring. The rows are prepared as for Ulysses (lengths a multiple of 2N, position_ids, padding at
the end, no attention_mask), with the next-token targets shifted on the whole row beforehand
(`shift_labels`): each rank's loss is the sum over its chunks' targets.
"""

from __future__ import annotations

import contextlib
import os

import torch

from common.launch import mesh
from common.launch.errors import UsageError
from common.launch.mesh import context_shards, launched_mesh_size


ADAPTER = "UlyssesSPDataLoaderAdapter"


def launched_attention() -> str | None:
    """The attention a split run's model must use: parallelism_config_sp_attn_implementation as exported, or sdpa
    under context parallelism (torch's ring attention replaces scaled_dot_product_attention)."""
    if launched_mesh_size("cp") > 1:
        return "sdpa"
    return os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION") if launched_mesh_size("sp") > 1 else None


def check_arguments(arguments: tuple) -> None:
    """What a sequence- or context-parallel run cannot do, refused before anything is built. A recipe whose arguments
    say `scores_whole_rows` (what it scores) is refused: its loss is not a sum over next-token targets; unless they
    say `scores_split_rows` too (GRPO: it builds its rows and scores their slices itself, `split_rows`)."""
    for args in arguments:
        if getattr(args, "scores_whole_rows", None) and not getattr(args, "scores_split_rows", False):
            raise UsageError(whole_rows_problem(args.scores_whole_rows))
        for problem in recipe_problems(vars(args)):
            raise UsageError(problem)


def whole_rows_problem(scores: str) -> str:
    """The line refusing a recipe that scores `scores` (its arguments' `scores_whole_rows`)."""
    return (
        f"sequence and context parallelism (parallelism_config_sp_size, _cp_size) split each row's next-token "
        f"targets across ranks, while this recipe scores {scores}: use zero3.yaml or fsdp.yaml; causal_lm.py and "
        "sft.py run under them"
    )


def recipe_problems(values: dict) -> list[str]:
    """What a recipe's arguments (or its YAML, for `make check-config`) ask that sequence or context parallelism
    cannot run."""
    whys = {
        "packing": "packed rows need attention kept within each example, which the exchange does not keep",
        "streaming": "a stream is not a loader accelerate can split the rows of",
        "auto_find_batch_size": "its trial steps run on whole rows, before they are split; set "
        "--per_device_train_batch_size instead",
    }
    return [
        f"--{flag} under sequence/context parallelism: {why}; pass --{flag} false"
        for flag, why in whys.items()
        if str(values.get(flag, False)).lower() == "true"
    ]


def check_heads(model) -> None:
    """The attention heads (query and key/value) must divide by sp_size: each rank of a group takes its share of them."""
    size, config = launched_mesh_size("sp"), model.config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and heads % size:
        raise UsageError(
            f"parallelism_config_sp_size {size}: the model has {heads} attention heads, which do not "
            f"divide by it (each rank of a group attends with its share of the heads); use an sp_size "
            f"that divides {heads}"
        )


class SplittableRows:
    """The train collator under sp_size `size` (or 2 x cp_size): its batch with rows padded at the end to a multiple
    of `size` (labels -100), position_ids 0..length-1 per row, and the attention_mask checked to pad only at the end,
    then dropped. Left padding is refused in one line. `shifted`: shift_labels added, the targets of the whole rows."""

    def __init__(self, collate, size: int, shifted: bool = False):
        self.collate, self.size, self.shifted = collate, size, shifted

    def __call__(self, examples):
        batch = dict(self.collate(examples))
        mask = batch.pop("attention_mask", None)
        if mask is not None and (mask[:, 1:] > mask[:, :-1]).any():
            raise UsageError(
                "sequence parallelism needs padding at the end of each row (the tokenizer pads on the "
                "left): set tokenizer.padding_side = 'right' for training"
            )
        batch.pop("position_ids", None)
        batch = padded(batch, batch["input_ids"].shape[1] + -batch["input_ids"].shape[1] % self.size)
        if self.shifted:
            batch["shift_labels"] = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        return batch


def padded(batch: dict, length: int) -> dict:
    """`batch` (input_ids, labels) padded at the end to `length` tokens (labels -100), with position_ids 0..length-1."""
    extra = length - batch["input_ids"].shape[1]
    if extra:
        batch["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, extra), value=0)
        batch["labels"] = torch.nn.functional.pad(batch["labels"], (0, extra), value=-100)
    batch["position_ids"] = torch.arange(length).expand(batch["input_ids"].shape[0], -1).clone()
    return batch


def _as_long_as_the_group(loader, group):
    """`loader`'s batches padded to the longest of the group's current ones: gloo's all_gather, which the adapter
    gathers the group's batches with, takes equal shapes only (NCCL's takes unequal ones)."""
    for batch in loader:
        length = torch.tensor([batch["input_ids"].shape[1]])
        torch.distributed.all_reduce(length, op=torch.distributed.ReduceOp.MAX, group=group)
        yield padded(dict(batch), int(length))


def splittable(collate):
    """`collate` wrapped for the launched sp_size or cp_size (unchanged without either)."""
    if launched_mesh_size("cp") > 1:
        return SplittableRows(collate, 2 * launched_mesh_size("cp"), shifted=True)
    size = launched_mesh_size("sp")
    return SplittableRows(collate, size) if size > 1 else collate


def context_parallel(accelerator, batch: dict, keys=("input_ids", "position_ids", "shift_labels")):
    """The context a recipe's loop runs each micro-batch's forward and backward in: under context parallelism,
    accelerate's, which splits the batch's rows in place (`keys`: input_ids, position_ids, the shifted targets) and
    turns the attention into ring attention; a context that does nothing otherwise."""
    if context_shards(accelerator) == 1:
        return contextlib.nullcontext()
    rows = [batch[key] for key in keys]
    return accelerator.maybe_context_parallel(
        buffers=rows, buffer_seq_dims=[1] * len(rows), no_restore_buffers=set(rows)
    )


def is_split(loader) -> bool:
    return type(loader).__name__ == ADAPTER


def whole_rows(loader):
    """The prepared loader under the adapter (the loader itself when there is none)."""
    return loader.dl if is_split(loader) else loader


def batches(accelerator, adapter, skip: int):
    """A fresh adapter over the loader `adapter` wraps (the one accelerate's prepare made), after its first `skip`
    micro-batches (each a slice of one rank's batch): whole batches skipped in the wrapped loader, then the
    slices of the one the run stopped in read and passed over, on every rank of the group alike."""
    whole, part = divmod(skip, adapter.sp_world_size)
    source = accelerator.skip_first_batches(adapter.dl, whole) if whole else adapter.dl
    if torch.distributed.get_backend(adapter.sp_group) == "gloo":
        source = _as_long_as_the_group(source, adapter.sp_group)
    fresh = type(adapter)(
        source,
        sp_rank=adapter.sp_rank,
        sp_group=adapter.sp_group,
        sp_world_size=adapter.sp_world_size,
        device=adapter.device,
    )
    for _ in range(part):
        next(fresh)
    return fresh


def targets(batch: dict) -> torch.Tensor:
    """The next-token targets a batch trains on: a slice's shift_labels, else labels after the shift."""
    return batch["shift_labels"] if "shift_labels" in batch else batch["labels"][:, 1:]


def as_model_input(batch: dict) -> dict:
    """A slice's batch for `model(**batch).loss`: transformers computes a loss only when given labels, and takes
    shift_labels as the targets without shifting them again."""
    if "shift_labels" not in batch:
        return batch
    shifted = batch["shift_labels"].contiguous()  # (the adapter's slice is a view transformers cannot .view)
    return {**batch, "labels": shifted, "shift_labels": shifted}


# ---- rows an objective builds and scores itself (GRPO's rollouts) ----------------------------------------------
# (rows, positions) each; the attention mask only for counting (common.outputs.metrics: the real tokens), never
# handed to the model (the split attention is causal: no mask)
SPLIT_KEYS = ("input_ids", "position_ids", "shift_labels", "attention_mask", "mask", "old_log_probs")


@contextlib.contextmanager
def split_rows(accelerator, batch: dict):
    """The micro-batch of rows an objective builds and scores itself (GRPO's: right-padded prompt + completion rows,
    `labels` on the completion, `mask` and `old_log_probs` per next-token target, `advantages` per row), as this
    rank scores it: the batch itself on whole rows. Under sp_size or cp_size N the group's ranks hold the same rows
    (mesh.batch_sharers; checked here) and each scores its share of every row's positions: the rows laid out per
    position (`per_position`), then cut into Ulysses' contiguous N-ths (rank r of the group keeps the r-th) or, for
    context parallelism, by torch inside accelerate's context (its load-balanced chunks), which the forward and
    backward must run inside. `labels` are then the slice's targets (what common.outputs.metrics counts);
    `whole_row_values` puts the slices' per-position values back together, `RowSums` sums over whole rows."""
    shards = mesh.sequence_shards(accelerator)
    if shards == 1:
        yield batch
        return
    mesh.check_shared_batch(accelerator, batch, shards)
    ring = mesh.context_shards(accelerator) > 1
    laid = per_position(batch, 2 * shards if ring else shards)
    if ring:
        with context_parallel(accelerator, laid, [key for key in SPLIT_KEYS if key in laid]):
            yield {**laid, "labels": laid["shift_labels"]}
        return
    rank, width = accelerator.process_index % shards, laid["input_ids"].shape[1] // shards
    for key in SPLIT_KEYS:
        if key in laid:
            laid[key] = laid[key][:, rank * width : (rank + 1) * width].contiguous()
    yield {**laid, "labels": laid["shift_labels"]}


def per_position(batch: dict, multiple: int) -> dict:
    """`batch` (right-padded rows) laid out per position, `multiple` dividing its length: `shift_labels` each
    position's next-token target (-100 off the completion and at the padding added at the end), `mask` and
    `old_log_probs` (given per next-token target) at the position that predicts it, `position_ids` 0..length-1, the
    attention mask padded with 0 (for counting only: causal attention never lets a real token see the padding after
    it); the other entries as they were. The rows padded and shifted as a data loader's are (`SplittableRows`)."""
    laid = SplittableRows(dict, multiple, shifted=True)(batch)  # input_ids, position_ids, shift_labels
    del laid["labels"]
    if laid["input_ids"] is batch["input_ids"]:  # (no padding added) a copy: the ring's split shrinks it in place
        laid["input_ids"] = laid["input_ids"].clone()
    rows, length = laid["input_ids"].shape
    extra = length - batch["input_ids"].shape[1]
    if "attention_mask" in batch:
        laid["attention_mask"] = torch.nn.functional.pad(batch["attention_mask"], (0, extra), value=0)
    for key in ("mask", "old_log_probs"):
        if key in batch:
            laid[key] = torch.cat([batch[key], batch[key].new_zeros(rows, 1 + extra)], dim=1)
    return laid


def group_sum(accelerator, values: torch.Tensor) -> torch.Tensor:
    """`values` summed over this rank's sp/cp group (its consecutive ranks), keeping the gradient: each rank's share
    is placed at its group's index and one differentiable all-reduce over every rank adds them up (gloo and NCCL
    alike; the gradient of each share is the sum of every rank's gradient of the total, as a loss that adds each
    rank's terms needs). Every rank calls it."""
    shards = mesh.sequence_shards(accelerator)
    group, groups = accelerator.process_index // shards, accelerator.num_processes // shards
    placed = torch.zeros((groups, *values.shape), dtype=values.dtype, device=values.device)
    placed = placed.index_copy(0, torch.tensor([group], device=values.device), values.unsqueeze(0))
    return _SumOverRanks.apply(placed)[group]


class _SumOverRanks(torch.autograd.Function):
    """An all-reduce (sum over every rank) whose gradient is the all-reduce of the gradients."""

    @staticmethod
    def forward(ctx, tensor):
        total = tensor.clone()
        torch.distributed.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        torch.distributed.all_reduce(total)
        return total


def whole_row_values(accelerator, values: torch.Tensor, batch: dict, width: int) -> torch.Tensor:
    """Per-position `values` (rows, positions) of the slice `split_rows` gave (`batch`), as (rows, width) of the
    whole rows: each put at its position (the slice's position_ids) and the group's slices added up. Whole rows'
    values as they are (sliced to `width`). Every rank of a group calls it together."""
    shards = mesh.sequence_shards(accelerator)
    if shards == 1:
        return values[:, :width]
    positions = batch["position_ids"]
    # every group's rows to the widest group's length: the sum runs over every rank, in one shape
    length = torch.tensor([positions.shape[1] * shards], device=values.device)
    torch.distributed.all_reduce(length, op=torch.distributed.ReduceOp.MAX)
    whole = values.new_zeros(values.shape[0], int(length))
    whole.scatter_(1, positions, values)
    return group_sum(accelerator, whole)[:, :width]


@contextlib.contextmanager
def exchanging(model, batch: dict):
    """A frozen model (GRPO's reference: in eval mode, its dropout off) scoring a Ulysses slice of `split_rows`:
    DeepSpeed's Ulysses exchanges heads for sequence in train mode only (accelerate registers it with
    disable_in_eval), so the forward runs in train mode; anything else as it is."""
    inner = getattr(model, "module", model)  # (a DeepSpeed engine's own `training` does not follow its module's)
    if "shift_labels" not in batch or launched_mesh_size("sp") <= 1 or inner.training:
        yield
        return
    inner.train()
    try:
        yield
    finally:
        inner.eval()


class RowSums:
    """Sums over each row's tokens, (rows, positions) -> (rows,), for a loss that divides by or exponentiates a
    whole row's sum (GRPO's per-completion means, GSPO's and RLOO's ratios): on whole rows the sum itself; on the
    slices `split_rows` gives, the group's sum of them (`group_sum`, with its gradient). `shards`: how many ranks
    hold each row (a term every one of them computes whole is counted that many times)."""

    def __init__(self, accelerator=None):
        self.accelerator = accelerator
        self.shards = 1 if accelerator is None else mesh.sequence_shards(accelerator)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        local = values.sum(1)
        return local if self.shards == 1 else group_sum(self.accelerator, local)
