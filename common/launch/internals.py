"""Every use of another library's private attributes, calls or undocumented layout, with the versions checked.

Each use is one function here (or where `USES` says), listed in `USES` with the library it leans on; `CHECKED` holds
the version range each library was checked on. `tests/test_internals.py` fails, naming the uses, when an installed
version leaves its range (`start_run` warns in one line), and when code outside this module reaches for a private
attribute. After an upgrade: run the suite, fix what broke here, and widen the range."""

from __future__ import annotations

import collections
import contextlib
import functools

import torch
from accelerate import PartialState
from tqdm import tqdm


# library -> (lowest checked, first version not checked)
CHECKED = {
    "torch": ("2.13.0", "2.14"),
    "accelerate": ("1.15.0", "1.16"),
    "transformers": ("5.23.0", "5.24"),
    "deepspeed": ("0.19.8", "0.19.9"),
    "tqdm": ("4.60", "5"),
}


Use = collections.namedtuple("Use", ["library", "what", "why"])
USES = (
    Use(
        "accelerate",
        "Accelerator.step (the accumulation counter)",
        "start_accumulation_window: each window's last micro-batch syncs, epoch ends included",
    ),
    Use(
        "accelerate",
        "PartialState._shared_state['distributed_type']",
        "present_cpu_group_as_multi_gpu: accelerate applies the FSDP plugin only from MULTI_GPU",
    ),
    Use(
        "accelerate",
        "big_modeling._attach_context_parallel_hooks",
        "context_parallel_hooks: a second model (GRPO's reference) drops its attention mask as prepare's does",
    ),
    Use(
        "transformers",
        "integrations.deepspeed._hf_deepspeed_config_weak_ref",
        "without_zero3_init: build a model on one process while a ZeRO-3 config is registered",
    ),
    Use(
        "transformers",
        "PreTrainedModel._init_weights",
        "init_module_weights: seeded initialisation module by module (the same weights under every strategy)",
    ),
    Use(
        "transformers",
        "PreTrainedModel._no_split_modules",
        "declared_layer_classes / declare_layer_classes: the layer classes FSDP wraps",
    ),
    Use("transformers", "PretrainedConfig._attn_implementation", "attention_implementation"),
    Use(
        "transformers", "PreTrainedModel._resolve_parallel_plans", "resolved_tp_plan: a model built here, split by TP"
    ),
    Use(
        "transformers",
        "ReplicateParallel (gone in 5.23)",
        "common/parallel/tensor_parallel.py's provide_replicate_parallel",
    ),
    Use("transformers", "PretrainedConfig._name_or_path", "set_base_model_name"),
    Use(
        "transformers",
        "PreTrainedModel._weight_conversions, _auto_class, _keys_to_ignore_on_save",
        "saves_as_state_dict",
    ),
    Use(
        "transformers",
        "integrations.sdpa_attention.sdpa_attention_forward, masking_utils.sdpa_mask, the mask "
        "function's allow_is_causal_skip keyword",
        "common/data/packing.py's sdpa_varlen_forward: sdpa_varlen and its mask",
    ),
    Use("torch", "_dynamo.config.recompile_limit", "allow_recompiles: the compile budget regional compile shares"),
    Use("torch", "profiler.profile.step_num / current_action", "start_profiler_at: label steps by optimizer step"),
    Use(
        "torch",
        "Module._parameters (swapped for the forward)",
        "local_parameters: a tensor-parallel module's forward on its DTensor parameters' local tensors",
    ),
    Use(
        "torch",
        "DistributedDataParallel._get_ddp_logging_data()['bucket_sizes']",
        "ddp_bucket_bytes: DDP's gradient buckets, held by C++ only",
    ),
    Use("torch", "torch.ops.mkldnn._is_mkldnn_bf16_supported", "cpu_has_bf16_instructions"),
    Use("torch", "fused Adam(W)'s found_inf (GradScaler's protocol)", "skip_step_on_device"),
    Use(
        "torch",
        "_context_parallel's ring attention and its all-gather rotater, DTensor op handlers, sharding rules",
        "ring_attention_on_cpu",
    ),
    Use(
        "deepspeed",
        "the ZeRO optimizers' module path and attribute names (fp32_/fp16_partitioned_groups_flat, "
        "offload_optimizer, single_partition_of_fp32_groups, *bucket*/ipg/grad/fp32/bit16 attributes)",
        "zero_optimizer, master_weights_dtype, zero_attribute_category: the memory account and run.json; "
        "share_zero3_fp32_partitions; common/outputs/portable.py: ZeRO-1/2's Adam state linked before the first step",
    ),
    Use(
        "deepspeed",
        "ZeRO-3 parameter attributes ds_tensor, ds_numel, ds_shape, ds_id",
        "zero3_partition, full_*; common/outputs/portable.py",
    ),
    Use(
        "deepspeed",
        "0.19.8's ZeRO-3 universal load (load_hp_checkpoint_state_from_checkpoint_dir_stage3)",
        "repair_zero3_universal_load: its two faults, put right after loading",
    ),
    Use("tqdm", "tqdm._instances", "close_progress_bars: an error starts its own line"),
    Use(
        "deepspeed",
        "autotuning.autotuner's optional `import mlflow`, run as deepspeed is imported",
        "common/launch/accelerator.py's import_deepspeed: 0.8 s of every process's start where mlflow is installed",
    ),
    Use(
        "accelerate",
        "multi_gpu_launcher / deepspeed_launcher (standard) hand torchrun's namespace to torch.distributed.run.run, "
        "looked up when called, inside the launch's environment",
        "torchrun_adjusted: common/launch/elastic.py's --nnodes MIN:MAX, which accelerate's --num_machines cannot "
        "carry",
    ),
    Use(
        "torch",
        "LocalElasticAgent's worker environment (the variables torchrun gives each rank), StaticTCPRendezvous's "
        "agent store",
        "torchrun_replaced: tests/warm_launcher.py forks the ranks as torchrun would start them (tests/"
        "test_warm_launcher.py compares each rank's environment with a real launch's, per config)",
    ),
    Use(
        "accelerate",
        "utils.other.extract_model_from_parallel imports deepspeed, where installed, to test for its engine "
        "(is_deepspeed_available looked up in utils.other when called)",
        "engine_tests_without_importing_deepspeed: a run outside DeepSpeed's configs never imports it",
    ),
    Use(
        "accelerate",
        "launch_command calls the module's simple_launcher (one process, no torchrun), looked up when called",
        "torchrun_replaced: the warm launcher refuses it (tests/warm_launcher.py)",
    ),
    Use(
        "deepspeed",
        "deepspeed.ops.__compatible_ops__ (the ops it JIT-builds at first use)",
        "skip_deepspeed_op: common/launch/cpu_host.py keeps the CPU backend from building its inference all-reduce",
    ),
    Use(
        "torch",
        "nn.Module._modules (a shallow copy given its own submodule dict)",
        "module_view: common/parallel/pipeline.py's stages run the model's own forward on a view of it",
    ),
    Use(
        "python",
        "argparse.ArgumentParser._actions",
        "parser_actions, parser_option_strings: the keys a recipe YAML may set, the options a command line may",
    ),
)


