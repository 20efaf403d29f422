import math
from collections import Counter

import numpy as np
import pytest
from accelerate import PartialState
from datasets import Dataset, DatasetDict

from common.data import pack_sequences, tokenize_and_pack
from common.errors import UsageError
from common.synthetic import MarkovSource, build_word_tokenizer


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
    from common.arguments import DataArguments
    from common.data import load_raw_datasets
    from common.errors import UsageError

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
    from common.arguments import DataArguments
    from common.data import check_text_column, load_raw_datasets

    (tmp_path / "train.jsonl").write_text(train)
    (tmp_path / "validation.jsonl").write_text(validation)
    with pytest.raises(UsageError, match=expected) as error:
        args = DataArguments(
            train_file=str(tmp_path / "train.jsonl"), validation_file=str(tmp_path / "validation.jsonl")
        )
        check_text_column(load_raw_datasets(args, seed=0), "text")
    assert "\n" not in str(error.value)
