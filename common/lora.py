"""LoRA on any recipe with peft: its options (--use_peft, as TRL's scripts name it), the adapters, the merged export.

    model = apply_lora(load_model(...), lora_args)   # the model itself without --use_peft

With --use_peft the base model is frozen and only the low-rank adapters train (and, for
sequence classification, the new classification head, which peft saves with the adapter).
final/ then holds the adapter (loads with PeftModel.from_pretrained on the base model) and,
with --save_merged_model, final_merged/ the base model with the adapter merged in (loads
without peft).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from common.errors import UsageError
from common.internals import is_zero3_parameter


@dataclass
class LoraArguments:
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters only; the base model stays frozen."})
    lora_r: int = field(default=8, metadata={"help": "The adapters' rank."})
    lora_alpha: int = field(default=16, metadata={"help": "The adapters' scale is lora_alpha / lora_r."})
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "Layer names to adapt (q_proj v_proj ...), or all-linear; default: peft's choice for the architecture."})
    save_merged_model: bool = field(default=False, metadata={
        "help": "Also export the base model with the adapter merged in, to <output_dir>/final_merged."})

    def __post_init__(self):
        if not self.use_peft:
            changed = [f"--{f.name}" for f in fields(self) if f.name != "use_peft"
                       and getattr(self, f.name) != (f.default_factory() if callable(f.default_factory) else f.default)]
            if changed:
                raise UsageError(f"{', '.join(changed)} shape(s) LoRA adapters, which train only with --use_peft; "
                                 "add --use_peft (or use_peft: true in the recipe YAML), or drop them")
        if self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise UsageError(f"--lora_r {self.lora_r} --lora_alpha {self.lora_alpha} --lora_dropout "
                             f"{self.lora_dropout}: the rank must be >= 1, alpha > 0 and dropout in [0, 1)")


def apply_lora(model, args: LoraArguments):
    """`model` with LoRA adapters (peft) when --use_peft, else `model` unchanged. A sequence
    classifier's new head trains too (peft's SEQ_CLS task keeps it as a module to save)."""
    if not args.use_peft:
        return model
    if args.save_merged_model and not model.config.name_or_path:
        raise UsageError("--save_merged_model reloads the base model from --model_name_or_path, and a model built "
                         "from --model_config has none: drop --save_merged_model")
    from peft import LoraConfig, get_peft_model

    classifier = type(model).__name__.endswith("ForSequenceClassification")
    targets = args.lora_target_modules
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets[0] if targets == ["all-linear"] else targets,
                        task_type="SEQ_CLS" if classifier else "CAUSAL_LM")
    try:
        model = get_peft_model(model, config)
    except ValueError as error:
        names = sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UsageError(f"--lora_target_modules {targets}: {str(error).splitlines()[0]} "
                         f"(the model's linear layers: {names})") from None
    _match_zero3_dtype(model)
    return model


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


def save_merged(peft_model, adapter_dir: str, out: str, tokenizer, dtype) -> None:
    """The base model reloaded (with the trained model's config: labels, pad token), the saved
    adapter merged into its weights, written as a plain Hugging Face folder in `dtype`."""
    from peft import PeftModel

    base = peft_model.get_base_model()
    base_path = peft_model.peft_config["default"].base_model_name_or_path
    reloaded = type(base).from_pretrained(base_path, config=base.config, dtype=torch.float32)
    merged = PeftModel.from_pretrained(reloaded, adapter_dir).merge_and_unload().to(dtype)
    merged.config.dtype = dtype
    merged.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