# ---- accelerate ------------------------------------------------------------------------------
def start_accumulation_window(accelerator) -> None:
    """accelerate syncs at a multiple of the accumulation steps: zeroed at a window's start, its last batch syncs."""
    accelerator.step = 0


def present_cpu_group_as_multi_gpu(distributed_type) -> None:
    """PartialState is shared by every AcceleratorState: set the type in its shared dict."""
    PartialState._shared_state["distributed_type"] = distributed_type


@contextlib.contextmanager
def torchrun_adjusted(adjust):
    """accelerate's launchers call torch.distributed.run.run(args) with torchrun's namespace, built from accelerate's
    own flags, in the environment they export to the workers: `adjust(args)` changes it (and that environment) first.
    Yields a list that holds True once torchrun was called."""
    import torch.distributed.run as torchrun

    original, called = torchrun.run, []

    def run(args):
        called.append(True)
        adjust(args)
        return original(args)

    torchrun.run = run
    try:
        yield called
    finally:
        torchrun.run = original


@contextlib.contextmanager
def torchrun_replaced(start_workers, simple_launch):
    """accelerate's launchers as they are, up to torch.distributed.run.run(args): `start_workers(args)` is called
    there instead, with torchrun's namespace and in the environment the launch exports to its workers (the tests'
    warm launcher forks the ranks itself); accelerate's simple launcher (one process, no torchrun) is
    `simple_launch(args)`."""
    import torch.distributed.run as torchrun
    from accelerate.commands import launch as accelerate_launch

    original = torchrun.run, accelerate_launch.simple_launcher
    torchrun.run, accelerate_launch.simple_launcher = start_workers, simple_launch
    try:
        yield
    finally:
        torchrun.run, accelerate_launch.simple_launcher = original


