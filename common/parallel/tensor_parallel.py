"""Tensor parallelism from the config (tp.yaml, fsdp_tp.yaml): the model split by its plan, and its checkpoints.

The model is built as under any strategy (the same seeded initialisation, or the pretrained
weights), then each rank keeps its slice of every layer's weights by transformers' own
tensor-parallel plan for the model (`base_model_tp_plan`: attention heads and MLP columns split,
the outputs all-reduced), over the tp dimension of accelerate's device mesh. accelerate's
`save_state` cannot save such a model (its safetensors writer refuses DTensors; its pickle keeps
rank 0's slices only), so a checkpoint is torch's distributed checkpoint, in the folders and keys
accelerate's FSDP2 writes (`pytorch_model_fsdp_0/`, `optimizer_0/`): FSDP2 and tensor-parallel runs
resume each other's checkpoints (DCP re-slices on load), and `common.outputs.portable` reads them for the rest.
"""

from __future__ import annotations

import os

from common.launch.accelerator import unwrap
from common.launch.errors import UsageError
from common.launch.internals import innermost_optimizer
from common.launch.mesh import tensor_shards


def enabled(state=None) -> bool:
    """The run's Accelerator (its `state`, or the one built in this process) has tensor parallelism (tp_size > 1)."""
    if state is None:
        from accelerate.state import AcceleratorState, is_initialized

        if not is_initialized():  # a model built outside a run (a script, a test)
            return False
        state = AcceleratorState()
    return tensor_shards(state) > 1


def check_arguments(arguments: tuple) -> None:
    """What a tensor-parallel run cannot do, refused before anything is built."""
    for args in arguments:
        if getattr(args, "use_peft", False):
            raise UsageError(
                "--use_peft under tensor parallelism: LoRA's adapters would wrap projections the "
                "plan splits across ranks, which these recipes do not support; use a data-parallel "
                "config (ddp.yaml, fsdp.yaml, zero3.yaml) for LoRA"
            )
        if getattr(args, "adapter_name_or_path", None):
            raise UsageError(
                "--adapter_name_or_path under tensor parallelism: the plan splits the base model's "
                "layers, not a peft wrapper's; merge the adapter first (a --save_merged_model run's "
                "final_merged/) and pass that folder as --model_name_or_path"
            )
        if getattr(args, "streaming", False):
            raise UsageError(
                "--streaming under tensor parallelism: a stream deals its documents to every rank, "
                "while a tensor-parallel group must see the same batch; leave out --streaming (the "
                "data is then indexed and shared by the group) or use a data-parallel config"
            )


def model_problems(model, size: int) -> list[str]:
    """Why `model` (real or on the meta device) cannot be split over tp_size `size`, one line each: no plan in
    transformers, tied embeddings, heads that do not divide. `make check-config` asks it before a launch."""
    config, name = model.config.get_text_config(), type(model).__name__
    if not model.tp_plan:
        return [
            f"tp_size {size}: {name} cannot be split for tensor parallelism: transformers has no tensor-parallel "
            "plan for it; use a model whose class has one (Llama, Mistral, Qwen, Gemma, ...) or a data-parallel "
            "config"
        ]
    tied = tied_head(model)
    rules = [model.tp_plan.get(module) or "" for module in tied or ()]
    if tied and not (rules[0] == "embedding_rowwise" and rules[1].startswith("colwise")):
        return [
            f"tp_size {size}: {name} ties its input embeddings to its output head (tie_word_embeddings), and its "
            "tensor-parallel plan does not split both by vocabulary rows, as splitting the one weight once needs; "
            "use fsdp.yaml or zero3.yaml"
        ]
    return [
        f"tp_size {size}: the model has {heads} {key.removeprefix('num_').replace('_', ' ')}, which do not divide "
        "by it; pick a tp_size that divides them (parallelism_config_tp_size in the accelerate config)"
        for key in ("num_attention_heads", "num_key_value_heads")
        if isinstance(heads := getattr(config, key, None), int) and heads % size
    ]


