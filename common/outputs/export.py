"""The export: a Hugging Face folder (safetensors, config, tokenizer) from a run or from any checkpoint.

`export_final` gathers the trained weights under any strategy at the end of a run (final/,
best/); `read_checkpoint_weights` reads them from a checkpoint folder of any strategy in one
process (scripts/export_checkpoint.py). Both write through `write_hf_folder`, so a checkpoint's
export equals the run's own.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import time

import torch

from common.launch.accelerator import unwrap
from common.launch.errors import UsageError
from common.launch.internals import full_shape, is_zero3_parameter, saves_as_state_dict, without_zero3_init
from common.launch.peers import main_process_alone
from common.models.lora import merged_model_skeleton, merged_tensors, save_merged, saved_adapter_names
from common.outputs.checkpoints import save_config
from common.outputs.model_card import write_model_card
from common.outputs.portable import read_dcp
from common.outputs.run_dir import write_folder
from common.parallel import pipeline
from common.training.memory import current_memory


def export_final(
    accelerator,
    model,
    tokenizer,
    output_dir: str,
    dtype,
    name: str = "final",
    merge_adapter: bool = False,
    cost: dict | None = None,
) -> str:
    """Hugging Face folder (safetensors + config + tokenizer) in `dtype`, under any strategy.

    The weights exported are the ones the optimizer updates (fp32 master weights under
    DeepSpeed's bf16 too), gathered from ZeRO-3 or FSDP shards one tensor at a time and cast to
    `dtype` (common.models.loading.export_dtype), so every strategy writes the same file. The main process
    writes each tensor as it arrives (`write_safetensors`): it never holds the whole state dict,
    only one tensor beside its training state. Every rank must call it. A peft model saves its
    adapter only, through peft, and only the adapter's tensors are gathered (`exported_names`),
    never the base model's; with `merge_adapter` the merged full model also goes to
    `<name>_merged`. `cost`, if given, gets the gather's seconds and the main process's resident
    set before and at its highest during the export."""
    target = os.path.join(output_dir, name)
    started, before = time.perf_counter(), current_memory(None)["rss_mb"]
    highest = {"rss_mb": before}
    if pipeline.enabled(accelerator):  # the stages' tensors sent one at a time to each rank of a pipeline
        unwrapped, tensors = pipeline.export_view(accelerator, model)
        tensors = _watching_memory(tensors, highest)
    else:
        unwrapped = unwrap(accelerator, model)
        tensors = _watching_memory(master_tensors(accelerator, model), highest)
    if accelerator.is_main_process:

        def write(folder):
            write_hf_folder(unwrapped, tensors, tokenizer, dtype, folder)
            write_model_card(folder, output_dir, name)

        write_folder(target, write)
    else:
        for _ in tensors:  # take part in every gather
            pass
    if cost is not None:
        cost.update(
            gather_s=round(time.perf_counter() - started, 2),
            rss_before_mb=round(before, 1),
            rss_peak_mb=round(highest["rss_mb"], 1),
        )
    if merge_adapter and hasattr(unwrapped, "peft_config"):
        with main_process_alone(accelerator, f"writing {target}_merged"):
            if accelerator.is_main_process:
                with without_zero3_init():  # only this process builds the merged model

                    def write_merged_with_card(tmp):
                        write_merged(unwrapped, target, tmp, tokenizer, dtype)
                        write_model_card(tmp, output_dir, f"{name}_merged")

                    write_folder(f"{target}_merged", write_merged_with_card)
    accelerator.wait_for_everyone()
    return target


def write_merged(peft_model, adapter_dir: str, folder: str, tokenizer, dtype) -> None:
    """The base model with the adapter saved in `adapter_dir` merged in, as a plain Hugging Face
    folder in `dtype`, written as the model's own export is, one tensor at a time: each base tensor
    read from the base model's files, the adapter merged into it (`merged_tensors`). Where the base
    model cannot be read that way, it is reloaded whole (`save_merged`)."""
    merged = merged_model_skeleton(peft_model)
    tensors = None
    if saves_as_state_dict(merged):
        tensors = merged_tensors(peft_model, adapter_dir, exported_names(merged), f"{merged.base_model_prefix}.")
    if tensors is None:
        save_merged(peft_model, adapter_dir, folder, tokenizer, dtype)
    else:
        write_hf_folder(merged, tensors, tokenizer, dtype, folder)


def _watching_memory(tensors, highest: dict):
    """`tensors`, passed through; highest["rss_mb"] keeps the largest resident set seen after each."""
    for item in tensors:
        yield item
        highest["rss_mb"] = max(highest["rss_mb"], current_memory(None)["rss_mb"])


def write_hf_folder(model, tensors, tokenizer, dtype, folder: str) -> None:
    """The model's weights from `tensors` ((name, full tensor) pairs in state-dict order, or a
    state dict) cast to `dtype`, as model.safetensors, with the config saying that dtype, the
    generation config and the tokenizer: what `save_pretrained` writes. A peft model's adapter is
    written by peft's `save_pretrained` from the adapter's tensors (`tensors` needs to hold no
    others: `exported_names`). A model whose saving transformers converts (renamed or re-fused
    weights, code from the Hub) is written by `save_pretrained` itself, from the whole state dict."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    if hasattr(model, "peft_config") or not saves_as_state_dict(model):
        # the tensors are whole already: without the run's distributed config (tp.yaml sets one), or transformers
        # would gather them again and wait at a barrier the ranks that do not write never reach
        distributed, model.config.distributed_config = getattr(model.config, "distributed_config", None), None
        try:
            model.save_pretrained(
                folder,
                safe_serialization=True,
                state_dict={
                    k: v.to(dtype) if v.is_floating_point() else v
                    for k, v in without_tied_copies(model, dict(items)).items()
                },
            )
        finally:
            model.config.distributed_config = distributed
    else:
        os.makedirs(folder, exist_ok=True)
        write_safetensors(os.path.join(folder, "model.safetensors"), export_layout(model, dtype), items)
    if not hasattr(model, "peft_config"):
        # the model's own class, as save_pretrained names it (FSDP2 swaps in a subclass, FSDP<name>)
        model.config.architectures = [
            next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
        ]
        save_config(model.config, dtype, folder)
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def exported_names(model, state: dict | None = None) -> list[str]:
    """The state dict's names (`state`, the model's state dict if already built), a tied parameter
    (the output layer tied to the input embeddings) once, as transformers stores it and ties it
    again at load; for a peft model only those whose tensors peft saves (the adapter)."""
    first_names = {name for name, _ in model.named_parameters()}
    every_name = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state = model.state_dict() if state is None else state
    names = [key for key in state if key in first_names or key not in every_name]
    if hasattr(model, "peft_config"):
        saved = set(saved_adapter_names(model, state))
        names = [name for name in names if name in saved]
    return names