# ---- transformers ----------------------------------------------------------------------------
def engine_tests_without_importing_deepspeed() -> None:
    """accelerate's unwrap (in prepare, and after) imports deepspeed, where installed, to test whether a DeepSpeed
    engine wraps the model (~0.5 s of a process's start): only a process that imported deepspeed can hold one."""
    import sys

    import accelerate.utils.other as other

    available = other.is_deepspeed_available
    if getattr(available, "imported_only", False):
        return

    def imported_and_available() -> bool:
        return "deepspeed" in sys.modules and available()

    imported_and_available.imported_only = True
    other.is_deepspeed_available = imported_and_available


@contextlib.contextmanager
def without_zero3_init():
    """Under a registered ZeRO-3 config transformers builds every model in deepspeed.zero.Init, whose broadcasts
    need all ranks: one built on one process would hang (accelerate's zero3_init_context_manager)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def init_module_weights(model, module) -> None:
    model._init_weights(module)


def resolved_tp_plan(model, distributed_config) -> dict:  # one rule per module, as from_pretrained(tp_plan=) applies
    return resolved_parallel_plans(model, distributed_config)[0]


def resolved_parallel_plans(model, distributed_config) -> tuple[dict, dict, dict]:  # (tp, ep, fsdp), one rule each
    return model._resolve_parallel_plans(distributed_config)


def declared_layer_classes(model) -> list[str]:
    return list(getattr(model, "_no_split_modules", None) or [])


def declare_layer_classes(model, names: list[str]) -> None:
    model._no_split_modules = names


def attention_implementation(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) or "unknown"


def saves_as_state_dict(model) -> bool:
    """Whether save_pretrained writes the state dict as it is: no weight conversion to revert (MoE experts fused at
    load, renamed keys), no code from the Hub to copy, no keys it leaves out."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    conversions = getattr(model, "_weight_conversions", None)  # None: built from a config, the architecture's table
    conversions = get_model_conversion_mapping(model, add_legacy=False) if conversions is None else conversions
    return not conversions and getattr(model, "_auto_class", None) is None and not model._keys_to_ignore_on_save


def set_base_model_name(model, name: str) -> None:
    model.name_or_path = model.config._name_or_path = name


# ---- torch -----------------------------------------------------------------------------------
def allow_recompiles(count: int) -> None:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, count)


def start_profiler_at(profiler, step: int, action) -> None:
    """Number the profiler's steps by optimizer step (a resumed run starts past 1)."""
    profiler.step_num = step
    profiler.current_action = action


