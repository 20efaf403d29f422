import json
import math
from collections import Counter

import numpy as np
import pytest
from accelerate import PartialState
from datasets import Dataset, DatasetDict

from common.data.loading import pack_sequences, tokenize_and_pack
from common.data.synthetic import MarkovSource, build_word_tokenizer
from common.launch.errors import UsageError


EOS = 2


@pytest.mark.parametrize("block_size", [1 + 1, 5, 16, 64])
def test_packing_tiles_the_stream_exactly(block_size):
    rng = np.random.default_rng(block_size)
    docs = [list(rng.integers(3, 100, size=rng.integers(1, 40))) for _ in range(57)]
    stream = [t for doc in docs for t in doc + [EOS]]
    packed = pack_sequences({"input_ids": docs}, block_size, EOS)
    blocks = packed["input_ids"]
    assert all(len(block) == block_size for block in blocks)
    flat = [t for block in blocks for t in block]
    assert flat == stream[: len(flat)]  # nothing lost, duplicated or reordered
    assert len(stream) - len(flat) < block_size  # only the last partial block is dropped
    assert packed["labels"] == blocks
    assert sum(1 for t in flat if t == EOS) == sum(1 for t in stream[: len(flat)] if t == EOS)


def test_tokenize_and_pack_on_a_dataset():
    source = MarkovSource.random(seed=1)
    tokenizer = build_word_tokenizer(source.words)
    docs = source.sample_documents(200, seed=5)
    raw = DatasetDict(train=Dataset.from_dict({"text": docs}), validation=Dataset.from_dict({"text": docs[:40]}))
    packed = tokenize_and_pack(raw, tokenizer, "text", 16, PartialState(cpu=True))
    flat = [t for block in packed["train"]["input_ids"] for t in block]
    expected = [
        t for d in docs for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ]
    assert flat == expected[: len(flat)] and len(expected) - len(flat) < 16
    assert tokenizer.unk_token_id not in flat
    with pytest.raises(UsageError, match="text_column"):
        tokenize_and_pack(raw, tokenizer, "body", 16, PartialState(cpu=True))


def test_entropy_formula_matches_an_empirical_estimate():
    """The closed-form entropy rate equals the plug-in estimate from a long sample."""
    source = MarkovSource.random(seed=0)
    index = {word: i for i, word in enumerate(source.words)}
    stream = [source.eos_state]
    for doc in source.sample_documents(20000, seed=11):
        stream += [index[w] for w in doc.split()] + [source.eos_state]
    pairs = Counter(zip(stream[:-1], stream[1:]))
    firsts = Counter(stream[:-1])
    total = len(stream) - 1
    empirical = -sum(c / total * math.log(c / firsts[a]) for (a, _), c in pairs.items())
    assert abs(empirical - source.entropy_rate()) < 0.02, (empirical, source.entropy_rate())
    assert 0.5 < source.entropy_rate() < math.log(len(source.words) + 1)


def test_too_few_rows_to_split_off_validation_is_one_line(tmp_path):
    from common.data.loading import load_raw_datasets
    from common.launch.errors import UsageError
    from common.options.arguments import DataArguments

    (tmp_path / "train.jsonl").write_text('{"text": "a b"}\n')
    with pytest.raises(UsageError, match="cannot split 1 training rows at --validation_split_percentage 5"):
        load_raw_datasets(DataArguments(train_file=str(tmp_path / "train.jsonl")), seed=0)


GOOD = '{"text": "a b c d e f g h"}\n' * 40


