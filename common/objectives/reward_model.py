"""A reward model: preference pairs scored by a sequence classifier with one output, its loss, metrics and use.

A row's reward is the classifier's score at its last token (the last 1 of its attention mask). Decoder
classifiers (Llama's, Qwen's, GPT-2's `score` head) pool their scores at the last token that is not
config.pad_token_id, so where the pad token is EOS (a tokenizer without a pad token borrows EOS, as Llama's
is loaded here; SmolLM2's pads with EOS) they would read the token before the EOS that ends an answer, alone or
padded; `row_rewards` reads the head's score of every
position instead and takes the one at the mask's last token. Encoders (BERT's `classifier`) score their
first token, which padding never moves: their own logits are used.

For a pair with rewards r_c (chosen) and r_r (rejected), an optional margin m (the data's `margin` column) and
--center_rewards_coefficient c (TRL's RewardTrainer; the second term keeps the rewards centred on 0):
    loss = -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2
averaged over the pairs. Metrics as TRL names them: accuracy (the share of pairs with r_c > r_r), margin
(the mean r_c - r_r), mean_reward, min_reward and max_reward (over both sides).

For GRPO or any other consumer of an exported reward model:

    model, tokenizer = load_reward_model("outputs/reward_model_demo/final", device, torch.float32)
    rewards = score(model, tokenizer, prompts, completions)   # a float32 tensor, one reward each

`score` renders each prompt and completion as training did (common.data.preference: the text layout's BOS and
EOS, or the chat template for conversations) and reads each row at its last token.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

from common.data.preference import PairBatches
from common.launch import mesh
from common.launch.errors import UsageError


def attach_margins(raw, datasets) -> bool:
    """Each tokenized pair's `margin` (a float) from the raw split's `margin` column, found by the pair's
    `index`; a split without the column trains with margin 0. A value that is not a finite number (or a text
    that reads as one: a CSV column with one bad cell is all text) ends the run in one line naming the row.
    Returns whether any split has margins."""
    found = False
    for split, dataset in raw.items():
        if "margin" not in dataset.column_names:
            continue
        found = True
        margins = []
        for row, value in enumerate(dataset["margin"]):
            number = None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                number = float(value)
            elif isinstance(value, str):
                try:
                    number = float(value)
                except ValueError:
                    pass
            if number is None or not math.isfinite(number):
                raise UsageError(
                    f"row {row} of the {split} data: margin {str(value)[:40]!r} is not a number; the margin column "
                    "holds one finite number per pair (how much more the chosen answer is preferred), or drop "
                    "the column (rows count from 0)"
                )
            margins.append(number)
        kept = datasets[split]
        datasets[split] = kept.add_column("margin", [margins[index] for index in kept["index"]])
    return found


class RewardBatches(PairBatches):
    """Pairs collated as DPO's (`PairBatches`: the B chosen rows, then the B rejected, right-padded into one
    tensor, so one forward scores both sides), with each pair's `margin` where the data has one, and as
    `labels` one label per row (1 chosen, 0 rejected), as a classifier's batch has: what the metrics count
    as label tokens."""

    def __call__(self, rows: list[dict]) -> dict:
        batch = super().__call__(rows)
        batch["labels"] = torch.cat([torch.ones(len(rows)), torch.zeros(len(rows))]).long()
        if "margin" in rows[0]:
            batch["margin"] = torch.tensor([row["margin"] for row in rows], dtype=torch.float32)
        return batch


def score_head(model):
    """The `score` head of a decoder classifier inside `model` (under DDP's or DeepSpeed's wrapper, FSDP2's
    class, peft's modules-to-save wrapper), whose output is every position's score; None for a classifier
    that scores one position of its own (an encoder's `classifier` on its first token)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and type(module).__name__.endswith("ForSequenceClassification"):
            head = getattr(module, "score", None)
            return head if isinstance(head, torch.nn.Module) else None
    return None


def row_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's reward (float32): the score at the last token of its attention mask. A forward hook on the
    score head keeps the scores of every position (the model's own output is pooled by pad_token_id, which
    cannot tell padding from an EOS that is the same token); it is removed when the forward returns."""
    head = score_head(model)
    every_position = []
    handle = head.register_forward_hook(lambda module, inputs, output: every_position.append(output)) if head else None
    try:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    finally:
        if handle is not None:
            handle.remove()
    if not every_position:
        return logits[:, 0].float()
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask.to(positions.dtype)).argmax(-1)  # the mask's last 1, either padding side
    scores = every_position[-1]
    return scores[torch.arange(scores.shape[0], device=scores.device), last.to(scores.device), 0].float()


def pair_rewards(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards of a `RewardBatches` batch, from one forward."""
    return row_rewards(model, batch["input_ids"], batch["attention_mask"]).chunk(2)


def reward_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None, center_coefficient: float = 0.0
) -> tuple[torch.Tensor, dict]:
    """Per-pair losses, whose mean is TRL's loss (the centring term's mean over the pairs included), and the
    train line's metrics (`MetricsLogger.record_values`: tensors it averages over the window's entries)."""
    difference = chosen - rejected
    losses = -F.logsigmoid(difference - (margin if margin is not None else 0.0))
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    rewards = torch.cat([chosen, rejected]).detach()
    metrics = {
        "accuracy": (difference > 0).float().detach(),
        "margin": difference.detach(),
        "mean_reward": rewards,
        # one entry per micro-batch: a train line holds the mean of its micro-batches' min and max (each rank's);
        # eval lines hold the true min and max over every held-out pair (`evaluate_rewards`)
        "min_reward": rewards.min().reshape(1),
        "max_reward": rewards.max().reshape(1),
    }
    return losses, metrics


@torch.no_grad()
def evaluate_rewards(model, dataloader, accelerator, center_coefficient: float = 0.0) -> dict:
    """eval_loss, eval_accuracy, eval_margin, eval_mean_reward, eval_min_reward and eval_max_reward over every
    held-out pair, each counted once (`mesh.gather_for_metrics` drops the pairs that evened out the last
    batch), and eval_pairs."""
    model.eval()
    gathered = []
    for batch in dataloader:
        chosen, rejected = pair_rewards(model, batch)
        losses, _ = reward_loss(chosen, rejected, batch.get("margin"), center_coefficient)
        gathered.append(mesh.gather_for_metrics(accelerator, torch.stack([losses, chosen, rejected], dim=1)).cpu())
    model.train()
    losses, chosen, rejected = torch.cat(gathered).double().unbind(1)
    rewards = torch.cat([chosen, rejected])
    return {
        "eval_loss": losses.mean().item(),
        "eval_accuracy": (chosen > rejected).double().mean().item(),
        "eval_margin": (chosen - rejected).mean().item(),
        "eval_mean_reward": rewards.mean().item(),
        "eval_min_reward": rewards.min().item(),
        "eval_max_reward": rewards.max().item(),
        "eval_pairs": len(chosen),
    }


def check_reward_model_start(model_args) -> None:
    """A pretrained sequence classifier with another number of outputs than one (a folder fine-tuned for
    labels) is refused in one line before anything loads: its head does not fit a reward model's."""
    from common.models.loading import is_adapter_folder, saved_config

    name = model_args.model_name_or_path
    if not name or is_adapter_folder(name):
        return
    config = saved_config(name)
    classifier = any(arch.endswith("ForSequenceClassification") for arch in config.architectures or [])
    if classifier and config.num_labels != 1:
        raise UsageError(
            f"--model_name_or_path {name} is a sequence classifier with {config.num_labels} outputs, and a reward "
            "model has one: start from its base model (or a causal LM), whose new score head then has one "
            "output, or from a reward model's final_merged/"
        )


def check_reward_folder(path: str) -> None:
    """A folder that holds no reward model (a causal LM, a classifier with other outputs, an adapter of one) is
    refused in one line saying what it holds, read from its config before anything loads."""
    from common.models.loading import ADAPTER_CONFIG, is_adapter_folder, saved_config

    if is_adapter_folder(path):
        with open(os.path.join(path, ADAPTER_CONFIG)) as handle:
            task = json.load(handle).get("task_type")
        if task not in (None, "SEQ_CLS"):
            raise UsageError(
                f"{path} holds a LoRA adapter of task {task}, not of a reward model (SEQ_CLS, one output): a "
                "reward is a reward model's final/ or final_merged/ (recipes/reward_model.py trains one)"
            )
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        return  # not a model folder: loading says so
    config = saved_config(path)
    architectures = config.architectures or []
    if not any(arch.endswith("ForSequenceClassification") for arch in architectures):
        holds = ", ".join(architectures) or f"a {config.model_type} model with no architecture named"
        raise UsageError(
            f"{path} holds {holds}, not a reward model (a sequence classifier with one output): "
            "recipes/reward_model.py trains one from it (make reward-model), then pass its final/"
        )
    if config.num_labels != 1:
        raise UsageError(
            f"{path} is a sequence classifier with {config.num_labels} outputs; a reward model has one "
            "(recipes/reward_model.py trains one)"
        )


def load_reward_model(path: str, device="cpu", dtype=torch.float32):
    """(model, tokenizer) of a reward model: a Hugging Face sequence-classification folder with one output
    (recipes/reward_model.py's final/ or final_merged/), or a LoRA run's final/ (an adapter with the score
    head in it), merged into its base; in eval mode, frozen, on `device`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.models.loading import adapter_base_model, is_adapter_folder

    check_reward_folder(path)
    if is_adapter_folder(path):
        from peft import PeftModel

        base = AutoModelForSequenceClassification.from_pretrained(adapter_base_model(path), num_labels=1, dtype=dtype)
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
    else:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    if model.config.num_labels != 1:
        raise UsageError(
            f"{path} is a sequence classifier with {model.config.num_labels} outputs; a reward model has one "
            "(recipes/reward_model.py trains one)"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.requires_grad_(False)
    return model.eval().to(device), tokenizer


@torch.no_grad()
def score(model, tokenizer, prompts: list, completions: list, batch_size: int = 32) -> torch.Tensor:
    """The reward of each (prompt, completion), float32 on the CPU. Rendered as the pairs were in training
    (`common.data.chat.encode_example`): text as prompt (with BOS) + completion + EOS; a conversation's prompt
    (a list of messages) with its completion (a list of messages, or the assistant's text) through the
    tokenizer's chat template."""
    from common.data.chat import encode_example

    rows = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if not isinstance(prompt, str) and isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        ids, _ = encode_example({"prompt": prompt, "completion": completion}, tokenizer, "prompt_completion", None)
        rows.append(ids)
    device = next(model.parameters()).device
    rewards = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, ids in enumerate(chunk):
            input_ids[i, : len(ids)], attention_mask[i, : len(ids)] = torch.tensor(ids), 1
        rewards.append(row_rewards(model, input_ids.to(device), attention_mask.to(device)).cpu())
    return torch.cat(rewards) if rewards else torch.zeros(0)
