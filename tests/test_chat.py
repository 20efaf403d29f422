"""SFT labels under real chat templates (Llama 3, ChatML as in Qwen2.5, Mistral, Gemma),
none with {% generation %} markers: the label mask is exactly each assistant turn's
content and its end-of-turn token, checked token by token."""

import json
from pathlib import Path

import pytest
from conftest import OneProcess as CPU
from datasets import Dataset, DatasetDict

from common.data.chat import (
    GENERATION_MARKER,
    answer_token_counts,
    assistant_spans,
    end_of_turn_ids,
    generation_references,
    tokenize_sft,
)
from common.data.chat_template import read_chat_template
from common.launch.errors import UsageError


TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FAMILIES = ["llama3", "chatml_qwen2_5", "mistral", "gemma"]


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE (as Llama 3, Qwen2.5 and GPT-2 use) trained here on a small text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    text = [
        "The capital of France is Paris.",
        "What is the capital of France?",
        "You are a helpful assistant.",
        "Seven plus five is twelve, and the answer is twelve.",
        "Write a haiku about the sea.",
        "Waves fold into foam; the tide keeps its slow promise; salt on the cold stones.",
    ] * 20
    backend.train_from_iterator(
        text,
        trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    return backend


def family_tokenizer(byte_bpe, family):
    import copy

    from transformers import PreTrainedTokenizerFast

    spec = json.loads((TEMPLATES / f"{family}.json").read_text())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(byte_bpe),
        bos_token=spec["bos_token"],
        eos_token=spec["eos_token"],
        additional_special_tokens=spec["special"],
    )
    tokenizer.chat_template = read_chat_template(str(TEMPLATES / f"{family}.jinja"))
    return tokenizer, spec


def conversation(system: bool):
    turns = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "Write a haiku about the sea."},
        {
            "role": "assistant",
            "content": " Waves fold into foam;\nthe tide keeps its slow promise;\nsalt on the cold stones.\n",
        },
    ]
    return ([{"role": "system", "content": "You are a helpful assistant."}] if system else []) + turns


def labelled_runs(labels):
    runs, current = [], []
    for label in labels + [-100]:
        if label != -100:
            current.append(label)
        elif current:
            runs.append(current)
            current = []
    return runs


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_are_exactly_each_assistant_turn_and_its_end_of_turn_token(byte_bpe, family):
    tokenizer, spec = family_tokenizer(byte_bpe, family)
    assert not GENERATION_MARKER.search(tokenizer.chat_template)
    messages = conversation(system=spec["system"])
    raw = DatasetDict(
        train=Dataset.from_list([{"messages": messages}]), validation=Dataset.from_list([{"messages": messages}])
    )
    example = tokenize_sft(raw, tokenizer, "messages", 512, "drop", CPU())[0]["train"][0]
    ids, labels = example["input_ids"], example["labels"]
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]  # the template's own tokens
    assert all(label in (-100, token) for label, token in zip(labels, ids))
    runs = labelled_runs(labels)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(answers)  # one run per assistant turn: system and user turns are never labels
    for run, answer in zip(runs, answers):
        content = answer.strip() if spec["trims_content"] else answer
        assert tokenizer.decode(run) == content + spec["end_of_turn"]
        assert run[-1] == tokenizer.convert_tokens_to_ids(spec["end_of_turn"])
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)  # nothing lost or added


def test_span_labels_equal_the_marker_labels_on_a_marked_template(arithmetic_data):
    """The demo template marks answers with {% generation %}: without the markers, labels from
    rendering are the same tokens."""
    from transformers import AutoTokenizer

    marked = AutoTokenizer.from_pretrained(arithmetic_data / "tokenizer")
    unmarked = AutoTokenizer.from_pretrained(arithmetic_data / "tokenizer")
    unmarked.chat_template = marked.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    raw = DatasetDict(
        {
            split: Dataset.from_json(str(arithmetic_data / f"{split}.jsonl")).select(range(40))
            for split in ("train", "validation")
        }
    )
    by_markers = tokenize_sft(raw, marked, "messages", 64, "drop", CPU())[0]["train"]
    by_rendering = tokenize_sft(raw, unmarked, "messages", 64, "drop", CPU())[0]["train"]
    assert by_markers["labels"] == by_rendering["labels"] and by_markers["input_ids"] == by_rendering["input_ids"]
    assert sum(label != -100 for labels in by_rendering["labels"] for label in labels) > 40


