"""Build the `Accelerator` for whatever config `accelerate launch` was given.

This is the path a GPU user runs: the launched precision, gradient accumulation
that the recipe's loop drives window by window, clipping from `--max_grad_norm`
under every strategy (DeepSpeed included), and a check that every launched rank
really takes part. On a host without CUDA, `common.launch.cpu_host` maps the same YAML
to its CPU equivalent (gloo, FSDP2 on CPU, DeepSpeed's CPU accelerator).
Recipes never learn which strategy they run under.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import (
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)

from common.launch import cpu_host
from common.launch.errors import UsageError
from common.launch.internals import allow_recompiles, engine_tests_without_importing_deepspeed
from common.launch.mesh import DIMENSIONS, launched_mesh_size, mesh_problems


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_strategy() -> str:
    """The strategy the accelerate config asked for, as the launcher exported it (FSDP x TP is fsdp: its files)."""
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _env_flag("ACCELERATE_USE_FSDP"):
        return "fsdp"
    if launched_mesh_size("tp") > 1:
        return "tp"
    if launched_mesh_size("pp") > 1:
        return "pp"
    return "ddp" if launched_world_size() > 1 else "single"


def refuse_unsupported_mesh() -> None:
    """What a parallelism_config asks that cannot run here (or at all), refused in one line before anything starts
    (the rules: common.launch.mesh.mesh_problems, which `make check-config` applies to the YAML)."""
    if not _env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        return
    sizes = {name: launched_mesh_size(name) for name in DIMENSIONS}
    fsdp = _env_flag("ACCELERATE_USE_FSDP")
    kind = "DEEPSPEED" if _env_flag("ACCELERATE_USE_DEEPSPEED") else "FSDP" if fsdp else "MULTI_GPU"
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")  # (not exported beside a DeepSpeed JSON)
    problems = mesh_problems(
        sizes,
        launched_world_size(),
        kind,
        fsdp and os.environ.get("FSDP_VERSION", "1") == "2",
        _env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING"),
        int(stage) if stage else None,
    )
    if problems:
        raise UsageError(problems[0])


def more_processes_than_gpus(local_world: int, gpus: int) -> str | None:
    """The one line for a node launched with more processes than it has GPUs (NCCL runs one per GPU), else None."""
    if local_world <= gpus:
        return None
    return (
        f"{local_world} processes on this node but {gpus} GPU(s) visible (NCCL needs one GPU per process): "
        f"launch at most {gpus} per node (--num_processes counts them all: nodes x {gpus}), or check "
        "CUDA_VISIBLE_DEVICES"
    )


def refuse_more_processes_than_gpus() -> None:
    """Before any rank picks its GPU: a config asking more processes than the node has GPUs, in one line. The
    processes on this node as torchrun (LOCAL_WORLD_SIZE) or DeepSpeed's launcher (LOCAL_SIZE) tells them; a
    launch that tells neither is one process, or is not checked."""
    if not torch.cuda.is_available() or _env_flag("ACCELERATE_USE_CPU"):
        return
    local_world = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    if local_world is None and launched_world_size() > 1:
        return
    problem = more_processes_than_gpus(int(local_world or 1), torch.cuda.device_count())
    if problem:
        raise UsageError(problem)


@dataclass(frozen=True)
class Launch:
    """What was launched, beside what the Accelerator resolved it to (both go to run.json)."""

    strategy: str  # single, ddp, tp, pp, fsdp or deepspeed, as the accelerate config asked
    requested_mixed_precision: str
    sync_each_micro_batch: bool


def autocast_dtype(mixed_precision: str) -> str | None:
    """The dtype autocast computes in under accelerate's `mixed_precision`. fp8 (torchao) runs its float8
    matmuls inside bf16 autocast: its MFU is measured against the bf16 peak, as torchtitan reports it."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}.get(mixed_precision)