@pytest.mark.parametrize(
    "train, validation, expected",
    [
        ("", GOOD, r"train.jsonl: no data in the file; give a file with rows"),
        (GOOD + '{"text": null}\n', GOOD, r"column 'text' of the \w+ data holds None, not text"),
        (GOOD + '{"text": 3}\n', GOOD, r"column 'text' of the \w+ data holds 3, not text"),
        (
            GOOD,
            '{"body": "a b"}\n',
            r"do not have the same columns \(.*train.jsonl: \['text'\]; .*validation.jsonl: \['body'\]\)",
        ),
    ],
)
def test_bad_data_files_are_one_line(tmp_path, train, validation, expected):
    """What a recipe's start-up does with the files (a launched run of a bad file is in test_bad_input.py)."""
    from common.data.loading import check_text_column, load_raw_datasets
    from common.options.arguments import DataArguments

    (tmp_path / "train.jsonl").write_text(train)
    (tmp_path / "validation.jsonl").write_text(validation)
    with pytest.raises(UsageError, match=expected) as error:
        args = DataArguments(
            train_file=str(tmp_path / "train.jsonl"), validation_file=str(tmp_path / "validation.jsonl")
        )
        check_text_column(load_raw_datasets(args, seed=0), "text")
    assert "\n" not in str(error.value)


# --- issue 54, item 3: every column a recipe reads as text loads as the text written ------------------------------

WRITTEN = [  # answers that look like dates or numbers, and text a CSV reader takes for a missing value
    {"prompt": "When was it?", "chosen": "1971-05-08", "rejected": "4"},
    {"prompt": "NA", "chosen": "1999-12-31", "rejected": "007"},
    {"prompt": "None", "chosen": "2024-02-29 10:30:00", "rejected": "1e5"},
    {"prompt": "null", "chosen": "2001-01-01T00:00:00", "rejected": ""},
]


def write_written(path, layout: str) -> list[dict]:
    """WRITTEN as text pairs (jsonl or csv), or as TRL's conversational pairs (jsonl): the rows as written."""
    import csv

    rows = WRITTEN * 5
    if layout == "chat":
        rows = [
            {
                "prompt": [{"role": "user", "content": row["prompt"]}],
                "chosen": [{"role": "assistant", "content": row["chosen"]}],
                "rejected": [{"role": "assistant", "content": row["rejected"] or "no"}],
            }
            for row in rows
        ]
    if path.suffix == ".csv":
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


@pytest.mark.parametrize(
    "fmt, layout, mode",
    [
        ("jsonl", "text", "files"),
        ("csv", "text", "files"),
        ("jsonl", "chat", "files"),
        ("jsonl", "text", "streaming"),
        ("csv", "text", "streaming"),
        ("jsonl", "chat", "mixture"),
        ("csv", "text", "mixture"),
        ("jsonl", "text", "streamed mixture"),
    ],
)
def test_text_that_looks_like_dates_or_numbers_loads_as_written(tmp_path, fmt, layout, mode):
    """pyarrow's JSON reader took answers such as "1971-05-08" for timestamps, and pandas' CSV reader "4" and
    "007" for numbers and "NA" or "None" for a missing value: each column a recipe reads as text comes as the
    text the user wrote, read from files, streamed, and in a mixture (whose `columns` rename them)."""
    from common.data.loading import load_raw_datasets
    from common.options.arguments import DataArguments

    path = tmp_path / f"pairs.{fmt}"
    rows = write_written(path, layout)
    if mode in ("files", "streaming"):
        args = DataArguments(train_file=str(path), validation_file=str(path), streaming=mode == "streaming")
        expected = rows
    else:
        source, other = tmp_path / f"source.{fmt}", tmp_path / "other.jsonl"
        write_written(source, layout)
        other.write_text("".join(json.dumps(row) + "\n" for row in rows[:4]))  # its answers all dates too
        columns = {}
        if fmt == "csv":  # the source's own name for the prompt column, which `columns` maps to the recipe's
            source.write_text(source.read_text().replace("prompt,", "question,", 1))
            columns = {"columns": {"question": "prompt", "chosen": "chosen", "rejected": "rejected"}}
        block = {"datasets": [{"id": str(source), **columns}, {"id": str(other)}], "seed": 0}
        args = DataArguments(dataset_mixture=json.dumps(block), validation_file=str(path), streaming="stream" in mode)
        expected = rows + rows[:4]
    raw = load_raw_datasets(args, seed=0)
    key = lambda row: json.dumps(row, sort_keys=True, default=repr)  # noqa: E731
    loaded = sorted(map(key, raw["train"]))
    if "stream" in mode:  # a streamed mixture ends with its first source to run out
        assert loaded and set(loaded) <= set(map(key, expected))
    else:
        assert loaded == sorted(map(key, expected))
    assert sorted(map(key, raw["validation"])) == sorted(map(key, rows))


