"""What the TRL peers (trl_dpo_loop.py, trl_grpo_loop.py) share: the job's Trainer settings and the result file.

trl is installed by `make benchmark-peers` only; the recipes do not use it.
"""

import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common.models.loading import initialise_weights


def recipe_built_model(model_config: str, tokenizer):
    """The job's model as the recipes build it from a config (the tokenizer's vocabulary and pad/EOS/BOS ids,
    common.models.loading.initialise_weights with seed 0: the recipe's starting weights), its training forwards
    filling no cache, as the recipes' (generate still caches)."""
    config = AutoConfig.from_pretrained(
        model_config,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    initialise_weights(model, 0)
    model.config.use_cache = False
    return model


def job_settings(args, output_dir: str) -> dict:
    """The Trainer arguments every TRL peer takes from the job (benchmarks/benchmark_peers.py): per-device batch,
    steps, learning rate and linear schedule, clipping at 1.0, no weight decay, Trainer's default optimizer
    (torch's fused AdamW), the accelerate config's precision, no activation checkpointing (TRL's configs turn it
    on by default; the recipes leave it off), the loss logged at step 1 and every --warmup steps."""
    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16",
        logging_steps=args.warmup,
        logging_first_step=True,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        seed=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
        gradient_checkpointing=False,
    )
    if not torch.cuda.is_available():
        # A CPU host, over gloo. Under DeepSpeed too: TrainingArguments refuses bf16 without use_cpu there, and
        # Trainer's Accelerator still takes DeepSpeed from the launch (the peers write the strategy they ran).
        settings.update(use_cpu=True, ddp_backend="gloo")
    return settings


def write_result(path: str, clock, trainer, **figures) -> None:
    """The timed steps' seconds (`clock`: trainer_loop.StepClock), the processes and strategy `trainer` trained
    with, its optimizer, and the peer's figures, as JSON."""
    with open(path, "w") as handle:
        json.dump(
            {
                "seconds": clock.timed(clock.times),
                "processes": trainer.args.world_size,
                "distributed_type": trainer.accelerator.distributed_type.value,
                "optim": trainer.args.optim,
                **figures,
            },
            handle,
        )
