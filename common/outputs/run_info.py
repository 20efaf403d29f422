"""`output_dir/run.json`: what ran, resolved (arguments, layout, precision, versions), so it is never a guess."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys

import torch

from common.launch.accelerator import Launch, autocast_dtype, participating_processes
from common.launch.internals import innermost_optimizer, master_weights_dtype
from common.launch.mesh import data_parallel_size, ulysses_shards
from common.outputs.run_dir import write_atomically
from common.parallel import pipeline
from common.parallel.shards import local_parameter_shards
from common.training import memory


PACKAGES = ("torch", "accelerate", "transformers", "datasets", "deepspeed", "peft", "evaluate", "tokenizers")


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def strategy_details(accelerator, launch: Launch) -> dict:
    state = accelerator.state
    details = {"launched_strategy": launch.strategy}
    if getattr(state, "deepspeed_plugin", None) is not None:
        zero = state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        details.update(
            zero_stage=zero.get("stage"),
            zero3_sub_group_size=zero.get("sub_group_size"),
            zero3_max_live_parameters=zero.get("stage3_max_live_parameters"),
            offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none"),
            offload_param=zero.get("offload_param", {}).get("device", "none"),
            deepspeed_cpu_adam=bool(state.deepspeed_plugin.deepspeed_config.get("zero_force_ds_cpu_optimizer", True))
            and zero.get("offload_optimizer", {}).get("device", "none") != "none",
        )
    if getattr(state, "fsdp_plugin", None) is not None:
        plugin = state.fsdp_plugin
        details.update(
            fsdp_version=plugin.fsdp_version,
            fsdp_reshard_after_forward=str(plugin.reshard_after_forward),
            fsdp_offload_params=_fsdp_offloads(plugin),
            fsdp_state_dict_type=str(plugin.state_dict_type),
            fsdp_activation_checkpointing=bool(plugin.activation_checkpointing),
        )
    mesh = getattr(state, "device_mesh", None)  # a parallelism_config (HSDP: dp_replicate x dp_shard)
    if mesh is not None and mesh.mesh_dim_names:
        details["device_mesh"] = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))
    shards = ulysses_shards(accelerator)
    if shards > 1:  # DeepSpeed's Ulysses groups: no torch device mesh
        details["device_mesh"] = {"sp": shards, "dp": accelerator.num_processes // shards}
    return details | pipeline.describe(accelerator)


def _fsdp_offloads(plugin) -> bool:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return isinstance(plugin.cpu_offload, CPUOffloadPolicy) or bool(
        getattr(plugin.cpu_offload, "offload_params", False)
    )


def local_parameter_elements(model) -> int:
    """Parameter elements this rank stores: its shard under ZeRO-3 or FSDP, all of them otherwise."""
    return sum(shard.numel() for shard in local_parameter_shards(model))


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def precision_details(accelerator, model, optimizer) -> dict:
    """What precision this run really trains in: the compute dtype, the dtype of the
    weights the optimizer updates (its states are created like them), and the dtype
    gradients are reduced in across ranks."""
    master = master_weights_dtype(optimizer)
    compute = autocast_dtype(accelerator.mixed_precision)
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
    return {
        "compute_dtype": compute or _dtype_name(master),
        "master_weights_dtype": _dtype_name(master),
        "optimizer_states_dtype": _dtype_name(master),
        "gradient_reduce_dtype": _dtype_name(reduce),
        "optimizer": type(innermost_optimizer(optimizer)).__name__,
    }  # the one updating the weights


def record_run(accelerator, launch: Launch, model, optimizer, args: dict, output_dir: str, **extra) -> dict:
    """Write run.json (main process) and say the run in one line on the console. Called once the
    run is known to start (its checkpoint, if any, loaded).

    `model` and `optimizer` are the prepared ones: run.json records each rank's share of
    the parameters and the precision the run trains in."""
    memory.mark("prepared")
    world_size = accelerator.num_processes
    kind = str(accelerator.distributed_type).split(".")[-1]
    # a CPU host's TP mesh, presented (common.launch.cpu_host)
    if kind == "MULTI_GPU" and accelerator.device.type != "cuda":
        kind = "MULTI_CPU"
    local = torch.tensor([local_parameter_elements(model)], device=accelerator.device)
    record = {
        "args": args,
        "command": sys.argv,  # the recipe and its arguments as this process was given them
        "world_size": world_size,
        "participating_processes": participating_processes(accelerator),
        "distributed_type": kind,
        "mixed_precision": accelerator.mixed_precision,
        "mixed_precision_requested": launch.requested_mixed_precision,
        **precision_details(accelerator, model, optimizer),
        "sync_each_micro_batch": launch.sync_each_micro_batch,
        "device": str(accelerator.device),
        "local_parameter_elements": [int(n) for n in accelerator.gather(local).tolist()],
        # a tensor-parallel group trains on one batch: counted once (common.launch.mesh)
        "effective_batch_size": args["per_device_train_batch_size"]
        * args["gradient_accumulation_steps"]
        * data_parallel_size(accelerator),
        **strategy_details(accelerator, launch),
        **extra,
        "versions": package_versions(),
    }
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        write_atomically(os.path.join(output_dir, "run.json"), json.dumps(record, indent=2, default=str))
        print(run_line(record, output_dir))
    return record


def millions(count) -> str:
    return f"{count / 1e6:.1f}M" if count >= 1e5 else f"{count / 1e6:.3f}M"


def run_line(record: dict, output_dir: str) -> str:
    """What the console says of the run at its start: the strategy and the processes that took part, the
    precision trained in, the batch, the parameters and the steps; the whole record is run.json."""
    precision = record["compute_dtype"]
    asked = record.get("mixed_precision_requested")
    if asked and asked != "no" and asked != record["mixed_precision"]:
        precision += f" ({asked} asked)"
    parts = [
        f"run: {record.get('launched_strategy') or record['distributed_type']} on {record['world_size']} "
        f"process(es), {record['participating_processes']} took part ({record['device']})",
        f"{precision}",
        f"global batch {record['effective_batch_size']}",
    ]
    if "total_parameters" in record:
        trained = record.get("trainable_parameters", record["total_parameters"])
        parts.append(f"{millions(record['total_parameters'])} parameters, {millions(trained)} trained")
    if "pipeline" in record:
        piped = record["pipeline"]
        shares = " | ".join(
            "-".join(str(index) for index in dict.fromkeys([layers[0], layers[-1]])) if layers else "none"
            for layers in (stage["layers"] for stage in piped["stages"])
        )
        parts.append(
            f"pipeline of {len(piped['stages'])} stages ({piped['schedule']}, layers {shares})"
            + (f" x {piped['replicas']} replicas" if piped["replicas"] > 1 else "")
            + f" from {piped['config_file']}"
        )
    if record.get("experts", {}).get("ep_size"):
        moe = record["experts"]
        parts.append(
            f"experts split over {moe['ep_size']} ranks ({moe['experts_per_rank']} of {moe['num_experts']} each"
            + (f", each sharded over {moe['expert_shards']} ranks)" if moe.get("expert_shards") else ")")
        )
    if "max_steps" in record:
        parts.append(f"{record['max_steps']} steps")
    return "; ".join(parts) + f"; the whole record: {os.path.join(output_dir, 'run.json')}"


def tracker_config(args: dict) -> dict:
    """The scalar arguments, which is what TensorBoard's hparams accept."""
    return {k: v for k, v in args.items() if isinstance(v, (int, float, str, bool))}


def data_sources(arguments) -> dict:
    """run.json's `data_sources`: the rows each --dataset_mixture source gave (common.data.mixture)."""
    mixture = next((a.mixture for a in arguments if getattr(a, "mixture", None) is not None), None)
    return {"data_sources": mixture.counts} if mixture is not None else {}
