"""Expert parallelism from the config (ep.yaml, fsdp_ep.yaml): a mixture-of-experts model's experts split over ranks.

ep.yaml is fsdp.yaml with `parallelism_config_ep_size` = the number of processes: the dense weights (attention,
embeddings, norms, routers, the head) are sharded by FSDP2 as under fsdp.yaml, and each rank holds whole experts,
num_experts / ep_size of them, as torchtitan and transformers' own expert parallelism lay them out. Each MoE layer
sends every (token, chosen expert) pair to the rank that holds the expert and brings the result back, by two
all-to-alls over the ranks (transformers' `ep_dispatch_experts` style and its all-to-all implementation, applied
by the model's own expert-parallel plan, `base_model_ep_plan`). The experts' stacked weights are DTensors split by
expert (Shard(0)) over the same mesh FSDP2 shards the rest on: the optimizer, the gradient clipping, the DCP
checkpoints (which resume under fsdp.yaml and back) and the export's gather treat them as they treat the rest.

fsdp_ep.yaml (torchtitan's 2-D layout) sets an ep_size that divides the processes: groups of ep_size consecutive
ranks each split the experts as ep.yaml does (the all-to-alls stay inside a group), and each experts module is
FSDP2-sharded over the num_processes / ep_size ranks that hold the same experts, on a mesh of its own (expert_shard
x ep), gathered for its forward and backward in the dense weights' compute dtype.

The gradients: FSDP2 averages the dense ones over the ranks; an expert's gradient arrives on its rank summed over
its ep group's tokens (the all-to-all's backward), so it is divided by the number of ranks here (under fsdp_ep.yaml
after the sum over its shards' ranks, FSDP2's divide factor), and the run trains as one process on the same global
batch does. accelerate's ParallelismConfig has no expert axis, so the size is read from the launched config, as the
pipeline's is (common.launch.mesh).
"""

from __future__ import annotations

from common.launch.errors import UsageError
from common.launch.mesh import launched_mesh_size


def size() -> int:
    """The launched config's ep_size (1: no expert parallelism)."""
    return launched_mesh_size("ep")


def enabled() -> bool:
    return size() > 1


def check_arguments(arguments: tuple) -> None:
    """What an expert-parallel run cannot do, refused before anything is built."""
    if not enabled():
        return
    for args in arguments:
        if getattr(args, "auto_find_batch_size", False):
            raise UsageError(
                "--auto_find_batch_size under expert parallelism: each rank would retry its own trial batches while "
                "every MoE layer's all-to-all needs all of them in step; set --per_device_train_batch_size"
            )
        if getattr(args, "torch_compile", False):
            raise UsageError(
                "--torch_compile under expert parallelism: the all-to-all reads its split sizes back to the host in "
                "every MoE layer, which these recipes do not compile; leave out --torch_compile"
            )
        if getattr(args, "use_peft", False):
            raise UsageError(
                "--use_peft under expert parallelism: LoRA's adapters on the experts' stacked weights would span "
                "experts held by other ranks, which these recipes do not support; use fsdp.yaml or zero3.yaml for "
                "LoRA on a mixture-of-experts model"
            )
        if getattr(args, "adapter_name_or_path", None):
            raise UsageError(
                "--adapter_name_or_path under expert parallelism: the experts are split in the base model, not in a "
                "peft wrapper; merge the adapter first (a --save_merged_model run's final_merged/) and pass that "
                "folder as --model_name_or_path"
            )


def resolved_plan(model, ep: int) -> dict:
    """The model's expert-parallel plan, one rule per module or parameter (transformers' `base_model_ep_plan`
    expanded), or {} where it has none."""
    from transformers.distributed import DistributedConfig

    from common.launch.internals import resolved_parallel_plans

    try:
        return resolved_parallel_plans(model, DistributedConfig(ep_size=ep, fsdp_size=ep))[1]
    except ValueError:
        return {}


def dispatched(plan: dict) -> list[str]:
    """The experts modules a resolved plan splits (transformers' `ep_dispatch_experts` style)."""
    return [name for name, style in plan.items() if style == "ep_dispatch_experts"]