def ddp_bucket_bytes(model) -> int:
    """DDP's gradient buckets (a copy of the gradients unless gradient_as_bucket_view)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(size) for size in str(sizes).split(",") if size.strip())


def cpu_has_bf16_instructions() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def skip_step_on_device(optimizer, found_inf: torch.Tensor) -> None:  # the next fused Adam(W) step is a no-op if 1
    innermost_optimizer(optimizer).found_inf = found_inf


def context_parallel_hooks(model) -> None:
    """What accelerate's prepare does to the model under context parallelism, for a model it does not prepare (a frozen
    reference): its attention layers drop the mask the model builds (for the local chunk) and attend causally."""
    from accelerate.big_modeling import _attach_context_parallel_hooks

    _attach_context_parallel_hooks(model)


def ring_attention_on_cpu() -> None:
    """Torch's ring attention (context parallelism) has CUDA's kernels only: the CPU's too, for fsdp_cp.yaml on gloo."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    dispatch, forward = DTensor._op_dispatcher, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def handler(op, args, kwargs):  # as torch's _sdpa_handler: the ring over the local tensors, DTensors out
        info = dispatch.unwrap_to_op_info(op, args, kwargs)
        dispatch.sharding_propagator.propagate(info)
        named = {**dict(zip((a.name for a in op._schema.arguments), info.local_args)), **info.local_kwargs}
        if named.pop("attn_mask", None) is not None:  # (accelerate's hooks drop the model's: the ring's is causal)
            raise ValueError("context parallelism's ring attention takes no attention mask")
        on_ring = (
            ring._templated_ring_attention
            if op is forward
            else functools.partial(ring._templated_ring_attention_backward, grad_out_name="grad_out")
        )
        return dispatch.wrap(on_ring(info.compute_mesh.get_group(), 2, op, **named), info.output_sharding.output_spec)

    # torch's all-gather rotater, with a blocking all-gather: its asynchronous functional one corrupted the heap on
    # gloo (`malloc(): unaligned tcache chunk detected`, 2 of 2 GRPO RLOO runs under fsdp_cp.yaml; 0 of 3 after)
    def exchange_buffers(self, curr_buffer):
        self._idx += 1
        if self._aggregated_buffer is None:
            local = curr_buffer.contiguous()
            gathered = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(self._pg))]
            torch.distributed.all_gather(gathered, local, group=self._pg)
            self._aggregated_buffer = torch.cat(gathered)

    ring._AllGatherRotater.exchange_buffers = exchange_buffers
    for op, outputs, inputs in ((forward, 2, 3), (backward, 3, 6)):  # out, logsumexp | q, k, v; grads | 6 inputs
        register_op_strategy(op)(
            lambda schema, n=outputs + inputs, first=outputs: expand_to_full_mesh_op_strategy(
                schema.get_mesh_from_args(validate=False), schema, [[Shard(2)] * n], input_index=first
            )
        )
        ring.custom_ops[op] = handler


# ---- deepspeed -------------------------------------------------------------------------------
def skip_deepspeed_op(name: str) -> None:
    """Mark DeepSpeed's op `name` (deepspeed_shm_comm, ...) not compatible with this host, so that DeepSpeed neither
    compiles nor loads it (deepspeed.ops.__compatible_ops__: the dict its op loaders read, kept once probed). Call
    after DeepSpeed is imported."""
    from deepspeed import ops

    ops.__compatible_ops__[name] = False


def innermost_optimizer(optimizer):
    """The torch optimizer updating the weights, under accelerate's and DeepSpeed's `.optimizer` wrappers."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def zero_optimizer(optimizer):
    """DeepSpeed's ZeRO optimizer (holding flat partitions and buckets), if this run has one."""
    while hasattr(optimizer, "optimizer"):
        if type(optimizer).__module__.startswith("deepspeed.runtime.zero"):
            return optimizer
        optimizer = optimizer.optimizer
    return None


def zero3_flat_master_groups(optimizer) -> list:  # ZeRO-3's flat fp32 partitions, one per sub-group ([] elsewhere)
    return list(getattr(zero_optimizer(optimizer), "fp32_partitioned_groups_flat", None) or [])


def share_zero3_fp32_partitions(optimizer) -> None:
    """DeepSpeed 0.19.8's ZeRO-3 means an fp32 model's own partitions to be its fp32 master weights (stage3.py's
    _create_fp32_partitions), but tests `tensor.device == self.device`, the device's name: never equal in torch 2.13,
    so it keeps a second fp32 copy. Share the storage as it means to (the same tensors)."""
    zero = zero_optimizer(optimizer)
    if zero is not None and not getattr(zero, "offload_optimizer", True):
        for master, own in zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat):
            if (
                own is not None
                and master.data_ptr() != own.data_ptr()
                and (master.dtype, master.device, master.shape) == (own.dtype, own.device, own.shape)
            ):
                master.data = own.data  # the optimizer's state and DeepSpeed's ds_id stay on the same tensor


def master_weights_dtype(optimizer):
    """dtype of the weights the optimizer updates: ZeRO keeps them in flat fp32 partitions."""
    zero = zero_optimizer(optimizer)
    for flat in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):  # ZeRO-3, ZeRO-1/2
        if getattr(zero, flat, None):
            return getattr(zero, flat)[0].dtype
    updated = [p for group in innermost_optimizer(optimizer).param_groups for p in group["params"]]
    return updated[0].dtype if updated else None