def build_accelerator(
    args, hidden_size: int | None = None, accelerator_classes: dict | None = None
) -> tuple[Accelerator, Launch]:
    """`args`: the recipe's TrainingArguments (accumulation, clipping, trackers, output_dir);
    `hidden_size`: the model's, when its config tells (sizes ZeRO-3's live parameters);
    `accelerator_classes`: the Accelerator a strategy runs under where it is not accelerate's own, by strategy
    (common.run passes the pipeline's, {"pp": PipelineAccelerator}: the parallelisms sit above this layer).
    The learning-rate schedule steps once per optimizer step (the recipes call it only then),
    not num_processes times as accelerate does by default, so its horizon is the run's steps on
    any world size."""
    strategy = launched_strategy()
    sync_each_micro_batch = args.sync_each_micro_batch
    if sync_each_micro_batch is None:  # FSDP: reduce-scatter every micro-batch so gradients stay sharded
        sync_each_micro_batch = strategy == "fsdp"
    kwargs = dict(
        # The loop's windows (common.training.loop.TrainBatches) end each optimizer step, epoch
        # boundaries included, so accelerate's own end-of-dataloader sync is switched off.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps,
            sync_with_dataloader=False,
            sync_each_batch=sync_each_micro_batch,
        ),
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(
            project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        step_scheduler_with_optimizer=False,
        dynamo_plugin=dynamo_plugin(args),  # --torch_compile: regional compilation at prepare
    )
    requested_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    on_cpu_host = not torch.cuda.is_available()
    # Every collective gives up after --ddp_timeout: a lost peer ends the run (common.launch.peers).
    process_group = InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout))
    if on_cpu_host:
        kwargs.update(cpu_host.accelerator_kwargs(strategy, process_group))
    # DDP: each gradient is a view into its all-reduce bucket, so gradients are held once, not
    # twice, and no copy runs in and out of the buckets each step (torch's default copies).
    kwargs["kwargs_handlers"] = [process_group, DistributedDataParallelKwargs(gradient_as_bucket_view=True)]
    engine_tests_without_importing_deepspeed()  # outside DeepSpeed's configs, deepspeed is never imported
    if strategy == "deepspeed":
        import_deepspeed()  # before accelerate imports it (common.launch.internals)
        if on_cpu_host:
            cpu_host.skip_shm_comm_build()
    # pp: the pipeline's own Accelerator, with the launched config's stages and schedule (common.parallel.pipeline)
    accelerator_class = (accelerator_classes or {}).get(strategy)
    if accelerator_class is None and strategy == "pp":
        raise RuntimeError("the pipeline's Accelerator was not passed to build_accelerator (common.run passes it)")
    accelerator = (accelerator_class or Accelerator)(**kwargs)
    if strategy == "deepspeed":
        if args.torch_compile and accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise UsageError(
                "--torch_compile under ZeRO-3: DeepSpeed's parameter hooks make torch.compile recompile "
                "every layer for each submodule, then fall back to eager; use fsdp.yaml (FSDP2 compiles "
                "per layer) or zero2.yaml, or drop --torch_compile"
            )
        _clip_with_max_grad_norm(accelerator.state.deepspeed_plugin, args.max_grad_norm)
        _size_buckets_to_model(accelerator.state.deepspeed_plugin, hidden_size)
        _quiet_deepspeed_collective_warnings()
    if on_cpu_host:
        cpu_host.adapt(accelerator, strategy)
    if accelerator.num_processes != launched_world_size():
        raise RuntimeError(
            f"accelerate launched {launched_world_size()} processes but this rank sees "
            f"{accelerator.num_processes} ({accelerator.distributed_type}); each rank would train alone"
        )
    return accelerator, Launch(strategy, requested_precision, sync_each_micro_batch)


def dynamo_plugin(speed):
    """accelerate's regional compilation with inductor for --torch_compile (`speed`: the speed options), else None."""
    if not speed.torch_compile:
        return None
    from accelerate.utils import TorchDynamoPlugin

    # Every region (each layer, the embeddings, the head) is compiled through one accelerate
    # function, so they share its compile budget (8 by default): with the variants evaluation adds
    # (no grad, other shapes) it runs out and later regions fall back to eager with a warning.
    allow_recompiles(64)
    return TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)


def _clip_with_max_grad_norm(plugin, max_grad_norm: float) -> None:
    """DeepSpeed clips inside its step with its config's `gradient_clipping` and ignores the
    norm the loop passes: set it from --max_grad_norm (0 = no clipping), and refuse a config
    that names another value rather than train with a threshold nobody asked for."""
    config = plugin.deepspeed_config
    configured = config.get("gradient_clipping", "auto")
    if configured not in ("auto", None) and not math.isclose(float(configured), max_grad_norm):
        raise UsageError(
            f"the DeepSpeed config sets gradient_clipping: {configured} but --max_grad_norm is "
            f'{max_grad_norm}; remove gradient_clipping from the config (or set it to "auto") so '
            "--max_grad_norm decides, or pass the same value to both"
        )
    config["gradient_clipping"] = float(max_grad_norm)
    plugin.gradient_clipping = float(max_grad_norm)


BUCKET_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
# ZeRO-3 steps its optimizer one sub-group of this many partition elements at a time, each with an
# fp32 copy of the sub-group's gradients made for the step and freed after it. DeepSpeed's default
# (1e9) makes that copy the rank's whole partition at once (4Ψ/N, plus the bf16 flatten it is
# made from); at 1e7 it is at most ~60 MB, and a step has more, smaller optimizer calls.
ZERO3_SUB_GROUP_SIZE = 10_000_000
ZERO3_DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's, when a config sets none
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters and _reuse_distance


