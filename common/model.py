"""Models and tokenizers: pretrained (Hub name or folder) or built from a config (seeded)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.arguments import ModelArguments


def load_tokenizer(args: ModelArguments):
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path or args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args: ModelArguments, tokenizer, seed: int, gradient_checkpointing: bool = False,
               auto_class=AutoModelForCausalLM, **config_overrides):
    """From `model_name_or_path`, or a fresh model from `model_config` sized to the tokenizer."""
    if args.model_name_or_path:
        model = auto_class.from_pretrained(args.model_name_or_path, **config_overrides)
    else:
        config = AutoConfig.from_pretrained(
            args.model_config, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **config_overrides)
        torch.manual_seed(seed)
        model = auto_class.from_config(config)
    if gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_parameters(model) -> dict:
    def numel(p):  # under ZeRO-3 init a parameter is an empty placeholder; ds_numel is its size
        return getattr(p, "ds_numel", p.numel())

    total = sum(numel(p) for p in model.parameters())
    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    return {"total_parameters": total, "trainable_parameters": trainable}
