"""Run the GPU configs on a host without CUDA: what `common.launch.accelerator` adds there.

A plain `Accelerator()` on such a host resolves every launched rank to a lone
single-process run. So each YAML is mapped to its CPU equivalent:

  MULTI_GPU  -> MULTI_CPU over gloo
  FSDP       -> FSDP2 (`fully_shard`) over gloo
  tensor parallel (parallelism_config_tp_size) -> its device mesh over gloo
  context parallel (parallelism_config_cp_size) -> torch's ring attention over gloo, on the CPU's
                                                   flash kernel (torch gives it CUDA's only)
  DeepSpeed  -> DeepSpeed's CPU accelerator over gloo

Precision is honoured: bf16 runs under CPU autocast (FSDP2's and DeepSpeed's own
bf16 paths included) where the CPU has bf16 instructions; on a CPU without them the
run falls back to fp32 and says so in one line, unless RECIPES_EMULATE_BF16=true asks
for bf16 anyway (torch emulates it there: the same numerics, up to ~50x slower; the
tests of bf16's numerics set it, so that they check bf16 on any CPU). `run.json` records both.
"""

from __future__ import annotations

import os
import sys

from accelerate import PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from common.launch.internals import (
    cpu_has_bf16_instructions,
    present_cpu_group_as_multi_gpu,
    ring_attention_on_cpu,
    skip_deepspeed_op,
)


def cpu_runs_bf16() -> bool:
    """The CPU has bf16 instructions (avx512_bf16/amx), or RECIPES_EMULATE_BF16=true."""
    return os.environ.get("RECIPES_EMULATE_BF16", "false").lower() == "true" or cpu_has_bf16_instructions()


def _requested_precision() -> str:
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()


def accelerator_kwargs(strategy: str, process_group: InitProcessGroupKwargs) -> dict:
    """Accelerator() arguments (and process-group set-up) for `strategy` on this CPU host;
    `process_group` carries the recipe's timeout."""
    if _requested_precision() == "bf16" and not cpu_runs_bf16():
        _say_fp32(
            "bf16",
            "this CPU has no bf16 instructions (avx512_bf16/amx; RECIPES_EMULATE_BF16=true runs "
            "bf16 anyway, up to ~50x slower)",
        )
        os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
    if strategy == "single":
        return {}
    if strategy == "deepspeed":
        # DeepSpeed's branch needs cpu=False; without gloo accelerate counts one process.
        process_group.backend = "gloo"
        return {}
    if strategy in ("fsdp", "tp"):
        # accelerate only enables FSDP, and a parallelism_config's mesh, from a MULTI_GPU state: start
        # the CPU process group ourselves, then present it as MULTI_GPU so the plugin (mesh) is applied.
        PartialState(cpu=True, timeout=process_group.timeout)
        present_cpu_group_as_multi_gpu(DistributedType.MULTI_GPU)
        return {}
    return {"cpu": True}


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend compiles its shared-memory all-reduce (the deepspeed_shm_comm extension, with the host's
    C++ compiler: 24 s on a 2-core host, minutes on slower ones, a failed start where none is installed) the first time
    it starts on a machine, and loads it in every run after. Only DeepSpeed's inference all-reduce (its AutoTP layers)
    calls it; ZeRO's training, the recipes', calls torch.distributed. Marked not compatible here, DeepSpeed neither
    builds nor loads it (that all-reduce would fall back to torch.distributed's). Call after DeepSpeed is imported."""
    skip_deepspeed_op("deepspeed_shm_comm")


def adapt(accelerator, strategy: str) -> None:
    """After the Accelerator exists: the plugin settings a CPU host cannot honour as written."""
    if strategy == "fsdp":
        _unpin_fsdp_offload(accelerator.state.fsdp_plugin)
    config = accelerator.parallelism_config
    if config is not None and config.cp_enabled:
        ring_attention_on_cpu()
    if strategy == "deepspeed":
        _deepspeed_json_precision(accelerator.state.deepspeed_plugin)
        _keep_torch_optimizer_on_offload(accelerator.state.deepspeed_plugin)


def _say_fp32(requested: str, why: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: mixed_precision={requested} asked for, but {why}; training in fp32", file=sys.stderr)


def _deepspeed_json_precision(plugin) -> None:
    """Precision set inside a DeepSpeed JSON: fp16 needs loss scaling DeepSpeed does not run on
    CPU, and bf16 needs bf16 instructions; otherwise it is honoured as written."""
    for key, usable in (("bf16", cpu_runs_bf16()), ("fp16", False)):
        block = plugin.deepspeed_config.get(key)
        if isinstance(block, dict) and block.get("enabled") is True and not usable:
            block["enabled"] = False
            _say_fp32(key, "this CPU host cannot run it under DeepSpeed")


def _unpin_fsdp_offload(plugin) -> None:
    """FSDP2's CPU offload pins host memory, which needs CUDA; on a CPU host keep the
    offload code path (parameters and optimizer step on CPU) without pinning."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)


def _keep_torch_optimizer_on_offload(plugin) -> None:
    """With offload_optimizer, accelerate swaps the recipe's AdamW for DeepSpeedCPUAdam, whose C++ op is
    compiled at its first use (a compiler and a minute or two). On a CPU host keep the recipe's optimizer unless
    the DeepSpeed JSON sets zero_force_ds_cpu_optimizer; GPU hosts get DeepSpeedCPUAdam as DeepSpeed intends.
    (Its resume once differed from an uninterrupted run's, here and on an H100: the schedule had lost it,
    common.outputs.checkpoints.schedule_the_loaded_optimizer; forced here by hand, on 1 and 2 processes, it then
    resumed bit for bit.)"""
    config = plugin.deepspeed_config
    offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload not in (None, "none") and "zero_force_ds_cpu_optimizer" not in config:
        config["zero_force_ds_cpu_optimizer"] = False
