"""SFT examples: conversations or prompt-completion pairs, tokenized with labels on the answers only.

Conversations (`messages`) or prompt-completion pairs get labels on what the model should
learn to say and -100 elsewhere. A conversation is a list of {"role", "content"} messages
(content as text or as OpenAI-style text parts), or of ShareGPT's {"from", "value"} turns
(human/gpt/system), read as the same.

Labels come from the rendered text, so any chat template works, with or without
`{% generation %}` markers: for each assistant turn the template renders the
conversation up to that turn (with the generation prompt) and through it; the
characters between the two renderings are that turn's content and end-of-turn
token, and the tokens over those characters are its labels. A template that marks
assistant text with `{% generation %}` is read through its markers instead (but not for a
prompt-completion row: its prompt's own assistant turns are no labels). System and user turns are never labels.

Examples longer than `max_length` follow `overlong`: `drop` (counted) or `truncate`
(kept if a label token is left). Examples with no label tokens are dropped and counted.
"""

from __future__ import annotations

import re
from collections import Counter
from itertools import groupby
from typing import TYPE_CHECKING

from common.data.chat_template import check_jinja, template_errors
from common.launch.errors import UsageError
from common.launch.peers import main_process_alone


if TYPE_CHECKING:
    from datasets import DatasetDict


OVERLONG = ("drop", "truncate")
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# ShareGPT's speaker names ("from") -> chat-template roles
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def data_format(columns: list[str], messages_column: str) -> str:
    if messages_column in columns:
        return "messages"
    if {"prompt", "completion"} <= set(columns):
        return "prompt_completion"
    hint = " (ShareGPT data: --messages_column conversations)" if "conversations" in columns else ""
    raise UsageError(
        f'SFT data needs a {messages_column!r} column (conversations) or "prompt" and "completion" '
        f"columns; found {columns}. Set --messages_column{hint} or rename the columns"
    )


