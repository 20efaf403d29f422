"""Checkpoints that survive a crash mid-save, resume, and the final Hugging Face export.

accelerate's own rotation deletes the oldest checkpoint before writing the new
one, and its automatic naming restarts at 0 after `load_state`. So checkpoints
are named by optimizer step, written to a temporary folder, renamed into place
only once complete, and pruned only after that.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import torch

from common.arguments import UsageError, describe
from common.nonfinite import check_finite_weights
from common.peers import main_process_alone

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"
MODEL_FILES = "model_files"
UNIVERSAL = "universal"  # a DeepSpeed checkpoint converted for another world size, inside its step_N
ZERO3_DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's, when a config sets none


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints, oldest first. A folder is complete once renamed to step_N."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    steps = [(int(m.group(1)), name) for name in os.listdir(root) if (m := STEP_DIR.match(name))]
    return [os.path.join(root, name) for _, name in sorted(steps)]


def check_output_dir(output_dir: str, resume_from_checkpoint: str | None, overwrite: bool) -> None:
    """Refuse to start a fresh run on top of an earlier one (nothing of the user's is lost)."""
    if resume_from_checkpoint is None and not overwrite and (
            list_checkpoints(output_dir) or os.path.exists(os.path.join(output_dir, "final"))):
        raise UsageError(f"output_dir {output_dir} already holds a run; pass --resume_from_checkpoint latest "
                         "to continue it, --overwrite_output_dir to start afresh, or another --output_dir")


def prepare_output_dir(accelerator, output_dir: str, resume_from_checkpoint: str | None,
                       overwrite: bool) -> str | None:
    """The checkpoint to resume from, or None for a fresh run. A fresh run with
    --overwrite_output_dir clears the earlier run's checkpoints, export and metrics, but only
    once it is known to start (`clear_earlier_run`, called when run.json is written)."""
    checkpoint = resolve_checkpoint(output_dir, resume_from_checkpoint)
    accelerator.earlier_run_to_clear = output_dir if checkpoint is None and overwrite else None
    return checkpoint


def clear_earlier_run(accelerator) -> None:
    output_dir = getattr(accelerator, "earlier_run_to_clear", None)
    if output_dir and accelerator.is_main_process:
        for name in ("checkpoints", "final", "logs"):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
        if os.path.exists(os.path.join(output_dir, "metrics.jsonl")):
            os.remove(os.path.join(output_dir, "metrics.jsonl"))
    accelerator.earlier_run_to_clear = None
    accelerator.wait_for_everyone()


def resolve_checkpoint(output_dir: str, resume_from_checkpoint: str | None) -> str | None:
    if resume_from_checkpoint != "latest":
        if resume_from_checkpoint and not os.path.isfile(os.path.join(resume_from_checkpoint, STATE_FILE)):
            raise UsageError(f"--resume_from_checkpoint {resume_from_checkpoint} is not a complete checkpoint "
                             f"(no {STATE_FILE}); pass a step_N folder or 'latest'")
        return resume_from_checkpoint
    found = list_checkpoints(output_dir)
    return found[-1] if found else None  # 'latest' with none yet starts from scratch


def save_checkpoint(accelerator, output_dir: str, step: int, state: dict, total_limit: int | None,
                    tokenizer=None, dtype: torch.dtype | None = None) -> str:
    """accelerate `save_state` into tmp, then an atomic rename to step_N, then prune.
    Weights that are not finite stop the run instead (nothing is written). Beside the state,
    MODEL_FILES holds what a Hugging Face folder needs besides the weights (config in the
    export `dtype`, tokenizer, adapter config), so scripts/export_checkpoint.py can turn any
    checkpoint into one without launching."""
    for model in accelerator._models:  # the prepared model(s) save_state will write
        check_finite_weights(accelerator, model, step)
    root = checkpoints_dir(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f"tmp-step_{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a save that crashed
        os.makedirs(tmp, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_model_files(accelerator.unwrap_model(accelerator._models[0]), tokenizer, dtype,
                          os.path.join(tmp, MODEL_FILES))
        with open(os.path.join(tmp, STATE_FILE), "w") as handle:
            json.dump({"step": step, "num_processes": accelerator.num_processes,
                       **_zero3_layout(accelerator), **state}, handle)
        _swap_into_place(tmp, final)  # a same-step folder from an earlier attempt is replaced
        if total_limit:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def _zero3_layout(accelerator) -> dict:
    """ZeRO-3's sub-group size, which shapes its flat optimizer partitions as the world size does."""
    plugin = accelerator.state.deepspeed_plugin
    zero = plugin.deepspeed_config.get("zero_optimization", {}) if plugin is not None else {}
    return {"zero3_sub_group_size": int(float(zero.get("sub_group_size", ZERO3_DEFAULT_SUB_GROUP_SIZE)))} \
        if zero.get("stage") == 3 else {}


def for_this_world_size(accelerator, path: str | None) -> str | None:
    """The checkpoint to load on this run's number of processes. FSDP2 (DCP) reshards on load
    and DDP/one-process state is whole, so those load as they are. A DeepSpeed ZeRO checkpoint
    is partitioned by the world size that wrote it (and under ZeRO-3 by its sub-group size, which
    checkpoints written before it was recorded had at DeepSpeed's default): from another one, the
    main process converts it once into DeepSpeed's universal format (`ds_to_universal`, into
    step_N/universal beside the original, which is left as it is) and the engine is told to
    load that. Call before `accelerator.prepare` (the flag is read when the engine is built)."""
    if path is None or accelerator.state.deepspeed_plugin is None:
        return path
    with open(os.path.join(path, STATE_FILE)) as handle:
        saved_state = json.load(handle)
    saved = saved_state.get("num_processes", accelerator.num_processes)
    sub_group_size = _zero3_layout(accelerator).get("zero3_sub_group_size")
    saved_sub_group_size = saved_state.get("zero3_sub_group_size", ZERO3_DEFAULT_SUB_GROUP_SIZE)
    same_layout = sub_group_size in (None, saved_sub_group_size)
    if saved == accelerator.num_processes and same_layout:
        return path
    target = os.path.join(path, UNIVERSAL)
    if accelerator.is_main_process and not os.path.isfile(os.path.join(target, STATE_FILE)):
        _convert_to_universal(path, target)
    accelerator.wait_for_everyone()
    accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    accelerator.print(f"{path} was saved by {saved} processes"
                      + ("" if same_layout else f" with ZeRO-3 sub_group_size {saved_sub_group_size} (this run: "
                                                f"{sub_group_size})")
                      + f": loading its universal conversion {target}")
    return target


def _convert_to_universal(path: str, target: str) -> None:
    """step_N/pytorch_model (ZeRO shards) -> target/pytorch_model (universal, per parameter),
    with the rest of the checkpoint copied beside it; written to a temporary folder first."""
    tmp = target + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(path, tmp, ignore=lambda folder, names: [
        name for name in names if folder == path and (name in ("pytorch_model", "latest", UNIVERSAL)
                                                      or name.startswith(UNIVERSAL + ".") or name.endswith(".py"))])
    result = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         os.path.join(path, "pytorch_model"), "--output_folder", os.path.join(tmp, "pytorch_model"),
         "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
        capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise UsageError(f"checkpoint {path} could not be converted for another number of processes "
                         f"(deepspeed.checkpoint.ds_to_universal: {last}); resume it on the number of "
                         "processes that wrote it (num_processes in its trainer_state.json)")
    shutil.rmtree(target, ignore_errors=True)  # only ever an incomplete conversion (no state file)
    os.replace(tmp, target)


def load_checkpoint(accelerator, path: str | None) -> dict:
    """Restore model, optimizer, scheduler and RNG state; return the saved trainer state
    ({"step": 0} for a fresh run, when `path` is None)."""
    if path is None:
        return {"step": 0}
    universal = os.path.basename(os.path.normpath(path)) == UNIVERSAL
    hyperparameters = _group_hyperparameters(accelerator)
    try:
        accelerator.load_state(path)
        if universal:
            _repair_universal_load(accelerator, hyperparameters)
        with open(os.path.join(path, STATE_FILE)) as handle:
            state = json.load(handle)
    except Exception as error:  # every failure here means the same to the user; name it, keep its first line
        raise UsageError(f"checkpoint {path} does not load into this run ({describe(error)}); it is "
                         "damaged or from other model/strategy arguments: resume with the arguments in its run's "
                         "run.json, pass another --resume_from_checkpoint, or start afresh with "
                         "--overwrite_output_dir") from None
    saved_processes = state.get("num_processes", accelerator.num_processes)
    if saved_processes != accelerator.num_processes:
        _rescale_schedules(accelerator, saved_processes)
    accelerator.print(f"resumed from {path} at step {state['step']}"
                      + (f" (saved by {saved_processes} processes)" if saved_processes != accelerator.num_processes else ""))
    return state


def _inner_optimizers(accelerator):
    """The torch optimizers that hold the state (under DeepSpeed, inside its ZeRO optimizer)."""
    for prepared in accelerator._optimizers:
        wrapped = prepared.optimizer
        yield getattr(wrapped, "optimizer", wrapped)


def _group_hyperparameters(accelerator) -> list:
    return [[{key: value for key, value in group.items() if key not in ("params", "lr")}
             for group in optimizer.param_groups] for optimizer in _inner_optimizers(accelerator)]


def _repair_universal_load(accelerator, hyperparameters: list) -> None:
    """Two faults of DeepSpeed 0.19.8's ZeRO-3 universal load (`load_hp_checkpoint_state_from_
    checkpoint_dir_stage3`), seen as losses that left the uninterrupted run's from the second
    step after resuming: it gives every parameter group the first group's hyperparameters (the
    norms and biases, weight_decay 0, got 0.01), and one `step` tensor to every group's state,
    which torch's AdamW increments in place, so the step count advanced once per group per
    step. Each group gets its own hyperparameters (this run's, less the learning rate that the
    schedule sets) and its own step count back."""
    for optimizer, groups in zip(_inner_optimizers(accelerator), hyperparameters):
        for group, before in zip(optimizer.param_groups, groups):
            group.update(before)
        for state in optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _rescale_schedules(accelerator, saved_processes: int) -> None:
    """accelerate's prepared scheduler advances num_processes times per optimizer step (see
    common.training.create_scheduler), so a schedule saved by another number of processes
    stands at a multiple of the steps it took: put it at the same step on this world size."""
    for prepared in accelerator._schedulers:
        schedule = prepared.scheduler
        steps = schedule.last_epoch // saved_processes
        schedule.last_epoch = steps * accelerator.num_processes - 1
        schedule.step()  # recomputes the learning rates at the rescaled position


def export_final(accelerator, model, tokenizer, output_dir: str, dtype, name: str = "final",
                 merge_adapter: bool = False) -> str:
    """Hugging Face folder (safetensors + config + tokenizer) in `dtype`, under any strategy.

    The weights exported are the ones the optimizer updates (fp32 master weights under
    DeepSpeed's bf16 too), gathered from ZeRO-3 or FSDP shards, then cast to `dtype`
    (common.model.export_dtype), so every strategy writes the same file. Every rank must
    call it; only the main process writes. A peft model saves its adapter only; with
    `merge_adapter` the merged full model also goes to `<name>_merged`."""
    target = os.path.join(output_dir, name)
    state_dict = master_state_dict(accelerator, model)
    unwrapped = accelerator.unwrap_model(model)
    with main_process_alone(accelerator, f"writing {target}"):
        if accelerator.is_main_process:
            write_folder(target, lambda folder: write_hf_folder(unwrapped, state_dict, tokenizer, dtype, folder))
            if merge_adapter and hasattr(unwrapped, "peft_config"):
                with _without_zero3_init():  # only this process reloads the base model
                    write_folder(f"{target}_merged", lambda tmp: _save_merged(unwrapped, target, tmp, tokenizer,
                                                                               dtype))
    accelerator.wait_for_everyone()
    return target


def write_hf_folder(model, state_dict: dict, tokenizer, dtype, folder: str) -> None:
    """`model.save_pretrained` with `state_dict` cast to `dtype` (safetensors), the config
    saying that dtype, and the tokenizer. A peft model writes its adapter only."""
    model.save_pretrained(folder, safe_serialization=True, state_dict={
        k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()})
    if not hasattr(model, "peft_config"):
        _save_config(model.config, dtype, folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def write_model_files(model, tokenizer, dtype, folder: str) -> None:
    """What write_hf_folder writes besides the weights, with the base model's config (and
    generation config) for a peft model, so that the model can be built again from them."""
    os.makedirs(folder, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    _save_config(base.config, dtype or base.config.dtype, folder)
    if getattr(base, "generation_config", None) is not None and base.can_generate():
        base.generation_config.save_pretrained(folder)
    if hasattr(model, "peft_config"):
        model.peft_config["default"].save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _save_config(config, dtype, folder: str) -> None:
    """save_pretrained writes the live parameters' dtype; say what the file holds."""
    trained_dtype, config.dtype = config.dtype, dtype
    try:
        config.save_pretrained(folder)
    finally:
        config.dtype = trained_dtype


def read_checkpoint_weights(path: str) -> dict:
    """The model's full state dict from a checkpoint folder, whichever strategy wrote it, on
    CPU with no process group: fp32 master weights rebuilt from ZeRO-1/2/3 partitions
    (DeepSpeed's own zero_to_fp32), FSDP2's sharded DCP files, or the one file DDP and a
    single process write."""
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):  # DeepSpeed: the tag names the folder its engine wrote
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with open(latest) as handle:
            tag = handle.read().strip()
        with contextlib.redirect_stdout(None):
            return dict(get_fp32_state_dict_from_zero_checkpoint(path, tag=tag))
    sharded = os.path.join(path, "pytorch_model_fsdp_0")
    if os.path.isdir(sharded):
        return _read_dcp(sharded)
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors.torch import load_file

        return load_file(single)
    raise UsageError(f"{path} holds no model weights this project writes (DeepSpeed's 'latest' tag, "
                     "pytorch_model_fsdp_0/ or model.safetensors); pass a checkpoints/step_N folder of a run")


def _read_dcp(folder: str) -> dict:
    """FSDP2's distributed checkpoint, read whole in one process. accelerate saves it as
    {"model": state_dict}, so every key starts with "model."."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(folder).read_metadata()
    state = {key: torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return {key.removeprefix("model."): value for key, value in state.items()}


def master_state_dict(accelerator, model) -> dict:
    """The full state dict, with trainable parameters taken from the optimizer's master
    copy where DeepSpeed keeps one (its bf16 mode trains fp32 partitions behind bf16
    module weights). Collective: every rank calls it; ZeRO-3 gathers each parameter."""
    state_dict = accelerator.get_state_dict(model)
    if getattr(accelerator.state, "deepspeed_plugin", None) is None:
        return state_dict
    from deepspeed.utils import safe_get_full_fp32_param

    for key, parameter in accelerator.unwrap_model(model).named_parameters():
        if parameter.requires_grad:
            master = safe_get_full_fp32_param(parameter)
            if master is not None and accelerator.is_main_process and key in state_dict:
                state_dict[key] = master.detach().cpu()
    return state_dict


def write_folder(target: str, write) -> None:
    """Write into target.tmp, then swap it into place, so a crash leaves the old folder whole."""
    tmp = f"{target}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    _swap_into_place(tmp, target)


def _swap_into_place(tmp: str, target: str) -> None:
    """Replace `target` with the complete folder `tmp` (the rename itself is atomic)."""
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


@contextlib.contextmanager
def _without_zero3_init():
    """While a ZeRO-3 config is registered, transformers builds every model inside
    deepspeed.zero.Init, whose broadcasts need all ranks: a model built on one process
    would hang. (accelerate's zero3_init_context_manager re-registers the config.)"""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _save_merged(peft_model, adapter_dir: str, out: str, tokenizer, dtype) -> None:
    """Base model + saved adapter, merged into plain weights (loads without peft)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = peft_model.peft_config["default"].base_model_name_or_path
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().to(dtype)
    merged.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
