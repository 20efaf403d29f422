"""Models and tokenizers: pretrained (Hub name or folder) or built from a config (seeded)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import zlib

import torch
from huggingface_hub.errors import StrictDataclassError  # transformers' config validation
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.launch.errors import RunStopped, UsageError, describe, downloads_off, load_fault
from common.launch.internals import (
    declare_layer_classes,
    declared_layer_classes,
    init_module_weights,
    is_zero3_parameter,
)
from common.launch.peers import lost_peer_message
from common.options.arguments import ModelArguments, SpeedArguments
from common.parallel import expert_parallel, pipeline, tensor_parallel
from common.training import experts, memory
from common.training.speed import prepare_model


def reachable_hint(name: str) -> str:
    """The end of the error for a model or tokenizer that did not load."""
    return "or a Hub name reachable from here" + ("" if os.path.isdir(name) else downloads_off("HF_HUB_OFFLINE"))


@contextlib.contextmanager
def one_line_load_errors(what: str, name: str, otherwise: str, refused=(OSError, ValueError)):
    """Loading `what` (a model, a tokenizer, an adapter) from `name`, a folder or a Hub name: what
    the libraries raise for it ends the run in one line. This host's fault (memory, I/O) is a
    RunStopped; a damaged file, weights that do not fit their config, or an error of a `refused`
    type (`otherwise` says what to pass instead) a UsageError; anything else keeps its traceback."""
    try:
        yield
    except UsageError:
        raise
    except Exception as error:  # noqa: BLE001 (classified below; the rest is raised again)
        if lost_peer_message(error, None) is not None:
            raise  # a collective failed (rank 0 broadcasting the weights): the exit policy names the lost peer
        reason, fault = describe(error), load_fault(error)
        if fault in ("memory", "io"):
            host = (
                "ran out of memory"
                if fault == "memory"
                else "had an I/O error (check the filesystem: space, permissions, the mount)"
            )
            raise RunStopped(
                f"{what} {name} could not be loaded: this host {host} ({reason}); fix that and run "
                "again; the files themselves may be fine"
            ) from None
        local = os.path.isdir(name)
        missing = local and isinstance(error, FileNotFoundError)  # a shard its index names
        if missing or fault == "damaged" and (local or not isinstance(error, OSError)):  # a network error is no damage
            again = "copy or save it again" if local else "delete its copy in the Hub cache and download it again"
            raise UsageError(
                f"{what} {'folder ' if local else ''}{name} is damaged ({reason}): a file in it is "
                f"{'missing' if missing else 'cut short or corrupt'}; {again}"
            ) from None
        if isinstance(error, RuntimeError) and re.search(r"ignore_mismatched_sizes|size mismatch", str(error)):
            raise UsageError(
                f"the weights in {name} do not fit the {what} its config describes ({reason}); pass a "
                "folder whose config.json matches its weights (a classifier fine-tuned for other "
                "labels: start from its base model)"
            ) from None
        if isinstance(error, refused):
            raise UsageError(f"no {what} loads from {name} ({reason}); {otherwise}") from None
        raise


ADAPTER_CONFIG = "adapter_config.json"  # what peft's save_pretrained writes beside an adapter's weights


def is_adapter_folder(path: str | None) -> bool:
    """A folder holding a PEFT adapter and no model of its own (a --use_peft run's final/)."""
    return (
        bool(path)
        and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))
        and not os.path.isfile(os.path.join(path, "config.json"))
    )


def adapter_base_model(folder: str, flag: str = "--model_name_or_path") -> str:
    """The base model an adapter folder's adapter_config.json names (base_model_name_or_path), or a
    UsageError where it names none (`flag`: the option that gave `folder`)."""
    with open(os.path.join(folder, ADAPTER_CONFIG)) as handle:
        base = json.load(handle).get("base_model_name_or_path")
    if not base:
        raise UsageError(
            f"{flag} {folder} is a LoRA adapter whose {ADAPTER_CONFIG} names no base model "
            f"(base_model_name_or_path is {json.dumps(base)}): pass its base model as --model_name_or_path and "
            f"{folder} as --adapter_name_or_path, or the merged model (its run's final_merged/) as --model_name_or_path"
        )
    return base


def resolve_adapter_folder(args: ModelArguments) -> None:
    """--model_name_or_path naming an adapter's folder (a --use_peft run's final/) loads as transformers
    loads such a folder where peft is installed: the base model its adapter_config.json names, with the
    adapter on top. `args` then says so: --model_name_or_path the base, --adapter_name_or_path the folder,
    and the tokenizer the folder holds (the run saved it there, with its chat template) where no other is
    given. What run.json records is then what loaded. Called again, it changes nothing."""
    folder = args.model_name_or_path
    if not is_adapter_folder(folder):
        return
    if args.adapter_name_or_path:
        raise UsageError(
            f"--model_name_or_path {folder} is a LoRA adapter, and --adapter_name_or_path "
            f"{args.adapter_name_or_path} another: one adapter at a time; pass its base model "
            f"({adapter_base_model(folder)}) or the merged model (its run's final_merged/) as --model_name_or_path"
        )
    args.model_name_or_path, args.adapter_name_or_path = adapter_base_model(folder), folder
    if not args.tokenizer_name_or_path and os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        args.tokenizer_name_or_path = folder