def zero_attribute_category(attribute: str) -> str:
    """A memory category for a ZeRO optimizer attribute, by DeepSpeed's naming."""
    name = attribute.lower()
    if "ipg" in name or "bucket" in name or ("buffer" in name and "grad" not in name):
        return "communication_buffers"
    rules = (("gradients", ("grad",)), ("master_weights", ("fp32",)), ("parameters", ("fp16", "bit16", "param")))
    return next((category for category, marks in rules if any(mark in name for mark in marks)), "other_tensors")


def zero3_partition(parameter):
    return getattr(parameter, "ds_tensor", None)  # this rank's partition (None: not a ZeRO-3 parameter)


def is_zero3_parameter(parameter) -> bool:
    return hasattr(parameter, "ds_id")


def full_shape(tensor) -> tuple:
    return tuple(getattr(tensor, "ds_shape", tensor.shape))  # ZeRO-3's placeholder; an FSDP2 shard's shape is global


def full_numel(parameter) -> int:
    return getattr(parameter, "ds_numel", parameter.numel())  # ZeRO-3's placeholder is empty


def repair_zero3_universal_load(optimizer, hyperparameters: list) -> None:
    """Two faults of DeepSpeed 0.19.8's ZeRO-3 universal load (losses left the uninterrupted run's from the second
    step after resuming): every parameter group got the first group's hyperparameters (the norms and biases, weight
    decay 0, got 0.01), and every group's state one shared `step` tensor, which AdamW increments in place once per
    group. Each gets its own back (`hyperparameters`, taken before loading); harmless where the load is right."""
    inner = innermost_optimizer(optimizer)
    for group, before in zip(inner.param_groups, hyperparameters):
        group.update(before)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


# ---- tqdm, argparse --------------------------------------------------------------------------
def close_progress_bars() -> None:
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def parser_actions(parser) -> dict:
    """dest -> action of every option an argparse parser knows."""
    return {action.dest: action for action in parser._actions}


def parser_option_strings(parser) -> set:
    """Every option string an argparse parser takes (a bool field's --x and --no_x share one dest)."""
    return {option for action in parser._actions for option in action.option_strings}


# ---- torch.nn --------------------------------------------------------------------------------
def module_view(module: torch.nn.Module, **replaced) -> torch.nn.Module:
    """A shallow copy of `module` sharing its parameters and code, some of its submodules replaced (None: left out)."""
    import copy
    import types

    view = copy.copy(module)
    view.__dict__["_modules"] = {**module._modules, **replaced}
    bound = module.__dict__.get("forward")  # a forward set on the instance (a wrapper's): it must run the view
    if bound is not None and getattr(bound, "__self__", None) is module:
        view.__dict__["forward"] = types.MethodType(bound.__func__, view)
    return view


@contextlib.contextmanager
def local_parameters(module, partial_gradients: bool = False):
    """`module`'s DTensor parameters swapped for their local tensors during a forward (as transformers' own
    tensor-parallel styles run), then put back; with `partial_gradients` their gradients come back Partial, so that
    DTensor sums them over the mesh (a norm that sees one rank's heads: Qwen3's q_norm and k_norm)."""
    from torch.distributed.tensor import DTensor, Partial

    whole = {name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    module._parameters.update(
        {
            name: p.to_local(grad_placements=[Partial()] * p.device_mesh.ndim if partial_gradients else None)
            for name, p in whole.items()
        }
    )
    try:
        yield
    finally:
        module._parameters.update(whole)


@contextlib.contextmanager
def parameters_cast_to(module, dtype):
    """`module`'s own parameters swapped for copies in `dtype` during a forward (their gradients reach the originals),
    then put back: the compute dtype FSDP2's mixed precision gives the modules it manages, for one it does not."""
    originals = {name: p for name, p in module._parameters.items() if p is not None}
    module._parameters.update({name: p.to(dtype) for name, p in originals.items()})
    try:
        yield
    finally:
        module._parameters.update(originals)
