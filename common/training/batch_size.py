"""--auto_find_batch_size: the largest per-device batch that fits, with the global batch kept.

Before the strategy wraps the model, each rank tries what one training micro-batch costs at the
asked per-device size: AdamW's two moments and one more weight-sized buffer (a margin for
the strategy's own buffers) held beside the weights, then two forwards and backwards (under
the launched precision) on a batch of the longest training examples. On out-of-memory it
tries the next smaller divisor of the asked size (accelerate's `find_executable_batch_size`
drives the retries), the ranks agree on the smallest size that fit anywhere, and gradient
accumulation rises by the same factor: per-device batch x accumulation x processes stays what
the command asked for, and so does every step's loss normalisation.

The trial holds a whole copy of the model's training state on each device, as DDP does. Under
FSDP or ZeRO, which shard that state, the size chosen is safe but can be smaller than what
would fit.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch
from accelerate.utils import find_executable_batch_size
from accelerate.utils.memory import clear_device_cache
from torch.utils.data import DataLoader, RandomSampler

from common.launch.errors import UsageError


def fit_batch_size(accelerator, model, train_loader: DataLoader, args) -> DataLoader:
    """The train loader at the per-device batch that fits (unchanged when it all fits, or when
    --auto_find_batch_size is off); args.per_device_train_batch_size and
    args.gradient_accumulation_steps are updated to what was chosen."""
    if not args.auto_find_batch_size:
        return train_loader
    asked = args.per_device_train_batch_size
    sizes = [b for b in range(asked, 0, -1) if asked % b == 0]  # divisors: the global batch stays exact
    failed = []

    def next_size():
        failed.append(sizes.pop(0))
        if not sizes:
            raise UsageError(
                f"--auto_find_batch_size: even a per-device batch of 1 ran out of memory on rank "
                f"{accelerator.process_index}; use a larger device, a sharded strategy with offload "
                "(accelerate_configs/zero3_offload.yaml), --gradient_checkpointing or shorter sequences"
            )
        return sizes[0]

    @find_executable_batch_size(starting_batch_size=asked, reduce_batch_size_fn=next_size)
    def trial(batch_size):
        train_step_fits(accelerator, model, longest_batch(train_loader, batch_size))
        return batch_size

    fits = trial()
    if accelerator.device.type == "cuda":  # the run's peak memory is its own, not a failed trial's
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    chosen = int(accelerator.gather(torch.tensor([fits], device=accelerator.device)).min())  # fits on every rank
    if chosen != asked:
        args.gradient_accumulation_steps *= asked // chosen
        args.per_device_train_batch_size = chosen
        accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None and plugin.deepspeed_config.get("gradient_accumulation_steps") not in (None, "auto"):
            plugin.deepspeed_config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        train_loader = with_batch_size(train_loader, chosen)
    if accelerator.is_main_process:
        tried = (
            f"per-device batch {', '.join(map(str, failed))} ran out of memory"
            if failed
            else f"per-device batch {asked} fits"
        )
        print(
            f"auto_find_batch_size: {tried}; training with {chosen} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} per process (the global batch asked for)",
            flush=True,
        )
    return train_loader


def longest_batch(loader: DataLoader, batch_size: int) -> dict:
    """A batch of the `batch_size` longest training examples, collated as the loader does."""
    dataset = loader.dataset
    lengths = [len(ids) for ids in dataset["input_ids"]]
    longest = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)[:batch_size]
    if len(longest) < batch_size:
        raise UsageError(
            f"--per_device_train_batch_size {batch_size} is larger than the train split ({len(longest)} examples)"
        )
    return loader.collate_fn([dataset[i] for i in longest])


def train_step_fits(accelerator, model, batch: dict) -> None:
    """Forward and backward at this batch with AdamW's moments allocated; raises on out-of-memory.
    Nothing the run keeps is changed: the gradients and the moments are dropped afterwards."""
    home = next(model.parameters()).device
    was_training = model.training
    model.to(accelerator.device).train()
    # AdamW's two moments, and one more copy of the trainable weights as a margin for what the strategy
    # and the step hold beside them (gathered layers, reduce buckets, the step's temporaries).
    held = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad for _ in range(3)]
    try:
        batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        for _ in range(2):  # the second micro-batch meets the first one's gradients and the allocator's state
            with accelerator.autocast():
                loss = model(**batch).loss
            loss.backward()
            del loss
    finally:
        del held
        model.zero_grad(set_to_none=True)
        model.to(home).train(was_training)
        clear_device_cache(garbage_collection=True)
        release_host_memory()


def release_host_memory() -> None:
    """Hand freed host memory back to the OS (glibc keeps it in its arenas otherwise): a trial
    that ran out of memory must not leave the run less than it found."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def with_batch_size(loader: DataLoader, batch_size: int) -> DataLoader:
    """The same loader (data, order, collation, last partial batch dropped) at another batch size."""
    return DataLoader(
        loader.dataset,
        batch_size=batch_size,
        shuffle=isinstance(loader.sampler, RandomSampler),
        collate_fn=loader.collate_fn,
        generator=loader.generator,
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
    )