def test_prompt_completion_learns_the_completion_only(byte_bpe):
    tokenizer, _ = family_tokenizer(byte_bpe, "chatml_qwen2_5")
    text_rows = [{"prompt": "What is the capital of France? ", "completion": "Paris."}] * 2
    raw = DatasetDict(train=Dataset.from_list(text_rows), validation=Dataset.from_list(text_rows))
    example = tokenize_sft(raw, tokenizer, "messages", 64, "drop", CPU())[0]["train"][0]
    learned = [label for label in example["labels"] if label != -100]
    assert learned == tokenizer("Paris.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert example["input_ids"][-len(learned) :] == learned

    # Conversational: an assistant turn inside the prompt is context, not a label.
    chat = conversation(system=True)
    rows = [{"prompt": chat[:-1], "completion": chat[-1:]}] * 2
    raw = DatasetDict(train=Dataset.from_list(rows), validation=Dataset.from_list(rows))
    datasets, _ = tokenize_sft(raw, tokenizer, "messages", 512, "drop", CPU())
    runs = labelled_runs(datasets["train"][0]["labels"])
    assert [tokenizer.decode(run) for run in runs] == [chat[-1]["content"] + "<|im_end|>"]
    assert end_of_turn_ids(datasets["validation"]) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    references = generation_references(raw["validation"], raw["train"].column_names, "messages", 1)
    assert references == [(chat[:-1], chat[-1]["content"])]


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_answers_are_measured_in_the_tokens_generation_takes(byte_bpe, family):
    """--max_new_tokens is sized from these counts: each reference answer's tokens as the model
    is taught to generate them after its prompt, end-of-turn token included (the last labelled
    run); a text completion's tokens and EOS."""
    tokenizer, spec = family_tokenizer(byte_bpe, family)
    messages = conversation(system=spec["system"])
    raw = DatasetDict(
        train=Dataset.from_list([{"messages": messages}]), validation=Dataset.from_list([{"messages": messages}])
    )
    references = generation_references(raw["validation"], raw["train"].column_names, "messages", None)
    labels = tokenize_sft(raw, tokenizer, "messages", 512, "drop", CPU())[0]["validation"][0]["labels"]
    answer = labelled_runs(labels)[-1]
    content = messages[-1]["content"].strip() if spec["trims_content"] else messages[-1]["content"]
    assert tokenizer.decode(answer) == content + spec["end_of_turn"]
    assert answer_token_counts(tokenizer, references) == [len(answer)]

    text = [("What is the capital of France? ", "Paris.")]
    assert answer_token_counts(tokenizer, text) == [
        len(tokenizer("Paris.", add_special_tokens=False)["input_ids"]) + 1
    ]


def test_reference_answers_are_measured_through_generation_markers(arithmetic_data):
    """The demo's template marks answers with {% generation %}: a number and <eos>, 2 tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(arithmetic_data / "tokenizer")
    assert GENERATION_MARKER.search(tokenizer.chat_template)
    raw = Dataset.from_json(str(arithmetic_data / "validation.jsonl"))
    assert set(answer_token_counts(tokenizer, generation_references(raw, raw.column_names, "messages", None))) == {2}


def test_overlong_examples_are_dropped_and_counted_or_truncated(byte_bpe):
    tokenizer, _ = family_tokenizer(byte_bpe, "llama3")
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Paris."}]
    long = [
        {"role": "user", "content": "Write a haiku about the sea. " * 8},
        {"role": "assistant", "content": "Waves."},
    ]
    no_answer = [{"role": "user", "content": "Hi"}]
    rows = [{"messages": m} for m in (short, long, no_answer, short)]
    raw = DatasetDict(train=Dataset.from_list(rows), validation=Dataset.from_list(rows[:1]))
    limit = len(tokenizer.apply_chat_template(short)["input_ids"]) + 2
    cpu = CPU()
    dropped_run, dropped = tokenize_sft(raw, tokenizer, "messages", limit, "drop", cpu)
    assert len(dropped_run["train"]) == 2 and dropped["train"] == {"too_long": 1, "no_label_tokens": 1}
    assert any("dropped 2 of 4 train examples" in line for line in cpu.printed)

    truncated_run, dropped = tokenize_sft(raw, tokenizer, "messages", limit, "truncate", CPU())
    # The long chat cut at `limit` keeps no answer token, so it is dropped as unlabelled, not trained on.
    assert dropped["train"] == {"no_label_tokens": 2} and len(truncated_run["train"]) == 2
    cut, _ = tokenize_sft(raw, tokenizer, "messages", limit - 3, "truncate", CPU())
    assert all(len(ids) <= limit - 3 for ids in cut["train"]["input_ids"]) and len(cut["train"]) == 2

    with pytest.raises(UsageError, match="no train example is left"):
        tokenize_sft(raw, tokenizer, "messages", 4, "drop", CPU())


def test_bad_chat_inputs_are_usage_errors(byte_bpe, tmp_path):
    tokenizer, _ = family_tokenizer(byte_bpe, "chatml_qwen2_5")

    def tokenize(rows, column="messages"):
        raw = DatasetDict(train=Dataset.from_list(rows), validation=Dataset.from_list(rows))
        return tokenize_sft(raw, tokenizer, column, 64, "drop", CPU())

    with pytest.raises(UsageError, match="needs a 'messages' column"):
        tokenize([{"text": "hello"}])
    with pytest.raises(UsageError, match="not a list of"):
        tokenize([{"messages": [{"role": "user", "content": 3}]}])
    with pytest.raises(UsageError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert read_chat_template(str(tmp_path / "tokenizer_config.json")) == "{{ messages }}"

    # A template that renders earlier turns differently once later ones exist (as reasoning templates do).
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(UsageError, match="generation"):
        assistant_spans(tokenizer, conversation(system=False))


@pytest.mark.parametrize("family", ["llama3", "chatml_qwen2_5"])
def test_sharegpt_turns_are_read_as_the_same_messages(byte_bpe, family):
    """ShareGPT's {"from": human/gpt/system, "value": ...} turns (a `conversations` column) give
    the tokens, labels and exact-match references of the same conversation as role/content."""
    tokenizer, spec = family_tokenizer(byte_bpe, family)
    messages = conversation(system=True)
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": speakers[m["role"]], "value": m["content"]} for m in messages]

    def tokenized(rows, column):
        raw = DatasetDict(train=Dataset.from_list(rows), validation=Dataset.from_list(rows))
        return tokenize_sft(raw, tokenizer, column, 512, "drop", CPU())[0]["train"][0], raw

    sharegpt, raw = tokenized([{"conversations": turns}], "conversations")
    reference, _ = tokenized([{"messages": messages}], "messages")
    assert sharegpt == reference and len(labelled_runs(sharegpt["labels"])) == 2
    assert generation_references(raw["validation"], raw["train"].column_names, "conversations", 1) == [
        (messages[:-1], messages[-1]["content"])
    ]

    with pytest.raises(UsageError, match=r"--messages_column conversations"):
        tokenized([{"conversations": turns}], "messages")
    with pytest.raises(UsageError, match=r"ShareGPT turns from \['bing'\] have no chat role"):
        tokenized([{"conversations": turns[:-1] + [{"from": "bing", "value": "Hi"}]}], "conversations")


def test_openai_style_text_parts_are_read_as_text(byte_bpe):
    """Content given as [{"type": "text", "text": ...}] parts (OpenAI's chat format) is the same
    conversation as content given as text; a part of another type is a one-line refusal."""
    tokenizer, _ = family_tokenizer(byte_bpe, "chatml_qwen2_5")
    messages = conversation(system=True)
    parts = [
        {
            "role": m["role"],
            "content": [{"type": "text", "text": m["content"][:9]}, {"type": "text", "text": m["content"][9:]}],
        }
        for m in messages
    ]

    def tokenized(rows):
        raw = DatasetDict(train=Dataset.from_list(rows), validation=Dataset.from_list(rows))
        return tokenize_sft(raw, tokenizer, "messages", 512, "drop", CPU())[0]["train"][0], raw

    from_parts, raw = tokenized([{"messages": parts}])
    assert from_parts == tokenized([{"messages": messages}])[0] and len(labelled_runs(from_parts["labels"])) == 2
    assert generation_references(raw["validation"], raw["train"].column_names, "messages", 1) == [
        (messages[:-1], messages[-1]["content"])
    ]
    with_image = [{**parts[0], "content": parts[0]["content"] + [{"type": "image_url", "text": None}]}] + parts[1:]
    with pytest.raises(UsageError, match=r"parts of type \['image_url'\]; SFT here trains on text"):
        tokenized([{"messages": with_image}])