def zero3_max_live_parameters(hidden_size: int) -> int:
    """Two transformer layers' elements (about 12 h^2 each: attention 4 h^2, the MLP 8 h^2), at most
    DeepSpeed's default, for both stage3_max_live_parameters and stage3_max_reuse_distance. With the
    defaults (1e9 each, more than a whole model below 1B parameters), once ZeRO-3's trace is complete
    (from the second step on) parameters prefetched or due again within 1e9 elements stay gathered
    across the forward and backward: +183 MB per rank at 101M on 2 processes, bf16, a peak the first
    step never shows (1396 -> 1579 MB; either bound alone leaves it). With both at two layers
    (25M elements there) the whole run's peak is 1452 MB, 0.59x DDP's."""
    return min(24 * hidden_size * hidden_size, DEEPSPEED_MAX_LIVE_PARAMETERS)


def _size_buckets_to_model(plugin, hidden_size: int | None = None) -> None:
    """Bucket sizes the DeepSpeed config leaves unset become "auto", which accelerate sizes from
    the model's hidden size h at prepare (h*h elements to reduce, 0.9*h*h to prefetch, 10*h to
    keep whole), as the HF Trainer's configs do. DeepSpeed's own defaults are fixed: ZeRO-3
    allocates a 500M-element reduce bucket (1 GB in bf16) on every rank whatever the model's
    size, which the memory account found (`common.training.memory`). Under ZeRO-3 an unset
    sub_group_size becomes ZERO3_SUB_GROUP_SIZE (the HF docs' advice for an out-of-memory in
    the optimizer step: 0.63x -> 0.57x DDP's peak per rank at 101M on 2 processes), and an unset
    stage3_max_live_parameters and stage3_max_reuse_distance two layers' worth (`zero3_max_live_parameters`)."""
    zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
    for key in BUCKET_KEYS:
        zero.setdefault(key, "auto")
    if zero.get("stage") == 3:
        zero.setdefault("sub_group_size", ZERO3_SUB_GROUP_SIZE)
        if hidden_size:
            for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
                zero.setdefault(key, zero3_max_live_parameters(hidden_size))


def zero3_sub_group_size(plugin) -> int | None:
    """The sub-group size a ZeRO-3 run steps its optimizer in (None for any other strategy)."""
    zero = plugin.deepspeed_config.get("zero_optimization", {}) if plugin is not None else {}
    return int(float(zero.get("sub_group_size", ZERO3_DEFAULT_SUB_GROUP_SIZE))) if zero.get("stage") == 3 else None


def _quiet_deepspeed_collective_warnings() -> None:
    """DeepSpeed calls torch's `reduce_scatter_tensor`/`all_gather_into_tensor`, which torch
    deprecates with a FutureWarning that repeats at every call (something in the step resets
    the warnings registry): 228 lines per rank in 12 ZeRO-3 steps of the tiny model. Nothing
    a user of these recipes can act on, so it is filtered; every other warning still shows."""
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    )


def declare_micro_batch(accelerator: Accelerator, per_device: int) -> None:
    """For a recipe that prepares no data loader (GRPO: its batches are its rollouts): DeepSpeed's engine needs the
    micro-batch size, which accelerate otherwise reads from the prepared loader. A no-op for other strategies."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("train_micro_batch_size_per_gpu") in (None, "auto"):
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = per_device


def unwrap(accelerator: Accelerator, model):
    """The model itself, out of its DDP/DeepSpeed wrapper and uncompiled (same parameters). With
    --torch_compile under DDP, accelerate's own unwrap (keeping the compiled regions) returns the
    DDP wrapper of the compiled copy, which has no save_pretrained or config. A run outside DeepSpeed's
    configs never imports deepspeed (build_accelerator)."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def import_deepspeed() -> None:
    """Import deepspeed with mlflow hidden from its autotuner (which the recipes never run): 0.8 s
    of every process's start where mlflow is installed. mlflow stays importable (--report_to mlflow)."""
    if "deepspeed" in sys.modules or importlib.util.find_spec("deepspeed") is None:  # imported, or not installed
        return
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError
    try:
        importlib.import_module("deepspeed")
    finally:
        if hide and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


def participating_processes(accelerator: Accelerator) -> int:
    """Count the ranks that really take part, by an all-reduce (not by reading a setting)."""
    one = torch.ones(1, device=accelerator.device)
    return int(accelerator.reduce(one, reduction="sum").item())
