"""Build the `Accelerator` for whatever config `accelerate launch` was given.

On a GPU host this is a plain `Accelerator`. On a host without CUDA a plain
`Accelerator()` resolves every launched rank to a lone single-process run, so
the same YAML is mapped to its CPU equivalent instead:

  MULTI_GPU  -> MULTI_CPU over gloo
  FSDP       -> FSDP2 (`fully_shard`) over gloo
  DeepSpeed  -> DeepSpeed's CPU accelerator over gloo

and the launched world size is checked against the one the accelerator sees.
Recipes never learn which strategy they run under.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, ProjectConfiguration


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_strategy() -> str:
    """The strategy the accelerate config asked for, as the launcher exported it."""
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _env_flag("ACCELERATE_USE_FSDP"):
        return "fsdp"
    return "ddp" if launched_world_size() > 1 else "single"


def _warn_fp32_fallback(requested: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: mixed_precision={requested} asked for on a host without a GPU; training in fp32 "
              "(set mixed_precision: no, or bf16.enabled: false in a DeepSpeed JSON, to silence this)",
              file=sys.stderr)


def _fall_back_to_fp32_on_cpu() -> str:
    """bf16/fp16 on a CPU is slow and breaks fp32 parity: run fp32 and say so once."""
    requested = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if requested not in ("no", "fp32") and not torch.cuda.is_available():
        _warn_fp32_fallback(requested)
        os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
    return requested


def _deepspeed_json_fp32_on_cpu(plugin) -> str | None:
    """The same fallback for precision set inside a DeepSpeed JSON (deepspeed_config_file)."""
    requested = None
    for key in ("bf16", "fp16"):
        block = plugin.deepspeed_config.get(key)
        if isinstance(block, dict) and block.get("enabled") is True:
            block["enabled"], requested = False, key
    if requested:
        _warn_fp32_fallback(requested)
    return requested


def build_accelerator(gradient_accumulation_steps: int = 1, report_to: str = "none",
                      output_dir: str | None = None) -> Accelerator:
    kwargs = dict(
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=None if report_to == "none" else report_to,
        project_config=ProjectConfiguration(project_dir=output_dir,
                                            logging_dir=output_dir and os.path.join(output_dir, "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    requested_precision = _fall_back_to_fp32_on_cpu()
    strategy = launched_strategy()
    if not torch.cuda.is_available() and strategy != "single":
        if strategy == "deepspeed":
            # DeepSpeed's branch needs cpu=False; without gloo accelerate counts one process.
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
        elif strategy == "fsdp":
            # accelerate only enables FSDP from a MULTI_GPU state: start the CPU process
            # group ourselves, then present it as MULTI_GPU so the FSDP plugin is applied.
            PartialState(cpu=True)
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        else:
            kwargs["cpu"] = True
    accelerator = Accelerator(**kwargs)
    if strategy == "deepspeed":
        _keep_torch_optimizer_on_offload(accelerator.state.deepspeed_plugin)
        if not torch.cuda.is_available():
            requested_precision = _deepspeed_json_fp32_on_cpu(accelerator.state.deepspeed_plugin) or requested_precision
    if strategy == "fsdp" and not torch.cuda.is_available():
        _unpin_fsdp_offload(accelerator.state.fsdp_plugin)
    accelerator.requested_mixed_precision = requested_precision
    if accelerator.num_processes != launched_world_size():
        raise RuntimeError(
            f"accelerate launched {launched_world_size()} processes but this rank sees "
            f"{accelerator.num_processes} ({accelerator.distributed_type}); each rank would train alone")
    return accelerator


def _unpin_fsdp_offload(plugin) -> None:
    """FSDP2's CPU offload pins host memory, which needs CUDA; on a CPU host keep the
    offload code path (parameters and optimizer step on CPU) without pinning."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)


def _keep_torch_optimizer_on_offload(plugin) -> None:
    """With offload_optimizer, accelerate swaps the recipe's AdamW for DeepSpeedCPUAdam.
    Seen here (deepspeed 0.19.8): after resuming from a checkpoint, DeepSpeedCPUAdam's
    second update differs from an uninterrupted run's (loss gap 0.14 by step 12),
    while torch's AdamW on the offloaded fp32 shards resumes exactly. Keep the
    recipe's optimizer unless the DeepSpeed JSON sets zero_force_ds_cpu_optimizer."""
    config = plugin.deepspeed_config
    offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload not in (None, "none") and "zero_force_ds_cpu_optimizer" not in config:
        config["zero_force_ds_cpu_optimizer"] = False


def participating_processes(accelerator: Accelerator) -> int:
    """Count the ranks that really take part, by an all-reduce (not by reading a setting)."""
    one = torch.ones(1, device=accelerator.device)
    return int(accelerator.reduce(one, reduction="sum").item())