def test_chats_whose_answers_are_dates_train_on_the_text_written(real_model, tmp_path):
    """SFT's prompt-completion chats whose answers are all dates: read as timestamps, they were refused ("a
    conversation is not a list of ... messages ... with text content: [{'role': 'assistant', 'content':
    datetime.datetime(1971, 5, 8, 0, 0)}]"); the labels are now the answers as written."""
    from conftest import OneProcess
    from transformers import AutoTokenizer

    from common.data.chat import tokenize_sft
    from common.data.loading import load_raw_datasets
    from common.options.arguments import DataArguments

    rows = [
        {
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "completion": [{"role": "assistant", "content": date}],
        }
        for row, date in zip(WRITTEN * 5, [row["chosen"] for row in WRITTEN] * 5)
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    raw = load_raw_datasets(DataArguments(train_file=str(path), validation_file=str(path)), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    datasets, dropped = tokenize_sft(raw, tokenizer, "messages", 256, "drop", OneProcess())
    learned = [tokenizer.decode([t for t in row["labels"] if t != -100]) for row in datasets["train"]]
    assert learned == [row["completion"][0]["content"] + "<|im_end|>" for row in rows] and dropped["train"] == {}


# --- issue 54, item 8: a label set a classifier cannot learn from is bad input -------------------------------------


@pytest.mark.parametrize(
    "train_labels, validation_labels, expected",
    [
        (["pos"] * 8, ["pos"] * 4, r"the train data has one class \(label 'pos'\) in column 'label': a classifier "),
        ([1] * 8, [1, 1], r"the train data has one class \(label '1'\)"),
        (["pos", "neg"] * 4, ["pos", None], r"row 1 of the validation data has no label \(None in column 'label'\)"),
        ([1.0, 0.0, float("nan"), 0.0], [1.0], r"row 2 of the train data has no label \(nan in column"),
        (["pos", "neg"] * 4, ["pos", "meh"], r"validation labels \['meh'\] never occur in train"),
    ],
    ids=["one class", "one class as numbers", "null label", "NaN label", "a class only in validation"],
)
def test_a_label_set_a_classifier_cannot_learn_from_is_one_line(minilm, train_labels, validation_labels, expected):
    """One class in the training data trained without a word and reported perfect accuracy; a row with no
    label (null, or NaN: a CSV's empty cell) was a class of its own, "None" or "nan"."""
    from conftest import OneProcess
    from transformers import AutoTokenizer

    from common.data.loading import tokenize_for_classification

    def split(labels):
        return Dataset.from_dict({"text": [f"row {i}" for i in range(len(labels))], "label": labels})

    raw = DatasetDict(train=split(train_labels), validation=split(validation_labels))
    with pytest.raises(UsageError, match=expected) as refused:
        tokenize_for_classification(raw, AutoTokenizer.from_pretrained(minilm), "text", "label", 16, OneProcess())
    assert "\n" not in str(refused.value)


def test_csv_splits_whose_columns_differ_in_kind_are_one_line(tmp_path):
    """Labels as numbers in one CSV file and as words in the other: the same column names, so the line that said
    the files "do not have the same columns" named two identical lists; it now names the kinds."""
    from common.data.loading import load_raw_datasets
    from common.options.arguments import DataArguments

    (tmp_path / "train.csv").write_text("label,text\n1,a\n2,b\n")
    (tmp_path / "validation.csv").write_text("label,text\nx,a\ny,b\n")
    args = DataArguments(train_file=str(tmp_path / "train.csv"), validation_file=str(tmp_path / "validation.csv"))
    with pytest.raises(
        UsageError, match=r"the data files' columns differ in kind \(.*train.csv: \{'label': Value\('int64'\)"
    ):
        load_raw_datasets(args, seed=0)
