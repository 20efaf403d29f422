"""Resuming under another strategy: a checkpoint rewritten per parameter by name, and loaded into any config.

Each strategy saves its own layout: one process and DDP a whole `model.safetensors` and torch's
`optimizer.bin` (its state by position), FSDP2 sharded DCP files keyed by name, DeepSpeed ZeRO
partitions of flat groups. A checkpoint resumed under a config of another family is first
rewritten into `step_N/portable` beside it (the original is left as it is): `model.safetensors`
holds every parameter's fp32 master weight by name, `optimizer.safetensors` its Adam moments
(`<name>.exp_avg`, `<name>.exp_avg_sq`) and `optimizer.json` its step count, next to the
schedule, RNG states, data position and model files, which no strategy shapes. The rewrite
runs once, before the process group starts (`common.outputs.reshard` runs it like a ZeRO conversion),
into a temporary folder renamed into place when complete, so a second resume reuses it and a
crash mid-way leaves nothing half-written. `common.outputs.portable_load` puts it into the run's own layout.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch

from common.launch.errors import UsageError
from common.outputs.run_dir import MODEL_FILES, STATE_FILE


PORTABLE = "portable"
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")


# a strategy (common.launch.accelerator.launched_strategy, common.planning.memory.read_strategy) -> the family whose
# files it writes: one process and DDP write the same ones
FAMILY = {"single": "torch", "ddp": "torch", "fsdp": "fsdp", "tp": "fsdp", "pp": "fsdp", "deepspeed": "deepspeed"}
# what each family's checkpoint files are, in a resume's message (a tp.yaml run writes FSDP2's DCP folders)
FILES = {
    "torch": "whole-model files (single.yaml, ddp.yaml)",
    "fsdp": "DCP shards (fsdp, tp, pp configs)",
    "deepspeed": "DeepSpeed ZeRO files",
    "portable": "a portable rewrite",
}


def family(accelerator) -> str:
    from accelerate.utils import DistributedType

    from common.parallel import pipeline, tensor_parallel

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP or tensor_parallel.enabled(accelerator.state) or pipeline.enabled(accelerator):
        # all three write DCP (common.parallel.tensor_parallel's and common.parallel.pipeline's save_state)
        return "fsdp"
    return "deepspeed" if kind == DistributedType.DEEPSPEED else "torch"


def saved_family(path: str) -> str:
    """The family whose files a checkpoint holds (a portable folder is read by every family)."""
    if is_portable(path):
        return PORTABLE
    if os.path.isdir(os.path.join(path, "pytorch_model")):
        return "deepspeed"
    if os.path.isdir(os.path.join(path, "pytorch_model_fsdp_0")):
        return "fsdp"
    return "torch"


def is_portable(path: str) -> bool:
    return os.path.basename(os.path.normpath(path)) == PORTABLE


def needs_rewrite(path: str | None, this_family: str) -> bool:
    return path is not None and saved_family(path) not in (this_family, PORTABLE)


def optimizer_parameter_names(model, optimizer) -> list[list[str]] | None:
    """The names of each optimizer group's parameters, in order (what one process's and DDP's
    `optimizer.bin` keys by position); None under DeepSpeed, whose groups are flat."""
    from common.launch.internals import innermost_optimizer

    names = {id(parameter): name for name, parameter in model.named_parameters()}
    groups = [[names.get(id(p)) for p in group["params"]] for group in innermost_optimizer(optimizer).param_groups]
    return None if any(None in group for group in groups) else groups


def rewrite(path: str, target: str, to_universal) -> None:
    """step_N (any family) -> target (portable), through target.tmp renamed into place. `to_universal(path,
    folder)` writes a ZeRO checkpoint's per-parameter form (DeepSpeed's ds_to_universal, common.outputs.reshard)."""
    source, tmp = saved_family(path), target + ".tmp"
    if os.path.isfile(os.path.join(path, "scaler.pt")):  # torch's GradScaler (DeepSpeed's: _read_deepspeed)
        raise _fp16_refusal(path)
    with open(os.path.join(path, STATE_FILE)) as handle:
        state = json.load(handle)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        weights, moments, steps = READERS[source](path, state, tmp, to_universal)
        from safetensors.torch import save_file

        save_file(
            {name: t.float().contiguous() for name, t in weights.items()}, os.path.join(tmp, "model.safetensors")
        )
        save_file(
            {name: t.float().contiguous() for name, t in moments.items()}, os.path.join(tmp, "optimizer.safetensors")
        )
        with open(os.path.join(tmp, "optimizer.json"), "w") as handle:
            json.dump({"optimizer": "AdamW", "steps": steps}, handle)
        for name in os.listdir(path):
            if name == MODEL_FILES or name.startswith(("random_states_", "scheduler")):
                copy = shutil.copytree if os.path.isdir(os.path.join(path, name)) else shutil.copy2
                copy(os.path.join(path, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, STATE_FILE), "w") as handle:
            json.dump({**state, "rewritten_from": source}, handle)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)  # only ever an incomplete one (no state file)
    os.replace(tmp, target)


def _read_torch(path: str, state: dict, tmp: str, to_universal):
    from safetensors.torch import load_file

    groups = state.get("optimizer_parameters")
    if groups is None:
        raise UsageError(
            f"checkpoint {path} does not name its optimizer's parameters (written before resuming under "
            "another config existed); resume it under the config that wrote it"
        )
    saved = torch.load(os.path.join(path, "optimizer.bin"), map_location="cpu", weights_only=True)
    names = [name for group in groups for name in group]
    moments, steps = {}, {}
    for index, name in enumerate(names):
        entry = saved["state"].get(index)
        if entry:  # a parameter with no gradient yet has no state
            moments.update({f"{name}.{key}": entry[key] for key in OPTIMIZER_STATES})
            steps[name] = float(entry["step"])
    return load_file(os.path.join(path, "model.safetensors")), moments, steps


def _read_fsdp(path: str, state: dict, tmp: str, to_universal):
    weights = read_dcp(os.path.join(path, "pytorch_model_fsdp_0"), "model.")
    flat = read_dcp(os.path.join(path, "optimizer_0"), "optimizer.state.")
    moments = {key: value for key, value in flat.items() if key.rsplit(".", 1)[-1] in OPTIMIZER_STATES}
    steps = {key.removesuffix(".step"): float(value) for key, value in flat.items() if key.endswith(".step")}
    return weights, moments, steps


def read_dcp(folder: str, prefix: str) -> dict:
    """FSDP2's distributed checkpoint, read whole in one process: the tensors whose keys start with `prefix`,
    without it (accelerate saves the model as {"model": state_dict} and the optimizer as {"optimizer": ...})."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(folder).read_metadata()
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata) and key.startswith(prefix)
    }
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return {key.removeprefix(prefix): value for key, value in state.items()}


