"""The export: a Hugging Face folder (safetensors, config, tokenizer) from a run or from any checkpoint.

`export_final` gathers the trained weights under any strategy at the end of a run (final/,
best/); `read_checkpoint_weights` reads them from a checkpoint folder of any strategy in one
process (scripts/export_checkpoint.py). Both write through `write_hf_folder`, so a checkpoint's
export equals the run's own.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings

import torch

from common.accelerator import unwrap
from common.checkpoints import save_config
from common.errors import UsageError
from common.internals import is_zero3_parameter, without_zero3_init
from common.lora import save_merged
from common.memory import current_memory
from common.peers import main_process_alone
from common.run_dir import write_folder


def export_final(accelerator, model, tokenizer, output_dir: str, dtype, name: str = "final",
                 merge_adapter: bool = False, cost: dict | None = None) -> str:
    """Hugging Face folder (safetensors + config + tokenizer) in `dtype`, under any strategy.

    The weights exported are the ones the optimizer updates (fp32 master weights under
    DeepSpeed's bf16 too), gathered from ZeRO-3 or FSDP shards, then cast to `dtype`
    (common.model.export_dtype), so every strategy writes the same file. Every rank must
    call it; only the main process writes. A peft model saves its adapter only; with
    `merge_adapter` the merged full model also goes to `<name>_merged`. `cost`, if given, gets
    the gather's seconds and the main process's resident set before and with the state dict."""
    target = os.path.join(output_dir, name)
    started, before = time.perf_counter(), current_memory(None)["rss_mb"]
    state_dict = master_state_dict(accelerator, model)
    if cost is not None:
        cost.update(gather_s=round(time.perf_counter() - started, 2), rss_before_mb=round(before, 1),
                    rss_with_state_dict_mb=round(current_memory(None)["rss_mb"], 1))
    unwrapped = unwrap(accelerator, model)
    with main_process_alone(accelerator, f"writing {target}"):
        if accelerator.is_main_process:
            write_folder(target, lambda folder: write_hf_folder(unwrapped, state_dict, tokenizer, dtype, folder))
            if merge_adapter and hasattr(unwrapped, "peft_config"):
                with without_zero3_init():  # only this process reloads the base model
                    write_folder(f"{target}_merged", lambda tmp: save_merged(unwrapped, target, tmp, tokenizer,
                                                                               dtype))
    accelerator.wait_for_everyone()
    return target


def write_hf_folder(model, state_dict: dict, tokenizer, dtype, folder: str) -> None:
    """`model.save_pretrained` with `state_dict` cast to `dtype` (safetensors), the config
    saying that dtype, and the tokenizer. A peft model writes its adapter only."""
    model.save_pretrained(folder, safe_serialization=True, state_dict={
        k: v.to(dtype) if v.is_floating_point() else v for k, v in without_tied_copies(model, state_dict).items()})
    if not hasattr(model, "peft_config"):
        save_config(model.config, dtype, folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def without_tied_copies(model, state_dict: dict) -> dict:
    """One entry per parameter: a tied parameter (the output layer tied to the input embeddings)
    is stored once, as transformers stores it and ties it again at load. A state dict gathered from
    shards holds each of its names as a separate tensor, which save_pretrained would write twice."""
    first_names = {name for name, _ in model.named_parameters()}
    every_name = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {key: value for key, value in state_dict.items() if key in first_names or key not in every_name}


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
    """The full state dict, on the main process (other ranks get {}), in one gather. Collective:
    every rank calls it. Under DeepSpeed each trainable parameter comes from the optimizer's
    fp32 master copy (its bf16 mode trains fp32 partitions behind bf16 module weights), gathered
    one parameter at a time, and a frozen ZeRO-3 parameter from its partitions; no 16-bit copy of
    the model is gathered first, so ZeRO-3 needs no stage3_gather_16bit_weights_on_model_save."""
    if accelerator.state.deepspeed_plugin is None:
        return accelerator.get_state_dict(model)
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    unwrapped = unwrap(accelerator, model)
    parameters = dict(unwrapped.named_parameters(remove_duplicate=False))
    gathered, state_dict = {}, {}
    for key, value in unwrapped.state_dict().items():  # ZeRO-3: placeholders for parameters, no gather
        parameter = parameters.get(key)
        if parameter is None:  # a buffer: whole on every rank
            full = value
        elif id(parameter) in gathered:  # tied to a parameter already gathered
            full = gathered[id(parameter)]
        else:
            full = safe_get_full_fp32_param(parameter) if parameter.requires_grad else None
            if full is None and is_zero3_parameter(parameter):
                with deepspeed.zero.GatheredParameters([parameter]):
                    full = parameter.data.detach().cpu().clone() if accelerator.is_main_process else None
            elif full is None:
                full = parameter.data
            full = full.detach().cpu() if accelerator.is_main_process and full is not None else None
            gathered[id(parameter)] = full
        if accelerator.is_main_process:
            state_dict[key] = full.detach().cpu()
    return state_dict
