"""A parallelism_config's mesh: its sizes (the pipeline's read from the launched config) and the data-parallel view.

`mesh_problems` holds the rules once, for `make check-config` (reading the YAML) and for a launched run
(reading what the launcher exported, common.launch.accelerator).

Under tensor parallelism (tp.yaml, fsdp_tp.yaml) and context parallelism (fsdp_cp.yaml) the ranks
of a group are handed the same batch (accelerate hands it to each of them), so a sum over every
rank counts each example as often and a gather returns it as often. The recipes' counts, metrics
and evaluations go through these instead: over the data-parallel ranks only, whatever the mesh (the
same as accelerate's own calls where there is no tensor parallelism)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import os
from dataclasses import dataclass

import torch
from accelerate.utils import recursively_apply

from common.launch.errors import UsageError


# pp: common.parallel.pipeline's, ep: common.parallel.expert_parallel's (accelerate has neither); ep borrows its ranks
# from dp_shard (the experts split over the ranks that shard the rest), so it adds no processes to the world
DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "cp", "sp", "pp", "ep")


def mesh_problems(
    sizes: dict, world: int, distributed_type: str, fsdp2: bool, efficient_loading: bool, zero_stage: int | None = None
) -> list[str]:
    """`sizes`: each dimension's size (DIMENSIONS); `world`: the processes launched (num_processes);
    `distributed_type`: the config's (MULTI_GPU, FSDP, DEEPSPEED, ...); `fsdp2`: FSDP with fsdp_version 2;
    `efficient_loading`: fsdp_cpu_ram_efficient_loading; `zero_stage`: DeepSpeed's, where known. Each problem
    is one line that says what to do."""
    problems = []
    if sizes.get("cp", 1) > 1 and not fsdp2:
        problems.append(
            f"parallelism_config_cp_size {sizes['cp']}: context parallelism (torch's ring attention) runs "
            f"under FSDP2, not {distributed_type}: use fsdp_cp.yaml as the template"
        )
    elif sizes.get("cp", 1) > 1 and sizes.get("tp", 1) > 1:
        problems.append(
            "parallelism_config_cp_size beside parallelism_config_tp_size: these recipes run context "
            "parallelism over data-parallel ranks only; set tp_size 1 (fsdp_cp.yaml)"
        )
    if sizes.get("sp", 1) > 1 and distributed_type != "DEEPSPEED":
        problems.append(
            f"parallelism_config_sp_size {sizes['sp']}: sequence parallelism (Ulysses) runs under "
            f"DeepSpeed, not {distributed_type}: use zero3_ulysses.yaml as the template"
        )
    elif sizes.get("sp", 1) > 1 and zero_stage not in (None, 3):
        # seen in a probe: under ZeRO-1/2 DeepSpeed averages gradients over dp / sp_size ranks, not over all of them
        problems.append(
            f"parallelism_config_sp_size {sizes['sp']} with ZeRO stage {zero_stage}: the recipes' "
            "sequence parallelism is proven under ZeRO-3 only (under ZeRO-1/2 DeepSpeed scales the "
            "gradients otherwise); set zero_stage: 3, as zero3_ulysses.yaml does"
        )
    elif sizes.get("sp", 1) > 1 and sizes.get("tp", 1) > 1:
        problems.append(
            "parallelism_config_sp_size beside parallelism_config_tp_size: these recipes run sequence "
            "parallelism over data-parallel ranks only; set tp_size 1 (zero3_ulysses.yaml)"
        )
    problems += expert_parallel_problems(sizes, world, distributed_type, fsdp2, efficient_loading)
    pp = sizes.get("pp", 1)
    if pp > 1:
        others = [f"{name}_size" for name in DIMENSIONS if name not in ("pp", "ep") and sizes.get(name, 1) > 1]
        if distributed_type != "MULTI_GPU":
            problems.append(
                f"parallelism_config_pp_size {pp}: pipeline parallelism runs under distributed_type MULTI_GPU "
                f"(pp.yaml), not {distributed_type}"
            )
        elif others:
            problems.append(
                f"parallelism_config_pp_size beside {', '.join(others)}: these recipes run pipeline parallelism "
                "with data-parallel replicas only (num_processes / pp_size of them); leave the other sizes at 1"
            )
        if world % pp:
            problems.append(
                f"parallelism_config_pp_size {pp} does not divide num_processes {world}: launch a multiple of "
                f"{pp} processes (each {pp} of them one pipeline, num_processes / {pp} data-parallel replicas)"
            )
        return problems
    product = math.prod(sizes.get(name, 1) for name in DIMENSIONS if name != "ep")
    if product != world:
        named = (
            " x ".join(f"{name}_size {sizes[name]}" for name in DIMENSIONS if name != "ep" and sizes.get(name, 1) > 1)
            or "1"
        )
        problems.append(
            f"parallelism_config: {named} = {product} processes but num_processes is {world}; make the "
            "sizes multiply to num_processes (HSDP: dp_replicate_size = nodes, dp_shard_size = GPUs per "
            "node; tp.yaml: tp_size = num_processes; zero3_ulysses.yaml: dp_shard_size = num_processes / "
            "sp_size; fsdp_cp.yaml: dp_shard_size = num_processes / cp_size; pp.yaml: its pipeline size is read "
            "from the config file of the `accelerate launch --config_file ...` that started the run)"
        )
    ulysses = distributed_type == "DEEPSPEED" and sizes.get("sp", 1) > 1  # its dp_shard: the other ranks' ZeRO
    if (sizes.get("dp_replicate", 1) > 1 or sizes.get("dp_shard", 1) > 1 and not ulysses) and not fsdp2:
        problems.append(
            "parallelism_config's dp_replicate_size and dp_shard_size need distributed_type FSDP "
            "(fsdp_version 2): use multi_node_hsdp.yaml or fsdp_tp.yaml as the template"
        )
    tp = sizes.get("tp", 1)
    if tp > 1 and distributed_type != "MULTI_GPU" and not fsdp2:
        aside = (
            " (DeepSpeed's own AutoTP is configured in its JSON, not supported by these recipes)"
            if distributed_type == "DEEPSPEED"
            else ""
        )
        problems.append(
            f"parallelism_config_tp_size {tp}: tensor parallelism runs under distributed_type MULTI_GPU "
            f"(tp.yaml) or FSDP2 (fsdp_tp.yaml), not {distributed_type}{aside}"
        )
    elif tp > 1 and fsdp2 and efficient_loading:
        problems.append(
            "fsdp_cpu_ram_efficient_loading: true beside parallelism_config_tp_size: broadcasting rank "
            "0's weights into 2-D (dp_shard x tp) shards fails in accelerate 1.15; set it to false, as "
            "fsdp_tp.yaml does (every rank then builds the model, then keeps its shards)"
        )
    return problems


def expert_parallel_problems(sizes: dict, world: int, distributed_type: str, fsdp2: bool, efficient_loading: bool):
    """What an ep_size asks that these recipes cannot run, one line each (mesh_problems' arguments)."""
    ep = sizes.get("ep", 1)
    if ep <= 1:
        return []
    others = [
        f"{name}_size {sizes[name]}" for name in ("dp_replicate", "tp", "cp", "sp", "pp") if sizes.get(name, 1) > 1
    ]
    if not fsdp2:
        return [
            f"parallelism_config_ep_size {ep}: expert parallelism runs under FSDP2 (the experts split over the ranks "
            f"that shard the rest), not {distributed_type}: use ep.yaml as the template"
        ]
    if others:
        return [
            f"parallelism_config_ep_size beside {', '.join(others)}: these recipes split the experts over the "
            "FSDP2 ranks of one mesh only; leave the other sizes at 1 (ep.yaml)"
        ]
    if ep > world or world % ep:
        return [
            f"parallelism_config_ep_size {ep} with {world} processes: the experts split over groups of ep_size ranks, "
            f"each expert sharded over num_processes / ep_size of them; set parallelism_config_ep_size to a divisor "
            f"of {world} (all {world}: ep.yaml; fewer: fsdp_ep.yaml)"
        ]
    if efficient_loading:
        return [
            "fsdp_cpu_ram_efficient_loading: true beside parallelism_config_ep_size: each rank keeps its experts of "
            "the model it built, which rank 0's broadcast would overwrite; set it to false, as ep.yaml does"
        ]
    return []


# The pipeline (common.parallel.pipeline runs it): accelerate's launcher accepts parallelism_config_pp_size and
# parallelism_config_pp_schedule in a config's parallelism_config block but exports neither, so they are read here,
# beside the sizes it does export.
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
SIZE_KEY, SCHEDULE_KEY = "parallelism_config_pp_size", "parallelism_config_pp_schedule"


@dataclass(frozen=True)
class PipelineSettings:
    size: int  # ranks in one pipeline
    schedule: str  # one of PIPELINE_SCHEDULES
    config_file: str | None = dataclasses.field(default=None, compare=False)  # the file they were read from

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "Interleaved1F1B" else 1

    @property
    def num_stages(self) -> int:
        return self.size * self.stages_per_rank


def pipeline_settings_problems(block: dict) -> list[str]:
    """What a config's parallelism_config block asks of the pipeline that cannot run, one line each."""
    problems = []
    size = block.get(SIZE_KEY, 1)
    if not isinstance(size, int) or size < 1:
        problems.append(f"{SIZE_KEY}: {size!r} is not a number of processes; set it to 2 or more (pp.yaml)")
    schedule = block.get(SCHEDULE_KEY, "1F1B")
    if schedule not in PIPELINE_SCHEDULES:
        problems.append(
            f"{SCHEDULE_KEY}: {schedule!r} is not a schedule these recipes run; use {', '.join(PIPELINE_SCHEDULES)}"
        )
    return problems


def pipeline_settings_in(block: dict) -> PipelineSettings | None:
    """The pipeline a config's parallelism_config block asks for (None: none), or one UsageError line."""
    problems = pipeline_settings_problems(block)
    if problems:
        raise UsageError(problems[0])
    size = block.get(SIZE_KEY, 1)
    return PipelineSettings(size, block.get(SCHEDULE_KEY, "1F1B")) if size > 1 else None


def _ancestors():
    """(command line, working directory) of this process's parent, its parent, ... (Linux /proc)."""
    pid = os.getppid()
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = [part.decode() for part in handle.read().split(b"\0") if part]
            cwd = os.readlink(f"/proc/{pid}/cwd")
            with open(f"/proc/{pid}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return
        yield argv, cwd
        if parent <= 1:
            return
        pid = parent


LAUNCHERS = ("accelerate.commands.launch", "common.launch.elastic")  # `python -m` launchers of a recipe


def config_file_of(argv: list[str], cwd: str) -> str | None:
    """The accelerate config an `accelerate launch` command line uses (accelerate's default file when it names
    none), or None when `argv` is not one. The launcher's own arguments are read by accelerate's parser, so every
    form it takes is read alike (`--config_file X`, `--config-file X`, `--config_file=X`), and a recipe's own
    arguments after the script are never taken for the launcher's."""
    names = [os.path.basename(arg) for arg in argv]
    if "accelerate" in names and "launch" in names[names.index("accelerate") :]:
        rest = argv[names.index("launch", names.index("accelerate")) + 1 :]
    elif "accelerate-launch" in names:
        rest = argv[names.index("accelerate-launch") + 1 :]
    elif any(launcher in argv for launcher in LAUNCHERS):
        at = next(argv.index(launcher) for launcher in LAUNCHERS if launcher in argv)
        rest = argv[at + 1 :]
        if argv[at] == "common.launch.elastic":  # its --nnodes range, which accelerate's parser does not take
            from common.launch.elastic import split_launch_args

            try:
                rest = split_launch_args(rest)[1]
            except UsageError:  # the launcher refused it before any worker started
                return None
    else:
        return None
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import launch_command_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # (argparse's usage text is not this process's to print)
            given = launch_command_parser().parse_known_args(rest)[0].config_file
    except SystemExit:  # accelerate itself would not have launched it
        return None
    return os.path.join(cwd, given) if given else default_config_file


@functools.cache
def launched_parallelism_block() -> tuple[dict, str | None]:
    """The parallelism_config block of the config this process was launched with, and its file. accelerate exports
    the sizes it knows, not the pipeline's nor the experts', so the file is read: the one named by the
    `accelerate launch` that started this process. Only where accelerate says the config has such a block."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return {}, None
    import yaml

    for argv, cwd in _ancestors():
        path = config_file_of(argv, cwd)
        if path is None:
            continue
        try:
            with open(path) as handle:
                return (yaml.safe_load(handle) or {}).get("parallelism_config") or {}, path
        except (OSError, yaml.YAMLError):
            return {}, None
    return {}, None


def launched_pipeline() -> PipelineSettings | None:
    """The pipeline of the config this process was launched with (`launched_parallelism_block`)."""
    block, path = launched_parallelism_block()
    settings = pipeline_settings_in(block)
    return None if settings is None else dataclasses.replace(settings, config_file=path)


EP_SIZE_KEY = "parallelism_config_ep_size"


def expert_parallel_size_in(block: dict) -> int:
    """The ep_size a config's parallelism_config block asks for (1: none), or one UsageError line."""
    size = block.get(EP_SIZE_KEY, 1)
    if not isinstance(size, int) or size < 1:
        raise UsageError(
            f"{EP_SIZE_KEY}: {size!r} is not a number of processes; set num_processes (ep.yaml) or a divisor of it "
            "(fsdp_ep.yaml)"
        )
    return size


def launched_mesh_size(dimension: str) -> int:
    """A parallelism_config dimension's size (tp, cp, sp, dp_shard, dp_replicate) as the launcher exported it; pp's
    and ep's as the launched config file says (accelerate exports neither)."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1
    if dimension == "pp":
        settings = launched_pipeline()
        return settings.size if settings is not None else 1
    if dimension == "ep":
        return expert_parallel_size_in(launched_parallelism_block()[0])
    return int(os.environ.get(f"PARALLELISM_CONFIG_{dimension.upper()}_SIZE", "1"))


def _size(accelerator, dimension: str) -> int:
    config = getattr(accelerator, "parallelism_config", None)  # (a stand-in for one process may have none)
    return getattr(config, f"{dimension}_size", None) or 1


def sequence_shards(accelerator) -> int:
    """How many ranks each train on a share of every row's tokens: sp_size (Ulysses) or cp_size (ring attention),
    else 1 (`accelerator`: an Accelerator or its AcceleratorState)."""
    return ulysses_shards(accelerator) * context_shards(accelerator)


def ulysses_shards(accelerator) -> int:
    """sp_size: the ranks of a Ulysses group, each handed its own batch, each reading a slice of every batch of the
    group in turn (so each loader batch becomes sp_size micro-batches)."""
    return _size(accelerator, "sp")


def tensor_shards(accelerator) -> int:
    """tp_size: the ranks of a tensor-parallel group, handed the same batch, each holding its share of the layers."""
    return _size(accelerator, "tp")


def context_shards(accelerator) -> int:
    """cp_size: the ranks of a context-parallel group, handed the same batch, each train on its share of the rows."""
    return _size(accelerator, "cp")


def pipeline_shards(accelerator) -> int:
    """pp_size: the ranks of a pipeline, handed the same batch, each holding its stages of the model (a
    PipelineAccelerator's: common.parallel.pipeline)."""
    settings = getattr(accelerator, "pipeline", None)  # a PipelineAccelerator's (common.parallel.pipeline)
    return settings.size if isinstance(settings, PipelineSettings) else 1


def replicas(accelerator) -> int:
    """How many ranks are handed each batch: tp_size x cp_size (a tensor- or context-parallel group) or pp_size (a
    pipeline), else 1."""
    return tensor_shards(accelerator) * context_shards(accelerator) * pipeline_shards(accelerator)


def batch_sharers(accelerator) -> int:
    """How many ranks hold each batch that a sampling objective builds itself (GRPO's rollouts): the `replicas`, and
    under sequence parallelism the sp group, whose ranks each score a slice of every row of the group's batch
    (common.parallel.sequence_parallel.split_rows) instead of taking turns with their own batches as a data loader's
    rows do. The group's ranks are consecutive, as for tensor and context parallelism."""
    return replicas(accelerator) * ulysses_shards(accelerator)


def data_parallel_size(accelerator) -> int:
    """The number of different batches each micro-step trains on: processes / replicas, and / sp_size under
    sequence parallelism, where a group's ranks each train on a slice of one batch
    (common.parallel.sequence_parallel)."""
    return accelerator.num_processes // replicas(accelerator) // ulysses_shards(accelerator)


def launched_data_parallel_size() -> int:
    """`data_parallel_size` as the launch set it up, before the accelerator is built (from the launcher's
    environment: the world size over the tp, cp, pp and sp sizes)."""
    replicated = launched_mesh_size("tp") * launched_mesh_size("cp") * launched_mesh_size("pp")
    return int(os.environ.get("WORLD_SIZE", "1")) // replicated // launched_mesh_size("sp")


def data_parallel_share(accelerator, items: list, group: int | None = None) -> list:
    """This rank's share of `items`, split over the data-parallel ranks in contiguous parts of equal length (the
    last padded with the last item, as accelerate's split_between_processes(apply_padding=True) pads), so every
    rank makes as many calls; the ranks of a tensor-parallel group (or of `group` consecutive ranks) get the same
    share."""
    group = group or replicas(accelerator)
    ranks, rank = accelerator.num_processes // group, accelerator.process_index // group
    length = math.ceil(len(items) / ranks) if items else 0
    share = items[rank * length : (rank + 1) * length]
    return share + [items[-1]] * (length - len(share)) if items else share


def reduce_sum(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of what each trained on (tokens, samples, FLOPs), a tensor-parallel group's counted once
    (a context-parallel group's ranks each hold their share of the tokens: common.outputs.metrics divides the
    samples)."""
    total = accelerator.reduce(tensor, reduction="sum")
    group = tensor_shards(accelerator) * pipeline_shards(accelerator)
    return total if group == 1 else total / group


def gather_for_metrics(accelerator, data):
    """`accelerator.gather_for_metrics` over the data-parallel ranks: every evaluation example once.
    With tensor or context parallelism the rows of each group's first rank are kept (ranks are numbered
    with the tp and cp dimensions innermost), then the samples that evened out the last batch are dropped."""
    group = replicas(accelerator)
    if group == 1:
        return accelerator.gather_for_metrics(data)
    gathered = accelerator.gather(data)
    state = accelerator.gradient_state
    keep = state.remainder if state.end_of_dataloader and state.remainder > 0 else None

    def first_of_each_group(tensor):
        rows = tensor.reshape(accelerator.num_processes, -1, *tensor.shape[1:])[::group].flatten(0, 1)
        return rows if keep is None else rows[:keep]

    return recursively_apply(first_of_each_group, gathered)


def check_shared_batch(accelerator, batch: dict, group: int | None = None) -> int:
    """Every rank of each tensor- or context-parallel group (or of each `group` consecutive ranks) holds the same batch
    (a fingerprint of each of its tensors compared over the group), or a RuntimeError: the slices of one layer, or
    of one row, trained on different data would add up to no model at all. Returns the number of groups checked (0
    without such groups)."""
    group = group or replicas(accelerator)
    if group == 1:
        return 0
    mine = torch.stack([_fingerprint(batch[key]) for key in sorted(batch) if torch.is_tensor(batch[key])])
    prints = accelerator.gather(mine[None].to(accelerator.device)).reshape(-1, group, mine.numel())
    differing = [index for index, members in enumerate(prints) if not (members == members[0]).all()]
    if differing:
        raise RuntimeError(
            f"the ranks of tensor/context/sequence-parallel group {differing[0]} were handed different batches; "
            "they must train on the same one (a data loader not prepared by accelerate, or rollouts sampled apart?)"
        )
    return prints.shape[0]


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A number that differs for different values or shapes (position-weighted sum, in float64)."""
    values = tensor.detach().double().flatten()
    return (
        values * torch.arange(1, values.numel() + 1, dtype=torch.float64, device=values.device)
    ).sum() + values.numel()