def _text_of(content):
    """A message's content as text: a string, or OpenAI-style parts ([{"type": "text", "text": ...}])
    joined; None for anything else."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    if not all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in content):
        kinds = sorted({str(part.get("type")) for part in content if isinstance(part, dict)} - {"text"})
        if kinds:
            raise UsageError(f"a message has parts of type {kinds}; SFT here trains on text: keep its text parts only")
        return None
    return "".join(part["text"] for part in content)


def as_messages(conversation) -> list[dict]:
    """A conversation as {"role", "content"} messages: as given (content as text, or OpenAI-style
    text parts, joined), or from ShareGPT's {"from", "value"} turns. Anything else is a UsageError
    that shows the conversation."""

    def all_text(keys):
        return isinstance(conversation, list) and all(
            isinstance(turn, dict) and all(isinstance(turn.get(key), str) for key in keys) for turn in conversation
        )

    if all_text(("role", "content")):
        return conversation
    if isinstance(conversation, list) and all(
        isinstance(turn, dict) and isinstance(turn.get("role"), str) for turn in conversation
    ):
        texts = [_text_of(turn.get("content")) for turn in conversation]
        if None not in texts:
            return [{"role": turn["role"], "content": text} for turn, text in zip(conversation, texts)]
    if all_text(("from", "value")):
        unknown = sorted({turn["from"] for turn in conversation} - set(SHAREGPT_ROLES))
        if unknown:
            raise UsageError(
                f"ShareGPT turns from {unknown} have no chat role; the speakers read are "
                f"{', '.join(SHAREGPT_ROLES)}: rename them in the data"
            )
        return [{"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]} for turn in conversation]
    raise UsageError(
        f'a conversation is not a list of {{"role": ..., "content": ...}} messages (or ShareGPT '
        f'{{"from": ..., "value": ...}} turns) with text content: {str(conversation)[:120]}'
    )


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    with template_errors(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], first_labelled_turn: int = 0) -> tuple[str, list[tuple]]:
    """The rendered conversation and the character span of each assistant turn from
    `first_labelled_turn` on: its content and end-of-turn token (trailing whitespace left out)."""
    text = _render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < first_labelled_turn:
            continue
        before = _render(tokenizer, messages[:index], add_generation_prompt=True) if index else ""
        through = _render(tokenizer, messages[: index + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise UsageError(
                "the chat template renders the start of a conversation differently from the whole "
                "conversation, so assistant turns cannot be located by rendering; wrap assistant "
                "content in {% generation %}...{% endgeneration %} in the template (--chat_template)"
            )
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def _encode_with_spans(tokenizer, messages, first_labelled_turn):
    text, spans = assistant_spans(tokenizer, messages, first_labelled_turn)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [
        token if any(start < end_ and end > start_ for start_, end_ in spans) else -100
        for token, (start, end) in zip(ids, encoded["offset_mapping"])
    ]
    return ids, labels


def _encode_with_markers(tokenizer, messages):
    with template_errors(messages):
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    ids = encoded["input_ids"]
    return ids, [token if mask else -100 for token, mask in zip(ids, encoded["assistant_masks"])]


def _encode_text(tokenizer, prompt: str, completion: str):
    prompt_ids = tokenizer(prompt)["input_ids"]  # with the tokenizer's BOS, if it adds one
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids


def encode_example(example: dict, tokenizer, fmt: str, messages_column: str):
    """input_ids and labels for one row of either format."""
    if fmt == "prompt_completion" and isinstance(example["prompt"], str):
        if not isinstance(example["completion"], str):
            raise UsageError(
                '"prompt" is text but "completion" is not; give both as text or both as lists of messages'
            )
        return _encode_text(tokenizer, example["prompt"], example["completion"])
    if fmt == "prompt_completion":
        prompt = as_messages(example["prompt"])
        messages, first = prompt + as_messages(example["completion"]), len(prompt)
    else:
        messages, first = as_messages(example[messages_column]), 0
    if GENERATION_MARKER.search(tokenizer.chat_template) and not first:  # a prompt's assistant turns are no labels:
        return _encode_with_markers(tokenizer, messages)  # those come from rendering (spans)
    return _encode_with_spans(tokenizer, messages, first)


def tokenize_sft(
    raw: DatasetDict,
    tokenizer,
    messages_column: str,
    max_length: int,
    overlong: str,
    accelerator,
    num_proc: int | None = None,
) -> tuple[DatasetDict, dict]:
    """Tokenize every split; returns the datasets and, per split, how many examples were
    dropped and why ({"train": {"too_long": 3}, ...})."""
    from datasets import DatasetDict

    if overlong not in OVERLONG:
        raise UsageError(f"--overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    fmt = data_format(raw["train"].column_names, messages_column)
    for split, dataset in raw.items():
        if data_format(dataset.column_names, messages_column) != fmt:
            raise UsageError(
                f"the {split} split's columns {dataset.column_names} are not in the train split's "
                "format; give both splits the same columns"
            )
    conversational = fmt == "messages" or not isinstance(raw["train"][0]["prompt"], str)
    if conversational and not tokenizer.chat_template:
        raise UsageError("the tokenizer has no chat_template; pass --chat_template (a template file or text)")
    if conversational:
        check_jinja(tokenizer.chat_template, "the chat template (--chat_template, or the tokenizer's)")
    if not tokenizer.is_fast:
        raise UsageError("SFT labels need a fast tokenizer (offsets); load one with tokenizers installed")

    def encode(example):
        ids, labels = encode_example(example, tokenizer, fmt, messages_column)
        status = "ok"
        if len(ids) > max_length:
            status = "too_long" if overlong == "drop" else "ok"
            ids, labels = ids[:max_length], labels[:max_length]
        if status == "ok" and all(label == -100 for label in labels):
            status = "no_label_tokens"
        return {"input_ids": ids, "labels": labels, "status": status}

    with accelerator.main_process_first(), main_process_alone(accelerator, "tokenizing"):
        encoded = raw.map(
            encode, num_proc=num_proc, remove_columns=raw["train"].column_names, desc="tokenizing SFT examples"
        )
    dropped, kept = {}, {}
    for split, dataset in encoded.items():
        counts = Counter(dataset["status"])
        dropped[split] = {reason: count for reason, count in counts.items() if reason != "ok"}
        kept[split] = dataset.filter(lambda status: status == "ok", input_columns="status").remove_columns("status")
        if dropped[split]:
            accelerator.print(
                f"dropped {sum(dropped[split].values())} of {len(dataset)} {split} examples: "
                + ", ".join(f"{count} {reason.replace('_', ' ')}" for reason, count in sorted(dropped[split].items()))
                + (
                    f" (longer than --block_size {max_length}; --overlong truncate keeps them cut)"
                    if "too_long" in dropped[split]
                    else ""
                )
            )
        if len(kept[split]) == 0:
            raise UsageError(
                f"no {split} example is left to train on (dropped: {dropped[split]}, max length "
                f"{max_length}); raise --block_size or pass --overlong truncate"
            )
    return DatasetDict(kept), dropped


def generation_references(raw_split, fmt_columns: list[str], messages_column: str, count: int | None) -> list:
    """(prompt, reference answer) pairs for exact-match evaluation: a conversation's last
    assistant turn, or a prompt-completion row's completion."""
    fmt = data_format(fmt_columns, messages_column)
    rows = raw_split.select(range(min(count, len(raw_split)))) if count is not None else raw_split
    pairs = []
    for row in rows:
        if fmt == "messages":
            messages = as_messages(row[messages_column])
            pairs.append((messages[:-1], messages[-1]["content"]))
        elif isinstance(row["completion"], str):
            pairs.append((row["prompt"], row["completion"]))
        else:
            pairs.append((as_messages(row["prompt"]), as_messages(row["completion"])[-1]["content"]))
    return pairs


def answer_token_counts(tokenizer, references: list) -> list[int]:
    """How many tokens each of `generation_references`' answers takes when generated after its
    prompt: the labels training gives it (content and end-of-turn token, as the template renders
    them; a text completion's tokens and EOS), so --max_new_tokens can be sized to fit them."""
    counts = []
    for prompt, answer in references:
        if isinstance(prompt, str):
            counts.append(len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1)  # + EOS
            continue
        messages = list(prompt) + [{"role": "assistant", "content": answer}]
        if GENERATION_MARKER.search(tokenizer.chat_template):
            _, labels = _encode_with_markers(tokenizer, messages)
        else:
            _, labels = _encode_with_spans(tokenizer, messages, len(prompt))
        runs = [len(list(run)) for learned, run in groupby(labels, key=lambda label: label != -100) if learned]
        counts.append(runs[-1] if runs else 0)  # the last run of labels: the answer's turn
    return counts


def end_of_turn_ids(dataset, sample: int = 64) -> list[int]:
    """The tokens that end an answer (each example's last label token: EOS, <|im_end|>,
    <|eot_id|>, ...), so that generation stops where training taught it to."""
    ids = set()
    for labels in dataset.select(range(min(sample, len(dataset))))["labels"]:
        learned = [token for token in labels if token != -100]
        if learned:
            ids.add(learned[-1])
    return sorted(ids)
