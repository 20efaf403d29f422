"""Preference pairs (prompt, chosen, rejected): their formats, tokenization with completion-only labels, and batches.

Three layouts, as users have them:
* `prompt`, `chosen`, `rejected` as text: the prompt's tokens (with the tokenizer's BOS) then
  each completion's and EOS, no chat template;
* TRL's conversational format: `prompt` a list of messages, `chosen` and `rejected` lists of
  (assistant) messages, rendered with the chat template;
* UltraFeedback-binarized's: `chosen` and `rejected` whole chats that share their prompt turns
  (every turn up to the last non-assistant one); a `prompt` column beside them is not read.
Messages may also be OpenAI text parts or ShareGPT turns (`common.data.chat.as_messages`).

Labels cover the completion only (`common.data.chat.encode_example`, as SFT's prompt-completion rows).
A prompt over --max_prompt_length tokens is cut from its start (counted); a prompt that leaves no
room in --block_size is refused in one line; a pair whose longer side is over --block_size follows
--overlong: `drop` (counted) or `truncate` (the completion cut at the end, counted; a pair whose two
sides the cut makes the same is dropped, counted as `identical_once_cut`). Nothing is cut or dropped
without a count in the log and run.json.

`PairBatches` puts a batch's chosen rows first and its rejected rows after, padded into one
tensor, so that one forward scores both sides of every pair.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from common.data.chat import OVERLONG, as_messages, encode_example
from common.data.chat_template import check_jinja
from common.launch.errors import UsageError
from common.launch.peers import main_process_alone


if TYPE_CHECKING:
    from datasets import DatasetDict


SIDES = ("chosen", "rejected")
DROPPED = ("too_long", "identical_once_cut")  # a pair's statuses that leave it out (the others: kept, maybe cut)


def check_pair_columns(columns: list[str]) -> None:
    missing = [name for name in SIDES if name not in columns]
    if missing:
        raise UsageError(
            f'preference data needs "chosen" and "rejected" columns (and "prompt" unless chosen and '
            f"rejected are whole conversations); {', '.join(missing)} missing, found {columns}: rename "
            "the columns, or map them with dataset_mixture's columns"
        )


def split_pair(example: dict, row: int) -> tuple:
    """(prompt, chosen completion, rejected completion) of one row: text, or lists of messages."""
    chosen, rejected = example["chosen"], example["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(example.get("prompt"), str):
            raise UsageError(
                f'row {row}: chosen and rejected are text, so "prompt" must be text too; found '
                f"{str(example.get('prompt'))[:80]!r}"
            )
        return example["prompt"], chosen, rejected
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise UsageError(
            f"row {row}: one of chosen and rejected is text and the other is not; give both as text or "
            "both as lists of messages"
        )
    try:
        chosen, rejected = as_messages(chosen), as_messages(rejected)
    except UsageError as error:
        raise UsageError(f"row {row}: {error}") from None
    if chosen and chosen[0]["role"] == "assistant":  # TRL's conversational format: the prompt's turns apart
        if not isinstance(example.get("prompt"), list):
            raise UsageError(
                f'row {row}: chosen and rejected are answers (assistant messages), so "prompt" must be '
                f"a list of messages; found {str(example.get('prompt'))[:80]!r}"
            )
        try:
            return as_messages(example["prompt"]), chosen, rejected
        except UsageError as error:
            raise UsageError(f"row {row}: {error}") from None
    cut = max((i + 1 for i, message in enumerate(chosen) if message["role"] != "assistant"), default=0)
    if chosen[:cut] != rejected[:cut]:  # whole chats (UltraFeedback): the shared prompt turns
        raise UsageError(
            f"row {row}: chosen and rejected are whole conversations whose prompt turns differ (the turns "
            "up to the last user turn must be the same in both); fix the row or drop it"
        )
    if cut == 0 or cut >= len(chosen) or cut >= len(rejected):
        raise UsageError(
            f"row {row}: a conversation needs prompt turns and then an assistant answer on each side; "
            f"chosen has {len(chosen)} turns, rejected {len(rejected)}, the prompt {cut}"
        )
    return chosen[:cut], chosen[cut:], rejected[cut:]


def encode_pair(
    example: dict, row: int, tokenizer, block_size: int, max_prompt_length: int | None, overlong: str
) -> dict:
    """The row's two sides' input_ids and labels, its `status` (ok, too_long: dropped, or completion_cut)
    and whether its prompt was cut (`prompt_cut`)."""
    prompt, chosen, rejected = split_pair(example, row)
    status, prompt_cut, out, uncut = "ok", False, {}, []
    for side, completion in zip(SIDES, (chosen, rejected)):
        ids, labels = encode_example(
            {"prompt": prompt, "completion": completion}, tokenizer, "prompt_completion", None
        )
        answer = next((i for i, label in enumerate(labels) if label != -100), len(labels))
        if max_prompt_length is not None and answer > max_prompt_length:
            ids, labels = ids[answer - max_prompt_length :], labels[answer - max_prompt_length :]
            answer, prompt_cut = max_prompt_length, True
        if answer >= block_size:
            raise UsageError(
                f"row {row}: the prompt is {answer} tokens, which leaves no room for the answer in "
                f"--block_size {block_size}; raise --block_size or set --max_prompt_length (prompts are "
                "then cut from their start)"
            )
        uncut.append(ids)
        if len(ids) > block_size:
            status = "too_long" if overlong == "drop" else "completion_cut"
            ids, labels = ids[:block_size], labels[:block_size]
        out[f"{side}_input_ids"], out[f"{side}_labels"] = ids, labels
    if uncut[0] == uncut[1]:
        raise UsageError(
            f"row {row}: chosen and rejected are the same once tokenized ({str(chosen)[:60]!r}); a pair "
            "must differ: drop the row"
        )
    if status == "completion_cut" and out["chosen_input_ids"] == out["rejected_input_ids"]:
        status = "identical_once_cut"  # they differ past --block_size only: no signal left, dropped
    return {**out, "status": status, "prompt_cut": prompt_cut}


def tokenize_pairs(
    raw: DatasetDict,
    tokenizer,
    block_size: int,
    max_prompt_length: int | None,
    overlong: str,
    accelerator,
    num_proc: int | None = None,
) -> tuple[DatasetDict, dict]:
    """Tokenize every split's pairs; each row keeps its index in its split (`index`, by which
    precomputed reference log-probs are found). Returns the datasets and, per split, the rows
    dropped and cut and why ({"train": {"too_long": 3, "prompt_cut": 5}})."""
    from datasets import DatasetDict

    if overlong not in OVERLONG:
        raise UsageError(f"--overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    for split, dataset in raw.items():
        check_pair_columns(dataset.column_names)
    first = raw["train"][0]
    if not (isinstance(first["chosen"], str)) and not tokenizer.chat_template:
        raise UsageError("the tokenizer has no chat_template; pass --chat_template (a template file or text)")
    if tokenizer.chat_template:
        check_jinja(tokenizer.chat_template, "the chat template (--chat_template, or the tokenizer's)")
    if not tokenizer.is_fast:
        raise UsageError("preference labels need a fast tokenizer (offsets); load one with tokenizers installed")

    def encode(example, row):
        return {**encode_pair(example, row, tokenizer, block_size, max_prompt_length, overlong), "index": row}

    with accelerator.main_process_first(), main_process_alone(accelerator, "tokenizing"):
        encoded = raw.map(
            encode,
            with_indices=True,
            num_proc=num_proc,
            remove_columns=raw["train"].column_names,
            desc="tokenizing preference pairs",
        )
    counted, kept = {}, {}
    for split, dataset in encoded.items():
        counts = Counter(dataset["status"]) + Counter(prompt_cut=sum(dataset["prompt_cut"]))
        counted[split] = {reason: count for reason, count in counts.items() if reason != "ok"}
        kept[split] = (
            dataset.filter(lambda status: status not in DROPPED, input_columns="status")
            .remove_columns(["status", "prompt_cut"])
            .flatten_indices()
        )  # kept rows only (their digest: common.objectives.reference)
        if counted[split]:
            accelerator.print(
                f"{split} pairs: "
                + ", ".join(f"{count} {reason.replace('_', ' ')}" for reason, count in sorted(counted[split].items()))
                + f" (of {len(dataset)}; --block_size {block_size}, --max_prompt_length "
                f"{max_prompt_length}, --overlong {overlong})"
            )
        if len(kept[split]) == 0:
            raise UsageError(
                f"no {split} pair is left (dropped: {counted[split]}, --block_size {block_size}); raise "
                + ("--block_size or pass --overlong truncate" if overlong == "drop" else "--block_size")
            )
    return DatasetDict(kept), counted


def answer_end_ids(tokenizer, references: list[tuple]) -> list[int]:
    """The tokens that end the chosen answers of `references` (their last label: EOS, <|im_end|>, ...),
    from the answers as rendered whole, so that greedy answers stop where a right one does."""
    ends = set()
    for prompt, answer in references:
        completion = answer if isinstance(prompt, str) else [{"role": "assistant", "content": answer}]
        _, labels = encode_example({"prompt": prompt, "completion": completion}, tokenizer, "prompt_completion", None)
        learned = [label for label in labels if label != -100]
        ends.update(learned[-1:])
    return sorted(ends)


def chosen_references(raw_split, count: int) -> list[tuple]:
    """(prompt, chosen answer's text) of the first `count` pairs, for exact match of greedy answers
    (`common.training.evaluation.evaluate_generation`): where the chosen answer is the right one, the task metric."""
    references = []
    for row in range(min(count, len(raw_split))):
        prompt, chosen, _ = split_pair(raw_split[row], row)
        references.append((prompt, chosen if isinstance(chosen, str) else chosen[-1]["content"]))
    return references


class PairBatches:
    """Collate pairs into one padded batch: input_ids, attention_mask and labels of 2 x B rows
    (the B chosen, then the B rejected), and each pair's `index`."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict:
        sequences = [(row[f"{side}_input_ids"], row[f"{side}_labels"]) for side in SIDES for row in rows]
        width = max(len(ids) for ids, _ in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(sequences), width), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, (ids, row_labels) in enumerate(sequences):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(ids)] = torch.tensor(row_labels)
            attention_mask[i, : len(ids)] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "index": torch.tensor([row["index"] for row in rows]),
        }