def _read_deepspeed(path: str, state: dict, tmp: str, to_universal):
    """DeepSpeed's own per-parameter form (ds_to_universal) read back: fp32 master and moments by name;
    the step count of its (flat) groups from the first partition's optimizer state. The engine's files are
    memory-mapped: only the config, the shapes and the step counts are read from them."""
    engine = os.path.join(path, "pytorch_model")
    model_states = _first_file(engine, "model_states.pt")
    if (model_states.get("ds_config") or {}).get("fp16", {}).get("enabled"):
        raise _fp16_refusal(path)
    shapes = {key: tuple(shape) for group in model_states["param_shapes"] for key, shape in group.items()}
    # common.outputs.reshard's, when a resume on another world size made it
    universal = os.path.join(path, "universal")
    made_here = not os.path.isfile(os.path.join(universal, STATE_FILE))
    if made_here:
        try:
            to_universal(path, universal)
        except UsageError as error:
            raise UsageError(
                f"checkpoint {path} could not be rewritten for another strategy ({error}); resume it "
                "under the config that wrote it"
            ) from None
    zero = os.path.join(universal, "pytorch_model", "zero")
    weights, moments = {}, {}
    for name in sorted(os.listdir(zero)):
        folder = os.path.join(zero, name)
        if not os.path.isfile(os.path.join(folder, "fp32.pt")):
            continue

        def load(what, folder=folder, name=name):  # ZeRO-3's are flat
            saved = torch.load(os.path.join(folder, f"{what}.pt"), map_location="cpu", weights_only=False)
            return _tensor(saved).reshape(shapes[name])

        weights[name] = load("fp32")
        moments.update(
            {
                f"{name}.{key}": load(key)
                for key in OPTIMIZER_STATES
                if os.path.isfile(os.path.join(folder, f"{key}.pt"))
            }
        )
    inner = _first_file(engine, "optim_states.pt")["optimizer_state_dict"]
    inner = inner.get("base_optimizer_state", inner.get("optimizer_state_dict", inner))
    step = max(float(entry["step"]) for entry in inner["state"].values())
    if made_here:  # its state file first: a crash mid-way leaves a conversion that is redone, not a damaged one
        os.remove(os.path.join(universal, STATE_FILE))
        shutil.rmtree(universal)
    return weights, moments, dict.fromkeys(weights, step)


def _first_file(folder: str, suffix: str) -> dict:
    """The first of a DeepSpeed checkpoint's per-rank files ending in `suffix`, memory-mapped."""
    name = next(name for name in sorted(os.listdir(folder)) if name.endswith(suffix))
    return torch.load(os.path.join(folder, name), map_location="cpu", weights_only=False, mmap=True)


def _fp16_refusal(path: str) -> UsageError:
    return UsageError(
        f"checkpoint {path} is an fp16 run's, whose loss scale does not carry over to another "
        "strategy; resume it under the config that wrote it (or continue in bf16 from its export)"
    )


def _tensor(value):
    return value["param"] if isinstance(value, dict) else value


READERS = {"torch": _read_torch, "fsdp": _read_fsdp, "deepspeed": _read_deepspeed}