def load_tokenizer(args: ModelArguments):
    resolve_adapter_folder(args)
    name = args.tokenizer_name_or_path or args.model_name_or_path
    # tokenizers raises plain Exceptions (and KeyError, TypeError) for a tokenizer.json it cannot read
    with one_line_load_errors(
        "tokenizer",
        name,
        f"pass --tokenizer_name_or_path with a folder holding tokenizer files, {reachable_hint(name)}",
        refused=Exception,
    ):
        tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    args: ModelArguments,
    tokenizer,
    seed: int,
    speed: SpeedArguments | None = None,
    packed_rows: bool = False,
    auto_class=AutoModelForCausalLM,
    **config_overrides,
):
    """From `model_name_or_path`, or a fresh model from `model_config` sized to the tokenizer.

    Weights are loaded in `--torch_dtype` (float32 by default: fp32 master weights even
    from a checkpoint saved in bf16; the accelerate config's mixed precision sets the
    compute dtype). A model built from a config gets the same initial weights for the
    same seed under every strategy (`initialise_weights`). An adapter (--adapter_name_or_path, or an
    adapter folder as --model_name_or_path: `resolve_adapter_folder`) loads frozen on top, as for an
    evaluation; `common.models.lora.apply_lora` trains it on with --use_peft."""
    resolve_adapter_folder(args)
    dtype = "auto" if args.torch_dtype == "auto" else getattr(torch, args.torch_dtype)
    if args.output_router_logits is not None:  # a MoE's router loss on or off (refused for a dense model)
        config = saved_config(args.model_config or args.model_name_or_path)
        causal_lm = auto_class is AutoModelForCausalLM
        config_overrides = {**config_overrides, **experts.config_overrides(args, config, causal_lm)}
    if args.model_name_or_path:
        kind = f"{auto_class.__name__.replace('AutoModelFor', '')} model"
        with one_line_load_errors(
            kind,
            args.model_name_or_path,
            f"pass a model folder (config.json + weights) {reachable_hint(args.model_name_or_path)}",
        ):
            # pp.yaml: this rank's stages only, read from the files (None: the whole model)
            model = (
                None
                if args.adapter_name_or_path
                else pipeline.load_stages(auto_class, args.model_name_or_path, dtype, config_overrides)
            )
            if model is None:
                model = auto_class.from_pretrained(args.model_name_or_path, dtype=dtype, **config_overrides)
        if getattr(model.config, "pad_token_id", None) is None:
            # Decoder checkpoints (Llama, Mistral, ...) ship without a pad token: padded batches
            # (sequence classification finds each row's last real token by it) use the tokenizer's.
            model.config.pad_token_id = tokenizer.pad_token_id
        if args.adapter_name_or_path:  # a trained PEFT adapter on top (e.g. to evaluate it)
            from peft import PeftModel

            with one_line_load_errors(
                "PEFT adapter",
                args.adapter_name_or_path,
                "pass --adapter_name_or_path with "
                "a folder holding adapter_config.json and the adapter's weights (a --use_peft "
                f"run's final/) {reachable_hint(args.adapter_name_or_path)}",
            ):
                model = PeftModel.from_pretrained(model, args.adapter_name_or_path)
    else:
        try:
            config = AutoConfig.from_pretrained(
                args.model_config,
                vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id,
                **config_overrides,
            )
            build_dtype = torch.float32 if dtype == "auto" else dtype
            if _weights_come_from_rank0():
                from accelerate import init_empty_weights

                with init_empty_weights(include_buffers=False):  # parameters on the meta device
                    model = auto_class.from_config(config, dtype=build_dtype)
                _uninitialised_on_cpu(model)
            else:
                model = auto_class.from_config(config, dtype=build_dtype)
                initialise_weights(model, seed)
        except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as error:
            raise UsageError(
                f"--model_config {args.model_config} does not build a model ({describe(error)}); fix the config"
            ) from None
    name_layer_classes(model)
    # Training never reuses a KV cache, and transformers isolates packed sequences
    # (position ids restarting at 0) only when no cache is passed. generate() still
    # caches: it follows generation_config.use_cache.
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    if speed is not None:  # attention kernel (for `packed_rows` if the batches are packed), checkpointing, Liger
        prepare_model(model, speed, packed_rows)
    if tensor_parallel.enabled():  # each rank keeps its slices of the layers (tp.yaml, fsdp_tp.yaml)
        tensor_parallel.shard(model)
    if expert_parallel.enabled():  # each rank keeps its experts (ep.yaml)
        expert_parallel.shard(model)
    memory.mark("model_built")
    return model


