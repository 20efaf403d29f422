"""LoRA on any recipe with peft: its options (--use_peft, as TRL's scripts name it), the adapters, the merged export.

    model = apply_lora(load_model(...), lora_args)   # the model itself without --use_peft

With --use_peft the base model is frozen and only the low-rank adapters train (and, for
sequence classification, the new classification head, which peft saves with the adapter).
final/ then holds the adapter (loads with PeftModel.from_pretrained on the base model) and,
with --save_merged_model, final_merged/ the base model with the adapter merged in (loads
without peft).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Annotated

import torch

from common.launch.errors import UsageError
from common.launch.internals import is_zero3_parameter
from common.options.ranges import Range, check_ranges
from common.training import experts


@dataclass
class LoraArguments:
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters only; the base model stays frozen."})
    lora_r: Annotated[int, Range(low=1)] = field(default=8, metadata={"help": "The adapters' rank."})
    lora_alpha: Annotated[int, Range(above=0)] = field(
        default=16, metadata={"help": "The adapters' scale is lora_alpha / lora_r."}
    )
    lora_dropout: Annotated[float, Range(0, below=1)] = 0.0
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Layer names to adapt (q_proj v_proj ...), or all-linear; default: peft's choice for the architecture."
        },
    )
    save_merged_model: bool = field(
        default=False,
        metadata={"help": "Also export the base model with the adapter merged in, to <output_dir>/final_merged."},
    )

    def __post_init__(self):
        check_ranges(self)
        if not self.use_peft:
            changed = [
                f"--{f.name}"
                for f in fields(self)
                if f.name != "use_peft"
                and getattr(self, f.name) != (f.default_factory() if callable(f.default_factory) else f.default)
            ]
            if changed:
                raise UsageError(
                    f"{', '.join(changed)} shape(s) LoRA adapters, which train only with --use_peft; "
                    "add --use_peft (or use_peft: true in the recipe YAML), or drop them"
                )


def check_adapter_arguments(model_args, lora_args: LoraArguments | None) -> None:
    """Before anything of the run (common.run.start_run): an adapter to start from, given as
    --adapter_name_or_path or as --model_name_or_path (a --use_peft run's final/, which then reads as
    its base model plus --adapter_name_or_path: common.models.loading.resolve_adapter_folder), trains on with
    --use_peft only; without it, one line that says what to pass (fine-tuning every weight needs the
    merged model, which the run wrote to final_merged/ with --save_merged_model)."""
    from common.models.loading import adapter_base_model, is_adapter_folder, resolve_adapter_folder

    given_as_model = is_adapter_folder(model_args.model_name_or_path)
    if model_args.adapter_name_or_path and model_args.model_config:
        raise UsageError(
            f"--adapter_name_or_path {model_args.adapter_name_or_path} goes on the pretrained model it was "
            "trained on (--model_name_or_path), not on one built from --model_config: pass that base model "
            "as --model_name_or_path instead of --model_config"
        )
    if (given_as_model or model_args.adapter_name_or_path) and not (lora_args and lora_args.use_peft):
        merged = "or fine-tune every weight from the merged model (its run's final_merged/, written with "
        merged += "--save_merged_model) as --model_name_or_path"
        if given_as_model:
            folder = model_args.model_name_or_path
            raise UsageError(
                f"--model_name_or_path {folder} is a LoRA adapter (on base {adapter_base_model(folder)}), "
                f"which trains only with --use_peft: add --use_peft to train it on (read as "
                f"--adapter_name_or_path {folder} on its base), {merged}"
            )
        raise UsageError(
            f"--adapter_name_or_path {model_args.adapter_name_or_path} is a LoRA adapter, which trains only "
            f"with --use_peft: add --use_peft to train it on, {merged}"
        )
    resolve_adapter_folder(model_args)


def apply_lora(model, args: LoraArguments):
    """`model` with LoRA adapters (peft) when --use_peft, else `model` unchanged. A sequence
    classifier's new head trains too (peft's SEQ_CLS task keeps it as a module to save). A model that
    holds an adapter already (--adapter_name_or_path, loaded frozen by common.models.loading.load_model) trains
    that adapter on: base + adapter is where the run starts."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        if not args.use_peft:  # refused at the start (check_adapter_arguments): never trained with nothing to train
            raise UsageError("an adapter loaded with --adapter_name_or_path trains only with --use_peft; add it")
        return _train_on(model, args)
    if not args.use_peft:
        return model
    base = model.config.name_or_path  # a folder or Hub name; built from --model_config: "" or the config file
    if args.save_merged_model and (not base or os.path.isfile(base)):
        raise UsageError(
            "--save_merged_model reloads the base model from --model_name_or_path, and a model built "
            "from --model_config has none: drop --save_merged_model"
        )
    from peft import LoraConfig, get_peft_model

    classifier = type(model).__name__.endswith("ForSequenceClassification")
    targets = args.lora_target_modules
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        task_type="SEQ_CLS" if classifier else "CAUSAL_LM",
    )
    try:
        model = get_peft_model(model, config)
    except ValueError as error:
        names = sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UsageError(
            f"--lora_target_modules {targets}: {str(error).splitlines()[0]} (the model's linear layers: {names})"
        ) from None
    _match_zero3_dtype(model)
    if experts.num_experts(model.config):
        say_what_lora_adapts(model)
    return model


