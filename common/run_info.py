"""Starting a run, and `output_dir/run.json`: what ran, resolved, so it is never a guess."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys

import torch

from accelerate.utils import set_seed

from common import memory
from common.accelerator import build_accelerator, launched_strategy, participating_processes
from common.checkpoints import (check_output_dir, clear_earlier_run, for_this_world_size, list_checkpoints,
                                prepare_output_dir)
from common.model import local_parameter_shards

PACKAGES = ("torch", "accelerate", "transformers", "datasets", "deepspeed", "peft", "evaluate", "tokenizers")


def start_run(args):
    """Refuse to clobber an earlier run (before any process group starts), build the
    accelerator, seed everything, and return it with the checkpoint to resume from
    (None for a fresh run; a DeepSpeed one saved by another number of processes is converted). Under `accelerate launch --max_restarts N`, a restarted
    worker resumes from the run's latest complete checkpoint by itself."""
    resume_after_restart(args)
    check_output_dir(args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir)
    accelerator = build_accelerator(args)
    memory.mark("started")
    set_seed(args.seed)
    checkpoint = prepare_output_dir(accelerator, args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir)
    return accelerator, for_this_world_size(accelerator, checkpoint)


def resume_after_restart(args) -> None:
    """torchrun sets TORCHELASTIC_RESTART_COUNT in the workers it restarts after a failure. They
    were launched with the first attempt's arguments (--overwrite_output_dir included): once this
    run has a complete checkpoint, continue from the latest one instead."""
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if max_restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and _is_rank0():
        # Seen (torch 2.13, gloo): the static rendezvous keeps its store across attempts, so a restarted
        # rank can read a dead peer's address and fail with "Connection refused".
        print("warning: --max_restarts through a rendezvous store kept across attempts: restarted workers may "
              "connect to the dead ones' addresses. Launch with --rdzv_backend c10d and "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment (make does both)", file=sys.stderr)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and list_checkpoints(args.output_dir):
        args.resume_from_checkpoint, args.overwrite_output_dir = "latest", False
    if restart and _is_rank0():
        print(f"restart {restart} of at most {max_restarts}: "
              f"{'resuming from the latest checkpoint' if args.resume_from_checkpoint == 'latest' else 'no checkpoint yet, starting again'}",
              file=sys.stderr)


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def strategy_details(accelerator) -> dict:
    state = accelerator.state
    details = {"launched_strategy": launched_strategy()}
    if getattr(state, "deepspeed_plugin", None) is not None:
        zero = state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        details.update(zero_stage=zero.get("stage"), zero3_sub_group_size=zero.get("sub_group_size"),
                       offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none"),
                       offload_param=zero.get("offload_param", {}).get("device", "none"),
                       deepspeed_cpu_adam=bool(state.deepspeed_plugin.deepspeed_config.get("zero_force_ds_cpu_optimizer", True))
                       and zero.get("offload_optimizer", {}).get("device", "none") != "none")
    if getattr(state, "fsdp_plugin", None) is not None:
        plugin = state.fsdp_plugin
        details.update(fsdp_version=plugin.fsdp_version, fsdp_reshard_after_forward=str(plugin.reshard_after_forward),
                       fsdp_offload_params=_fsdp_offloads(plugin),
                       fsdp_state_dict_type=str(plugin.state_dict_type),
                       fsdp_activation_checkpointing=bool(plugin.activation_checkpointing))
    mesh = getattr(state, "device_mesh", None)  # a parallelism_config (HSDP: dp_replicate x dp_shard)
    if mesh is not None and mesh.mesh_dim_names:
        details["device_mesh"] = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))
    return details


def _fsdp_offloads(plugin) -> bool:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return isinstance(plugin.cpu_offload, CPUOffloadPolicy) or bool(getattr(plugin.cpu_offload, "offload_params", False))


def local_parameter_elements(model) -> int:
    """Parameter elements this rank stores: its shard under ZeRO-3 or FSDP, all of them otherwise."""
    return sum(shard.numel() for shard in local_parameter_shards(model))


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _master_dtype(optimizer):
    """dtype of the weights the optimizer updates. accelerate's and DeepSpeed's wrappers hold
    the optimizer over the master copy; ZeRO keeps it in flat fp32 partitions."""
    while optimizer is not None:
        for flat in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):  # ZeRO-3, ZeRO-1/2
            if getattr(optimizer, flat, None):
                return getattr(optimizer, flat)[0].dtype
        if not hasattr(optimizer, "optimizer"):
            updated = [p for group in optimizer.param_groups for p in group["params"]]
            return updated[0].dtype if updated else None
        optimizer = optimizer.optimizer
    return None


def precision_details(accelerator, model, optimizer) -> dict:
    """What precision this run really trains in: the compute dtype, the dtype of the
    weights the optimizer updates (its states are created like them), and the dtype
    gradients are reduced in across ranks."""
    master = _master_dtype(optimizer)
    compute = {"bf16": "bfloat16", "fp16": "float16"}.get(accelerator.mixed_precision)
    reduce = None
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        engine = model
        compute = "bfloat16" if engine.bfloat16_enabled() else "float16" if engine.fp16_enabled() else None
        reduce = engine.communication_data_type
    elif getattr(accelerator.state, "fsdp_plugin", None) is not None:
        policy = accelerator.state.fsdp_plugin.mixed_precision_policy
        reduce = getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None) or master
    elif accelerator.num_processes > 1:
        reduce = master  # DDP reduces gradients in the parameters' dtype; autocast does not change it
    return {"compute_dtype": compute or _dtype_name(master), "master_weights_dtype": _dtype_name(master),
            "optimizer_states_dtype": _dtype_name(master), "gradient_reduce_dtype": _dtype_name(reduce)}


def record_run(accelerator, model, optimizer, args: dict, output_dir: str, **extra) -> dict:
    """Print the resolved arguments once and write run.json (main process). Called once the
    run is known to start (its checkpoint, if any, loaded): an --overwrite_output_dir run
    clears the earlier run's files here, not before.

    `model` and `optimizer` are the prepared ones: run.json records each rank's share of
    the parameters and the precision the run trains in."""
    memory.mark("prepared")
    world_size = accelerator.num_processes
    local = torch.tensor([local_parameter_elements(model)], device=accelerator.device)
    record = {
        "args": args,
        "world_size": world_size,
        "participating_processes": participating_processes(accelerator),
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "mixed_precision": accelerator.mixed_precision,
        "mixed_precision_requested": getattr(accelerator, "requested_mixed_precision", accelerator.mixed_precision),
        **precision_details(accelerator, model, optimizer),
        "sync_each_micro_batch": getattr(accelerator, "sync_each_micro_batch", None),
        "device": str(accelerator.device),
        "local_parameter_elements": [int(n) for n in accelerator.gather(local).tolist()],
        "effective_batch_size": args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] * world_size,
        **strategy_details(accelerator),
        **extra,
        "versions": package_versions(),
    }
    clear_earlier_run(accelerator)
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        print(json.dumps(record, indent=2, default=str))
        with open(os.path.join(output_dir, "run.json"), "w") as handle:
            json.dump(record, handle, indent=2, default=str)
    return record


def tracker_config(args: dict) -> dict:
    """The scalar arguments, which is what TensorBoard's hparams accept."""
    return {k: v for k, v in args.items() if isinstance(v, (int, float, str, bool))}