def without_tied_copies(model, state_dict: dict) -> dict:
    """`state_dict` with the exported names only (`exported_names`): without tied copies (a state
    dict gathered from shards holds each of a tied parameter's names as a separate tensor, which
    save_pretrained would write twice) and, for a peft model, without the base model."""
    names = set(exported_names(model))
    return {key: value for key, value in state_dict.items() if key in names}


def export_layout(model, dtype) -> list[tuple[str, tuple, torch.dtype]]:
    """(name, full shape, dtype in the file) of each exported tensor, known before any gather:
    floating-point tensors in `dtype`, others as they are."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    state = model.state_dict()
    layout = []
    for key in exported_names(model, state):
        tensor = parameters.get(key, state[key])
        layout.append((key, full_shape(tensor), dtype if tensor.is_floating_point() else tensor.dtype))
    return layout


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(path: str, layout: list, tensors) -> None:
    """A safetensors file written as its tensors arrive: the header (names, dtypes, shapes and
    offsets, all known from `layout`) first, then each tensor's bytes in layout order, so at most
    one tensor is held. `tensors` yields (name, tensor) for at least the layout's names, in its
    order (others, such as tied copies, are skipped)."""
    header, offset = {}, 0
    for name, shape, dtype in layout:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    wanted = {name: (shape, dtype) for name, shape, dtype in layout}
    written = []
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, tensor in tensors:
            if name not in wanted:
                continue
            shape, dtype = wanted[name]
            if tuple(tensor.shape) != tuple(shape):
                raise RuntimeError(
                    f"export: {name} gathered with shape {tuple(tensor.shape)}, expected {tuple(shape)}"
                )
            handle.write(tensor.detach().to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)
            written.append(name)
    if written != [name for name, _, _ in layout]:
        raise RuntimeError(f"export: wrote {len(written)} of {len(layout)} tensors, or out of order")


def tensors_written(folder: str) -> int:
    """How many tensors a Hugging Face folder's safetensors files hold (a LoRA export's: the adapter's only),
    read from their headers."""
    from safetensors import safe_open

    count = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as handle:
                count += len(list(handle.keys()))
    return count


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
        return read_dcp(sharded, "model.")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors.torch import load_file

        return load_file(single)
    raise UsageError(
        f"{path} holds no model weights this project writes (DeepSpeed's 'latest' tag, "
        "pytorch_model_fsdp_0/ or model.safetensors); pass a checkpoints/step_N folder of a run"
    )


def master_tensors(accelerator, model):
    """(name, full tensor) for each exported name (`exported_names`: a peft model's adapter only),
    in state-dict order: the tensor on the main process, None elsewhere. Collective, one gather per
    tensor: every rank iterates it to the end. Under DeepSpeed each trainable parameter comes from
    the optimizer's fp32 master copy (its bf16 mode trains fp32 partitions behind bf16 module
    weights), and a frozen ZeRO-3 parameter from its partitions; no 16-bit copy of the model is gathered first, so
    ZeRO-3 needs no stage3_gather_16bit_weights_on_model_save. Under FSDP2 each shard is gathered
    (from wherever it lives: its offloaded shards go through the device)."""
    unwrapped = unwrap(accelerator, model)
    parameters = dict(unwrapped.named_parameters(remove_duplicate=False))
    state = unwrapped.state_dict()  # ZeRO-3: placeholders for parameters; FSDP2: sharded DTensors
    deepspeed_run = accelerator.state.deepspeed_plugin is not None
    if deepspeed_run and hasattr(model, "empty_partition_cache"):
        # ZeRO-3 may still hold parameters its last forward gathered or prefetched (an evaluation's,
        # under stage3_max_live_parameters / _reuse_distance); GatheredParameters asserts on them
        model.empty_partition_cache()
    main = accelerator.is_main_process
    for key in exported_names(unwrapped, state):
        parameter, value = parameters.get(key), state[key]
        if deepspeed_run and parameter is not None:
            full = _deepspeed_full(parameter, main)
        elif hasattr(value, "full_tensor"):  # an FSDP2 shard
            full = value.to(accelerator.device).full_tensor()
        else:
            full = value
        yield key, (full.detach().cpu() if main and full is not None else None)


def _deepspeed_full(parameter, main: bool):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(parameter) if parameter.requires_grad else None
    if full is None and is_zero3_parameter(parameter):
        with deepspeed.zero.GatheredParameters([parameter]):
            full = parameter.data.detach().cpu().clone() if main else None
    return parameter.data if full is None else full
