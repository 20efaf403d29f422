"""Optimizer, schedule and evaluation: the pieces around a recipe's training loop."""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from common.arguments import TrainingArguments

NO_DECAY = ("bias", "norm")  # LayerNorm/RMSNorm weights and biases are not decayed


def create_optimizer(model, args: TrainingArguments) -> torch.optim.Optimizer:
    """AdamW with two groups: weight decay on matrices, none on biases and norms."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        (no_decay if any(key in name.lower() for key in NO_DECAY) else decay).append(parameter)
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)


def total_training_steps(args: TrainingArguments, batches_per_epoch: int) -> int:
    """Optimizer steps in the run: max_steps if set, else epochs x updates per epoch."""
    if args.max_steps > 0:
        return args.max_steps
    return args.num_train_epochs * max(1, batches_per_epoch // args.gradient_accumulation_steps)


def create_scheduler(optimizer, args: TrainingArguments, max_steps: int, num_processes: int):
    # accelerate's prepared scheduler advances num_processes times per optimizer step
    # (it assumes a batch grows with the world size), so the horizon is scaled to match.
    return get_scheduler(args.lr_scheduler_type, optimizer,
                         num_warmup_steps=args.warmup_steps * num_processes,
                         num_training_steps=max_steps * num_processes)


@torch.no_grad()
def evaluate_loss(model, dataloader, accelerator) -> dict:
    """Token-weighted mean loss over the whole eval set, every example counted once.

    Per-example loss sums and token counts are gathered with `gather_for_metrics`,
    which drops the samples duplicated to even out the last batch across ranks."""
    model.eval()
    loss_sum, token_count = 0.0, 0
    for batch in dataloader:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        labels = batch["labels"][:, 1:]
        per_token = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
        mask = labels != -100
        sums, counts = accelerator.gather_for_metrics(((per_token * mask).sum(1), mask.sum(1)))
        loss_sum += sums.double().sum().item()
        token_count += int(counts.sum().item())
    model.train()
    loss = loss_sum / max(token_count, 1)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": token_count}


def train_batches(accelerator, dataloader, start_step: int, gradient_accumulation_steps: int):
    """Training batches, epoch after epoch without end, starting where `start_step`
    optimizer steps left off: the epoch's seeded order is restored with `set_epoch`
    and the batches already consumed in it are skipped. The caller stops at max_steps."""
    batches_done = start_step * gradient_accumulation_steps
    epoch, skip = divmod(batches_done, len(dataloader))
    while True:
        dataloader.set_epoch(epoch)
        yield from accelerator.skip_first_batches(dataloader, skip) if skip else dataloader
        epoch, skip = epoch + 1, 0