def say_what_lora_adapts(model) -> None:
    """On a mixture-of-experts model, one line (the main process) naming the modules LoRA adapts and whether the
    experts (stacked tensors, not linear layers: peft adapts them only where asked, as all-linear does) and the
    routers are among them."""
    from accelerate import PartialState
    from peft.tuners.lora import LoraLayer

    wrapped = {
        name.split(".")[-1]: type(module.get_base_layer()).__name__
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and not name.endswith(".base_layer")
    }
    experts_adapted = any(kind.endswith("Experts") for kind in wrapped.values())
    routers_adapted = any("Router" in kind for kind in wrapped.values())
    if PartialState().is_main_process:
        print(
            f"LoRA on a mixture-of-experts model: adapters on {', '.join(sorted(wrapped))}; the experts' weights "
            + ("adapted too (each projection's stacked tensor)" if experts_adapted else "frozen")
            + ", the routers "
            + ("adapted" if routers_adapted else "frozen"),
            file=sys.stderr,
        )


# LoraArguments' fields that shape an adapter, by the name peft's LoraConfig gives them
ADAPTER_SHAPE = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}


def _train_on(model, args: LoraArguments):
    """The loaded adapter made trainable, as PeftModel.from_pretrained(..., is_trainable=True) makes it
    (peft's own load_adapter does the same: inference_mode off, set_requires_grad). Its shape is the
    saved one: a --lora_* value set otherwise is refused, not ignored. Its config then names the base
    it trains on, so that final/ loads on it (and final_merged/ is built from it)."""
    from peft.tuners.lora import LoraLayer

    config = model.peft_config["default"]
    defaults = {f.name: f.default for f in fields(LoraArguments)}
    for name, saved_name in ADAPTER_SHAPE.items():
        asked, saved = getattr(args, name), getattr(config, saved_name)
        if asked != defaults[name] and asked != saved:
            raise UsageError(
                f"--{name} {asked} asks for another adapter shape, but the adapter loaded (--adapter_name_or_path) "
                f"has {saved_name} {saved} and trains on as it is: set --{name} {saved}, or drop it"
            )
    targets, saved = args.lora_target_modules, config.target_modules
    saved = {saved} if isinstance(saved, str) else set(saved or ())
    base = model.get_base_model()
    adapted = {name for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    if targets is not None and modules_named(base, targets) != adapted:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in adapted})
        raise UsageError(
            f"--lora_target_modules {' '.join(targets)} asks for another adapter shape, but the adapter loaded "
            f"(--adapter_name_or_path) adapts {len(adapted)} modules ({', '.join(kinds)}) and trains on as it is: "
            "drop --lora_target_modules"
        )
    # what trains is the saved shape: run.json and the model cards record it, not the flags' defaults
    args.lora_r, args.lora_alpha, args.lora_dropout = config.r, config.lora_alpha, config.lora_dropout
    args.lora_target_modules = sorted(saved)
    config.inference_mode = False
    model.set_requires_grad("default")
    config.base_model_name_or_path = model.get_base_model().config.name_or_path
    _match_zero3_dtype(model)
    return model