def model_problems(model, ep: int, plan: dict | None = None) -> list[str]:
    """Why `model` (real or on the meta device) cannot have its experts split over ep ranks, one line each: a dense
    model, a MoE without a plan in transformers, experts that ep does not divide. `make check-config` asks it too;
    `plan`: the model's resolved plan where the caller has it."""
    names = dispatched(resolved_plan(model, ep) if plan is None else plan)
    if not names:
        return [
            f"ep_size {ep}: {type(model).__name__} has no experts to split (a dense model, or a mixture-of-experts "
            "model transformers gives no expert-parallel plan); use fsdp.yaml, or a MoE model with one (Qwen3-MoE, "
            "Mixtral, OLMoE, gpt-oss, ...)"
        ]
    count = getattr(model.get_submodule(names[0]), "num_experts", 0)
    if count % ep:
        return [
            f"ep_size {ep}: the model's {count} experts per layer do not divide over {ep} ranks; set an ep_size that "
            f"divides {count} (ep.yaml: the number of processes; fsdp_ep.yaml: a divisor of it)"
        ]
    return []


def shard(model, state=None):
    """Split `model`'s experts (whole on each rank) over the ranks FSDP2 will shard the rest on, or over groups of
    ep_size of them (fsdp_ep.yaml: each experts module then FSDP2-sharded over the groups here): each rank keeps its
    experts' rows of the stacked weights, and each experts module exchanges its tokens by all-to-all. accelerate's
    FSDP2 is told to leave the experts to this (its ignored_modules)."""
    from accelerate.state import AcceleratorState
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    state = state or AcceleratorState()
    ep, plugin = size(), state.fsdp_plugin
    if isinstance(plugin.ignored_modules, str):
        raise UsageError(
            "fsdp_ignored_modules beside parallelism_config_ep_size: the experts are left out of FSDP2 here (they "
            "are split by expert); remove fsdp_ignored_modules from the config"
        )
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        raise UsageError(
            "fsdp_offload_params: true beside parallelism_config_ep_size: the split experts stay on the device while "
            "FSDP2 offloads the rest, which these recipes do not support; set fsdp_offload_params: false (ep.yaml)"
        )
    plan = resolved_plan(model, ep)
    problems = model_problems(model, ep, plan)
    if problems:
        raise UsageError(f"parallelism_config_{problems[0]}")
    mesh = state.device_mesh["dp_shard"]  # the mesh FSDP2 shards the dense weights on (dp_shard_size = num_processes)
    world = mesh.size()
    if ep == world:  # ep.yaml: each rank holds its experts whole
        ep_mesh, expert_shards = mesh, None
    else:  # fsdp_ep.yaml: ep consecutive ranks split the experts; each expert FSDP2-sharded over world / ep ranks
        grid = init_device_mesh(mesh.device_type, (world // ep, ep), mesh_dim_names=("expert_shard", "ep"))
        ep_mesh, expert_shards = grid["ep"], grid["expert_shard"]
        # gathered and reduced in the dtypes FSDP2 gives the dense weights (bf16 under the shipped configs); their
        # inputs left as the layer hands them, as under ep.yaml (the routing weights not cast)
        mixed = plugin.mixed_precision_policy
        policy = MixedPrecisionPolicy(
            **({"param_dtype": mixed.param_dtype, "reduce_dtype": mixed.reduce_dtype} if mixed else {}),
            cast_forward_inputs=False,
        )
    if state.mixed_precision != "no":  # fp32 master weights, as accelerate upcasts the rest (a bf16 load included):
        for name in dispatched(plan):  # its in-place upcast would leave a split expert's local rows in bf16
            model.get_submodule(name).float()
    # the ranks that hold one batch: each alone here (transformers' all-to-all splits a batch a tp group shares)
    alone = init_device_mesh(mesh.device_type, (world, 1), mesh_dim_names=("rank", "batch"))["batch"]
    apply_expert_parallelism(model, ep_mesh, alone, plan, ep_implementation="all_to_all")
    model.split_experts = dispatched(plan)
    experts = [model.get_submodule(name) for name in model.split_experts]
    model.expert_split = {"ep_size": ep, "experts_per_rank": experts[0].num_experts}
    for module in experts:
        compute_in_autocast_dtype(module)
        module.expert_rank = ep_mesh.get_local_rank()  # the range of experts this rank holds (Traffic reads it)
        if expert_shards is None:
            for parameter in module.parameters():
                # an expert's gradient is the sum over every rank's tokens: their mean, as FSDP2 averages the rest
                parameter.register_hook(lambda gradient, ranks=ep: gradient / ranks)
            continue
        # by expert where the rank's experts divide over the shards, else (fewer experts than shards) along each
        # expert's rows, as torchtitan does: FSDP2 would pad whole experts
        rows = Shard(0) if module.num_experts % expert_shards.size() == 0 else Shard(1)
        fully_shard(
            module,
            mesh=expert_shards,
            reshard_after_forward=plugin.reshard_after_forward,
            mp_policy=policy,
            shard_placement_fn=lambda parameter, placement=rows: placement,
        )
        # summed over the ep group's tokens by the all-to-all's backward, then reduce-scattered over the expert's
        # shards: divided by every rank (the mean over all tokens, as FSDP2 averages the dense gradients)
        module.set_gradient_divide_factor(float(world))
        module.set_force_sum_reduction_for_comms(True)  # a sum, then the division (gloo has no pre-scaled sum)
    if expert_shards is not None:
        model.expert_split["expert_shards"] = expert_shards.size()
    plugin.ignored_modules = [*(plugin.ignored_modules or []), *experts]
    return model


def reshard_experts_after_forward(model) -> None:
    """A frozen copy's experts (DPO's reference, distill's teacher) that fsdp_ep.yaml FSDP2-sharded as the model
    loaded, with the config's fsdp_reshard_after_forward: resharded after each forward, since no backward would."""
    for name in getattr(model, "split_experts", []):
        module = model.get_submodule(name)
        if hasattr(module, "set_reshard_after_forward"):  # ep.yaml's are whole on their rank, not FSDP2's
            module.set_reshard_after_forward(True)


def compute_in_autocast_dtype(module) -> None:
    """The experts' forward on copies of their weights in autocast's dtype (bf16 under the shipped configs), as
    FSDP2's mixed precision hands the layers it manages theirs: the experts are left out of FSDP2, and transformers'
    grouped matmul, which autocast does not cover, would otherwise compute in their fp32. The copies' gradients
    reach the fp32 weights (the master copy the optimizer steps)."""
    import torch

    from common.launch.internals import parameters_cast_to

    inner = module.forward

    def forward(*args, **kwargs):
        device = next(module.parameters()).device.type
        if not torch.is_autocast_enabled(device):
            return inner(*args, **kwargs)
        with parameters_cast_to(module, torch.get_autocast_dtype(device)):
            return inner(*args, **kwargs)

    module.forward = forward


def describe(model) -> dict:
    """run.json's account of the split: ep_size, the experts each rank holds and, under fsdp_ep.yaml, the ranks each
    expert is sharded over; nothing where the experts are whole."""
    return dict(getattr(model, "expert_split", {}))


class Traffic:
    """What each rank's MoE layers send to other ranks' experts in training, counted from the routing: each (token,
    chosen expert) pair whose expert another rank holds crosses four times (the dispatch and the combine in the
    forward, their gradients in the backward), a hidden-size row in the dtype the layer receives. Each train line
    then carries `all_to_all_mb`: the window's megabytes per rank (their mean over the ranks). Tokens sent to this
    rank's own experts move nothing; the split sizes exchanged first (a few integers a layer) are not counted."""

    def __init__(self, model):
        import torch

        self.sent = torch.zeros((), dtype=torch.float64)
        for name in model.split_experts:
            model.get_submodule(name).register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        import torch

        if not (module.training and torch.is_grad_enabled()):  # evaluation, rollouts, a reference's forward
            return
        names = ("hidden_states", "top_k_index")
        hidden, index = (*args, *(kwargs[name] for name in names[len(args) :]))[:2]
        owners = index // module.num_experts  # each rank holds a contiguous range of num_experts (its own count)
        rank = module.expert_rank
        off_rank = (owners != rank).sum().to(self.sent.device, torch.float64)
        self.sent = self.sent + 4 * off_rank * hidden.shape[-1] * hidden.element_size()

    def figures(self, accelerator) -> dict:
        """The window's megabytes per rank over every rank (all ranks call it: one reduce), then a fresh window."""
        total = accelerator.reduce(self.sent.reshape(1).to(accelerator.device), reduction="sum").item()
        self.sent = self.sent.new_zeros(())
        return {"all_to_all_mb": total / accelerator.num_processes / 2**20}


def traffic(model) -> Traffic | None:
    """A Traffic count on `model` (unwrapped) where its experts are split over the ranks; None otherwise."""
    return Traffic(model) if getattr(model, "split_experts", None) else None