def tied_head(model) -> tuple[str, str] | None:
    """(the input embeddings' module name, the output head's) when the head's weight is the embeddings' (tied)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None or getattr(head, "weight", None) is not embeddings.weight:
        return None
    names = {module: name for name, module in model.named_modules(remove_duplicate=False)}
    return names[embeddings], names[head]


def shard(model, state=None):
    """Split `model` (whole on each rank, on its device) by its tensor-parallel plan over the tp mesh."""
    from accelerate.state import AcceleratorState
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from common.launch.internals import resolved_tp_plan

    state = state or AcceleratorState()
    size = state.parallelism_config.tp_size
    problems = model_problems(model, size)
    if problems:
        raise UsageError(problems[0])
    distributed = DistributedConfig(tp_size=size)
    try:
        plan = resolved_tp_plan(model, distributed)
    except ValueError as error:  # a plan transformers cannot apply to this model
        raise UsageError(
            f"{type(model).__name__} cannot be split for tensor parallelism ({error}); use a "
            "data-parallel config (fsdp.yaml, zero3.yaml)"
        ) from None
    tied = tied_head(model)
    if tied:  # one weight, listed once among the parameters: split once (vocabulary rows, as both rules split it)
        plan = {rule: style for rule, style in plan.items() if rule != f"{tied[1]}.weight"}
    # A norm between a column- and a row-split layer (Qwen3's q_norm, k_norm) sees this rank's heads only: its weight
    # stays whole, its gradient a partial sum. transformers all-reduces it by a hook on a plain parameter, which fails
    # once the weight is a Replicate DTensor (below, or accelerate's under FSDP x TP): the module is left to the
    # replicated style here, which marks the gradient partial so that DTensor sums it over the tp ranks.
    modules = dict(model.named_modules())
    for name in [rule for rule, style in plan.items() if style == "replicated_with_grad_allreduce"]:
        modules[name if name in modules else name.rpartition(".")[0]].gradient_is_partial = True  # module or weight
        del plan[name]
    apply_tensor_parallelism(model, state.device_mesh["tp"], plan)
    if tied:  # the head reads the split weight again: one parameter, its gradient summed from both uses
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if getattr(state, "fsdp_plugin", None) is not None:  # FSDP x TP: accelerate makes the unsplit parameters DTensors
        provide_replicate_parallel()
    else:  # as accelerate does under FSDP x TP: one optimizer group (fused AdamW, clipping) may not mix the kinds
        replicate_unsplit_parameters(model, state.device_mesh["tp"])
    model.config.distributed_config = distributed  # what accelerate reads the model's tp size from
    return model


def replicate_unsplit_parameters(model, mesh) -> None:
    """The parameters the plan leaves whole (norms, biases of row-split layers, a classifier's head) become
    Replicate DTensors over the tp mesh, their modules running on the local tensors as the plan's own do."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    style = _replicate_parallel()()
    for name, parameter in list(model.named_parameters()):
        if isinstance(parameter, DTensor):
            continue
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        style.prepare_module_tp(module, mesh)
        replicated = DTensor.from_local(parameter.data, mesh, [Replicate()], run_check=False)
        setattr(module, attribute, torch.nn.Parameter(replicated, requires_grad=parameter.requires_grad))


def provide_replicate_parallel() -> None:
    """accelerate 1.15 makes FSDP x TP's unsplit parameters (norms) Replicate DTensors with transformers' former
    ReplicateParallel, gone from 5.23: the same, as 5.23's styles do it (forward on the local tensors)."""
    from transformers.integrations import tensor_parallel as old_home

    if not hasattr(old_home, "ReplicateParallel"):
        old_home.ReplicateParallel = _replicate_parallel()


def _replicate_parallel():
    """A transformers TP style for a module whose parameters are Replicate DTensors: forward on their local tensors."""
    from transformers.distributed import tensor_parallel

    class ReplicateParallel(tensor_parallel.TensorParallelLayer):
        def should_use_local_tensors(self, module):
            return True

        def context_around_forward(self, module, mesh):
            """The forward on the parameters' local tensors; a module whose gradient is a partial sum (it sees this
            rank's heads only: `shard`) hands DTensor a Partial gradient, summed over the tp ranks."""
            from common.launch.internals import local_parameters

            return local_parameters(module, partial_gradients=getattr(module, "gradient_is_partial", False))

        def prepare_module_tp(self, module, mesh):
            if not getattr(module, "replicated_forward", False):
                self.install_forward(module, mesh)
                module.replicated_forward = True

    return ReplicateParallel


def save_state(accelerator, model, optimizer, scheduler, folder: str) -> None:
    """Every rank: its slices of the weights and Adam states (DCP), the schedule, and its RNG state."""
    import torch.distributed.checkpoint as dcp
    from accelerate.checkpointing import save_accelerator_state
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, moments = get_state_dict(unwrap(accelerator, model), innermost_optimizer(optimizer))
    dcp.save({"model": weights}, checkpoint_id=os.path.join(folder, "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": moments}, checkpoint_id=os.path.join(folder, "optimizer_0"))
    save_accelerator_state(
        folder, [], [], [scheduler], [], accelerator.process_index, accelerator.step, scaler=accelerator.scaler
    )  # fp16's loss scale, as accelerate's save_state keeps it


def load_state(accelerator, model, optimizer, scheduler, folder: str) -> None:
    """What `save_state` wrote, into this run's slices (DCP re-slices a checkpoint of another layout)."""
    import torch.distributed.checkpoint as dcp
    from accelerate.checkpointing import load_accelerator_state
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    module, inner = unwrap(accelerator, model), innermost_optimizer(optimizer)
    weights, moments = get_state_dict(module, inner)
    dcp.load({"model": weights}, checkpoint_id=os.path.join(folder, "pytorch_model_fsdp_0"))
    dcp.load({"optimizer": moments}, checkpoint_id=os.path.join(folder, "optimizer_0"))
    set_state_dict(module, inner, model_state_dict=weights, optim_state_dict=moments)
    load_accelerator_state(folder, [], [], [scheduler], [], accelerator.process_index, scaler=accelerator.scaler)