def _weights_come_from_rank0() -> bool:
    """FSDP with fsdp_cpu_ram_efficient_loading (the shipped FSDP configs): at prepare, accelerate
    shards the model on the meta device and broadcasts rank 0's weights into the shards, so
    the other ranks build theirs without memory (transformers does the same for a pretrained
    model, read by local rank 0). Under ZeRO-3, zero.Init builds each rank's partition."""
    from transformers.distributed.fsdp import is_fsdp_enabled

    return is_fsdp_enabled() and torch.distributed.get_rank() != 0


def _uninitialised_on_cpu(model) -> None:
    """Give meta parameters CPU storage that is never written: the OS backs untouched pages
    with no memory, and each parameter gets its own address (accelerate matches the
    optimizer's parameters to the sharded ones by it; on the meta device all are 0)."""
    buffers = dict(model.named_buffers())
    model.to_empty(device="cpu")
    for name, buffer in buffers.items():  # to_empty replaces buffers too: keep the built ones
        model.get_buffer(name).copy_(buffer)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def initialise_weights(model, seed: int) -> None:
    """(Re)initialise every module with the model's own `_init_weights`, drawing from a
    generator seeded by (seed, module name). The result does not depend on the order
    modules were built in, or on where: under DeepSpeed's zero.Init (ZeRO-3's
    `zero3_init_flag`) each module's parameters are gathered whole only while it is
    initialised, so the memory saving of building the model partitioned is kept."""
    for name, module in model.named_modules():
        parameters = list(module.parameters(recurse=False))
        if not parameters:
            continue
        with _gathered_for_init(parameters):
            torch.manual_seed(seed + zlib.crc32(name.encode()))
            init_module_weights(model, module)
    torch.manual_seed(seed)


def _gathered_for_init(parameters):
    if not any(is_zero3_parameter(p) for p in parameters):
        return contextlib.nullcontext()
    import deepspeed

    # Every rank draws the same values; rank 0's are scattered back into the partitions.
    return deepspeed.zero.GatheredParameters(parameters, modifier_rank=0)


@functools.lru_cache(maxsize=4)
def saved_config(name_or_path: str):
    """A model's config as saved, read once per process (a Hub model's is a request); not to be changed."""
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:  # a missing folder, a mistyped or unreachable Hub name, a bad config
        raise UsageError(
            f"no model config loads from {name_or_path} ({describe(error)}); pass a model folder "
            f"(config.json + weights) {reachable_hint(name_or_path)}"
        ) from None


def export_dtype(args: ModelArguments) -> torch.dtype:
    """The dtype `final/` is saved in: --save_dtype, or with `auto` the dtype the pretrained
    checkpoint was saved in (float32 for a model built from a config)."""
    if args.save_dtype != "auto":
        return getattr(torch, args.save_dtype)
    if args.model_config:
        return torch.float32
    saved = getattr(saved_config(args.model_name_or_path), "dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved)
    return saved if isinstance(saved, torch.dtype) else torch.float32


def check_block_size(args: ModelArguments, block_size: int) -> str | None:
    """--block_size against the positions the model's config gives (max_position_embeddings): past a
    learned position table it is a UsageError (the embedding lookup would fail mid-step); past a
    pretrained rotary model's, the warning to print (it runs there, on positions it may not have
    been trained on)."""
    try:
        config = saved_config(args.model_config or args.model_name_or_path)
    except Exception:  # noqa: BLE001 (refused in one line when the model loads, `load_model`)
        return None
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or block_size <= limit:
        return None
    said = (
        f"--block_size {block_size} is longer than the {limit} positions the model's config gives "
        "(max_position_embeddings)"
    )
    if not (getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)):
        raise UsageError(f"{said}, and its positions are a learned table; pass --block_size {limit} or less")
    if args.model_config:  # from scratch: trained at this length from the start
        return None
    return f"{said}: a rotary model runs there, on positions its pre-training may not have reached"


def model_hidden_size(args: ModelArguments) -> int | None:
    """The hidden size the model's config gives (None where it names none or does not load: a
    config that does not load is refused in one line when the model loads, `load_model`)."""
    try:
        config = saved_config(args.model_config or args.model_name_or_path)
    except Exception:  # noqa: BLE001 (OSError, ValueError, huggingface_hub's StrictDataclassClassValidationError, ...)
        return None
    size = getattr(config, "hidden_size", None)
    return size if isinstance(size, int) else None


def name_layer_classes(model) -> None:
    """Make `_no_split_modules` name the repeated transformer layer classes, and only them.

    FSDP's transformer-layer wrapping reads it. Some models leave it unset; others
    (BERT: BertEmbeddings) list a module holding the input embeddings, which
    accelerate then shards twice (it also shards the embeddings on their own) and
    FSDP2 fails. Layer classes are those repeated in a ModuleList."""
    repeated = {
        type(child).__name__
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1
        for child in m
        if len({type(c) for c in m}) == 1
    }
    declared = [name for name in declared_layer_classes(model) if name in repeated]
    if declared or repeated:
        declare_layer_classes(model, declared or sorted(repeated))
