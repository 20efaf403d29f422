"""The LM head on the completions' positions only (GRPO's log-probabilities and KL, distillation's divergence).

What these score is each completion token's distribution; the prompts' and the padding's logits are never made."""

from __future__ import annotations

import torch


def completion_logits(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, labels, columns): the model's logits at `columns` only, the positions that predict a completion token
    of some row (the LM head runs on none of the prompt positions before the shortest prompt's end, nor on the
    padding after the longest row: transformers' `logits_to_keep`), and `labels` (rows, positions), each position's
    target (-100 off the completion). On a slice of split rows (common.parallel.sequence_parallel.split_rows:
    `shift_labels` and `position_ids`) every position predicts its own target; else position p predicts token p + 1.
    A model whose forward ignores `logits_to_keep` gives every position's logits, and the columns are taken here."""
    if "shift_labels" in batch:  # a slice: every position predicts its own target
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        labels = batch["shift_labels"]
    else:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        labels = batch["labels"][:, 1:]
    columns = (labels != -100).any(0).nonzero().squeeze(1)
    if len(columns) == 0:  # no completion token in this batch (a slice of rows all prompt): one position, masked
        columns = columns.new_zeros(1)
    logits = model(**inputs, logits_to_keep=columns).logits
    if logits.shape[1] != len(columns):  # every position's (a forward without logits_to_keep)
        logits = logits[:, columns]
    return logits, labels, columns
