"""A checkpoint's portable form (common.outputs.portable) loaded into the run's own strategy after `prepare`.

Through the strategies' public setters: torch's `set_model_state_dict` and `set_optimizer_state_dict`
for one process, DDP and FSDP2 (which shards the full tensors as it loads them); DeepSpeed's
`safe_set_full_fp32_param` and `safe_set_full_optimizer_state` for ZeRO-1/2/3 (offload included),
its compute copy through `GatheredParameters`. The optimizer's hyperparameters are the run's
arguments, as on any start; the learning rate comes back with the schedule.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from common.launch.errors import UsageError
from common.outputs.portable import OPTIMIZER_STATES, family
from common.parallel import pipeline


def load(accelerator, model, optimizer, scheduler, path: str) -> None:
    """A portable folder into this run's prepared model, optimizer and schedule, and this rank's RNG."""
    from accelerate.checkpointing import load_accelerator_state
    from safetensors import safe_open

    with open(os.path.join(path, "optimizer.json")) as handle:
        steps = json.load(handle)["steps"]
    with (
        safe_open(os.path.join(path, "model.safetensors"), "pt") as weights,
        safe_open(os.path.join(path, "optimizer.safetensors"), "pt") as moments,
    ):
        # frozen parameters (LoRA's base model) come from the base model; DeepSpeed's checkpoints leave them out
        aliases = pipeline.tied_head_alias(model)
        trainable = [name for name, parameter in _named_parameters(accelerator, model) if parameter.requires_grad]
        missing = sorted(name for name in trainable if _entry(name, weights.keys(), aliases) not in weights.keys())
        if missing:
            raise UsageError(
                f"checkpoint {path} holds no weight for {len(missing)} of this model's trained "
                f"parameters (first: {missing[0]}): it was written for another model; resume with "
                "that run's model arguments"
            )
        if family(accelerator) == "deepspeed":
            _load_deepspeed(accelerator, model, optimizer, weights, moments, steps)
        else:
            _load_torch(accelerator, model, optimizer, weights, moments, steps, aliases)
    load_accelerator_state(path, [], [], [scheduler], [], accelerator.process_index)
    for group, lr in zip(_inner(optimizer).param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # what the schedule had set for the next step


def _entry(name: str, saved, aliases: dict) -> str:
    """The file's entry for this model's parameter: its own name, else its alias (a pipeline's last stage reads
    its copy of tied embeddings, its head, from the embeddings' entry where the file holds the tensor once)."""
    return name if name in saved else aliases.get(name, name)


def _named_parameters(accelerator, model):
    return _module(accelerator, model).named_parameters()


def _module(accelerator, model):
    """The model out of DDP's wrapper and uncompiled (regional compile's copy has other parameter names): the
    same parameters, under the names the checkpoint holds. Under FSDP2, the sharded model itself."""
    from common.launch.accelerator import unwrap

    return unwrap(accelerator, model)


def _inner(optimizer):
    from common.launch.internals import innermost_optimizer

    return innermost_optimizer(optimizer)


def _load_torch(accelerator, model, optimizer, weights, moments, steps, aliases: dict) -> None:
    """One process, DDP, FSDP2: the full state read on the first process only and sent to the others (torch's
    broadcast_from_rank0; FSDP2 keeps each rank's shard of it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    module, inner = _module(accelerator, model), _inner(optimizer)
    # pp.yaml: each rank holds other parameters (its stages), so each reads its own from the file
    several = accelerator.num_processes > 1 and not pipeline.enabled(accelerator)
    first = accelerator.process_index == 0 or pipeline.enabled(accelerator)
    options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=several)
    saved = set(weights.keys())
    entries = {name: _entry(name, saved, aliases) for name in module.state_dict()}
    wanted = {name: entry for name, entry in entries.items() if entry in saved}  # `load` checked the trained ones
    set_model_state_dict(
        module, {name: weights.get_tensor(wanted[name]) for name in sorted(wanted)} if first else {}, options=options
    )
    names = {id(parameter): name for name, parameter in module.named_parameters()}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in inner.param_groups
    ]
    state = (
        {
            name: {
                "step": torch.tensor(steps[entry], dtype=torch.float32),
                **{key: moments.get_tensor(f"{entry}.{key}") for key in OPTIMIZER_STATES},
            }
            for group in groups
            for name in group["params"]
            for entry in [_entry(name, steps, aliases)]
            if entry in steps
        }
        if first
        else {}
    )
    set_optimizer_state_dict(module, inner, {"state": state, "param_groups": groups} if first else {}, options=options)


def _load_deepspeed(accelerator, model, optimizer, weights, moments, steps) -> None:
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    # Adam's state of each flat fp32 partition, made here where the engine has not made it yet (ZeRO-3
    # makes it at the first step), at the saved step count; the moments are set per parameter below
    from common.launch.internals import zero3_flat_master_groups, zero_optimizer

    inner, step = _inner(optimizer), max(steps.values(), default=0.0)
    fused = any(group.get("fused") or group.get("capturable") for group in inner.param_groups)
    flats = {
        id(flat): flat
        for flat in [p for group in inner.param_groups for p in group["params"]] + zero3_flat_master_groups(optimizer)
    }
    for flat in flats.values():
        entry = inner.state[flat]
        for key in OPTIMIZER_STATES:
            entry.setdefault(key, torch.zeros_like(flat))
        entry["step"] = torch.tensor(step, dtype=torch.float32, device=flat.device if fused else "cpu")
    zero = zero_optimizer(optimizer)
    if zero is not None and hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1/2 link it after a first step
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        for index, _ in enumerate(inner.param_groups):
            lazy_init_hp_params_optimizer_state(
                zero.bit16_groups[index], zero.single_partition_of_fp32_groups[index], inner.state
            )
    for name, parameter in _named_parameters(accelerator, model):
        if name not in weights.keys():
            continue  # frozen and left out (LoRA's base model, from the base model already)
        full = weights.get_tensor(name)
        zero3 = hasattr(parameter, "ds_id")
        # the compute copy: every rank's under ZeRO-1/2; under ZeRO-3 rank 0's, then partitioned again
        gathered = (
            deepspeed.zero.GatheredParameters([parameter], modifier_rank=0) if zero3 else contextlib.nullcontext()
        )
        with gathered, torch.no_grad():
            if not zero3 or accelerator.process_index == 0:
                parameter.data.copy_(full.to(parameter.device, parameter.dtype))
        if not parameter.requires_grad:
            continue
        safe_set_full_fp32_param(parameter, full)
        for key in OPTIMIZER_STATES:
            if f"{name}.{key}" in moments.keys():
                safe_set_full_optimizer_state(parameter, moments.get_tensor(f"{name}.{key}"), key)