def modules_named(base, targets: list[str]) -> set[str]:
    """The modules of `base` (an adapter's LoRA layers counted as the layers they wrap) that
    --lora_target_modules `targets` adapts, by peft's rules: "all-linear" every linear layer but the output
    layer, else each module whose name is a target or ends with "." and one."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    wrapped = [name for name, module in base.named_modules() if isinstance(module, (LoraLayer, ModulesToSaveWrapper))]
    output = base.get_output_embeddings()
    names = set()
    for name, module in base.named_modules():
        if not name or any(name.startswith(layer + ".") for layer in wrapped):
            continue  # an adapter's own parts (base_layer, lora_A, ...), a head trained whole (modules_to_save)
        if targets == ["all-linear"]:
            if isinstance(module, LoraLayer) or isinstance(module, torch.nn.Linear) and module is not output:
                names.add(name)
        elif any(name == target or name.endswith("." + target) for target in targets):
            names.add(name)
    return names


def _match_zero3_dtype(model) -> None:
    """Under ZeRO-3, zero.Init built the base model's parameters in the config's precision (bf16),
    and DeepSpeed flattens every trainable parameter into one buffer of one dtype (its optimizer
    keeps fp32 masters of them): parameters peft made afterwards take that dtype. Without this, a
    classifier's head copied by peft (bf16) and the adapters (fp32) stop DeepSpeed at prepare with
    a bare AssertionError."""
    dtypes = {p.dtype for p in model.parameters() if is_zero3_parameter(p)}
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        for parameter in model.parameters():
            if parameter.requires_grad and not is_zero3_parameter(parameter):
                parameter.data = parameter.data.to(dtype)


def saved_adapter_names(model, state: dict) -> list[str]:
    """The names in `state` (the peft model's state dict; unmaterialised tensors will do: ZeRO-3's
    placeholders, FSDP2's shards) whose tensors peft's save_pretrained writes, chosen by peft itself
    (get_peft_model_state_dict, save_embedding_layers="auto" as save_pretrained has it): the adapters,
    the modules to save (a classifier's head) and the embeddings where peft saves them. The export
    gathers these only, not the base model."""
    import warnings

    from peft.utils import get_peft_model_state_dict

    kept = set()
    with warnings.catch_warnings():  # "Setting save_embedding_layers to True ...": save_pretrained says it again
        warnings.simplefilter("ignore")
        for adapter in model.peft_config:
            # peft renames the keys (no adapter name) but passes the state's tensors through: known by identity
            saved = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
            kept.update(id(value) for value in saved.values())
    return [key for key, value in state.items() if id(value) in kept]


def merged_model_skeleton(peft_model):
    """The merged model without weights (on the meta device): the base model's class with the trained
    model's config (labels, pad token) and generation config."""
    base = peft_model.get_base_model()
    with torch.device("meta"):
        merged = type(base)(base.config)
    if base.can_generate() and base.generation_config is not None:
        merged.generation_config = copy.deepcopy(base.generation_config)
    return merged


def merged_tensors(peft_model, adapter_dir: str, names: list[str], prefix: str):
    """(name, float32 tensor) for each of `names` (the merged model's, `merged_model_skeleton`), one
    at a time: the base model's tensor read from its safetensors files (a key there may lack the
    model's `prefix`, as from_pretrained allows) plus the saved adapter's delta where LoRA adapts it
    (peft's get_delta_weight, which merge_and_unload adds), or the adapter's own copy (a module to
    save). None where that cannot be done tensor by tensor (the base not a local safetensors
    folder, a tensor not found there under its name, a LoRA variant such as DoRA): `save_merged`."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    files = _safetensors_files(peft_model.peft_config["default"].base_model_name_or_path)
    if files is None:
        return None
    base = peft_model.get_base_model()
    with torch.device("meta"):
        skeleton = type(base)(base.config)
    # Each base tensor a placeholder (one element, expanded to its shape: no memory), which peft
    # loads the adapter beside (its tensors, in the export dtype, to float32 as in a float32 model).
    placeholders = {}
    for module in skeleton.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            held = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
            placeholders[id(held)] = held
            if isinstance(tensor, torch.nn.Parameter):
                held = torch.nn.Parameter(held, requires_grad=False)
                placeholders[id(held)] = held
            setattr(module, name, held)
    adapted = PeftModel.from_pretrained(skeleton, adapter_dir, low_cpu_mem_usage=True).get_base_model()
    for parameter in adapted.parameters():
        if id(parameter) not in placeholders and parameter.is_floating_point():
            parameter.data = parameter.data.float()
    plan = []
    for name in names:
        *path, attribute = name.split(".")
        owner, layer = adapted, None
        for part in path:
            owner = getattr(owner, part)
            if isinstance(owner, ModulesToSaveWrapper):
                owner = owner.modules_to_save["default"]
            layer = owner if isinstance(owner, LoraLayer) else None
            if layer is not None:
                if layer.lora_variant or any(layer.lora_bias.values()):
                    return None
                owner = layer.get_base_layer()
        source = getattr(owner, attribute)
        key = next((key for key in (name, name.removeprefix(prefix), prefix + name) if key in files), None)
        from_file = id(source) in placeholders
        if from_file and key is None:
            return None
        delta = layer if attribute == "weight" else None
        plan.append((name, None if from_file else source, files.get(key), key, delta))
    merged = {id(entry[-1]) for entry in plan}
    if any(isinstance(module, LoraLayer) and id(module) not in merged for module in adapted.modules()):
        return None  # an adapted tied copy (the output layer tied to the embeddings): peft merges into both
    return _merged(plan)


def _merged(plan):
    from safetensors import safe_open

    for name, source, path, key, layer in plan:
        if source is not None:
            tensor = source.detach()
        else:
            # opened for each tensor: the file's mapping, whose pages read so far count in the
            # resident set while it is open, goes with the tensor
            with safe_open(path, framework="pt") as handle:
                tensor = handle.get_tensor(key)
            tensor = tensor.float() if tensor.is_floating_point() else tensor
        if layer is not None:
            tensor = tensor + layer.get_delta_weight("default")
        yield name, tensor


def _safetensors_files(path: str) -> dict | None:
    """{tensor name: file} of a local folder's model.safetensors (or its shards), else None."""
    from safetensors import safe_open

    index, single = os.path.join(path, "model.safetensors.index.json"), os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as handle:
            return {key: os.path.join(path, file) for key, file in json.load(handle)["weight_map"].items()}
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    return None


def save_merged(peft_model, adapter_dir: str, out: str, tokenizer, dtype) -> None:
    """The base model reloaded whole (with the trained model's config: labels, pad token), the saved
    adapter merged into its weights, written as a plain Hugging Face folder in `dtype`: the way
    where `merged_tensors` cannot read the base model one tensor at a time."""
    from peft import PeftModel

    base = peft_model.get_base_model()
    base_path = peft_model.peft_config["default"].base_model_name_or_path
    reloaded = type(base).from_pretrained(base_path, config=base.config, dtype=torch.float32)
    merged = PeftModel.from_pretrained(reloaded, adapter_dir).merge_and_unload().to(dtype)
    merged.config.dtype = dtype
    merged.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
