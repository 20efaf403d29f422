"""Data sources: local files read as written.

Local files (`load_local`): every column a recipe reads as text comes as the text written. The
readers guess types where a file has none: pyarrow's JSON reader takes a column whose values all look
like dates ("1971-05-08") for timestamps, and pandas' CSV reader takes "4" or "007" for numbers and
"NA", "None" or an empty cell for a missing value. A JSON file whose inferred types hold a date or
time is read again with those as text; a CSV file's text columns are read as they are written. A
Hub dataset (or a folder) whose text columns were read as dates is refused in one line
(`refuse_dates_in_text`).
"""

from __future__ import annotations

import json
import os

from common.launch.errors import UsageError


# The columns the recipes read as text (besides --text_column): causal_lm's and the classifier's text, SFT's
# prompt-completion pairs, DPO's pairs.
TEXT_COLUMNS = ("text", "prompt", "completion", "chosen", "rejected")
# What pandas reads as a missing value by default (pandas.read_csv's na_values): kept for the columns not read as text
CSV_MISSING = (
    "", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A", "NA",
    "NULL", "NaN", "None", "n/a", "nan", "null",
)  # fmt: skip
TEMPORAL = ("timestamp", "date", "time", "duration")  # Arrow types no JSON value has: a reader's guess from text


def load_local(builder: str, data_files: dict, text_columns, split: str | None = None, streaming: bool = False):
    """load_dataset(builder, data_files=..., split=..., streaming=...) of local files, with each column in
    `text_columns` (and, in JSON, every value) as the text written. A DatasetDict where `split` is None."""
    from datasets import DatasetDict, load_dataset

    if builder == "json" and split is None:  # each file alone: its types guessed from its own rows
        return DatasetDict(
            {
                name: load_local(builder, {"train": path}, text_columns, "train", streaming)
                for name, path in data_files.items()
            }
        )
    kwargs = _csv_as_written(data_files.values(), text_columns) if builder == "csv" else {}
    dataset = load_dataset(builder, data_files=data_files, split=split, streaming=streaming, **kwargs)
    if builder == "json":  # one file, as its `train` split (or a slice of it)
        return _json_as_written(dataset, data_files["train"], split, streaming)
    return dataset


def _csv_as_written(paths, text_columns) -> dict:
    """pandas' read_csv options that keep the text columns as written: no number read in them, no missing
    value (an empty cell is empty text), the other columns as pandas reads them."""
    import pandas as pd

    header = []
    for path in paths:
        try:
            header += [name for name in pd.read_csv(path, nrows=0).columns if name not in header]
        except ValueError:  # an empty or unreadable file: load_dataset says so
            pass
    text = [name for name in header if name in text_columns]
    if not text:
        return {}
    return {
        "converters": dict.fromkeys(text, str),
        "keep_default_na": False,
        "na_values": {name: list(CSV_MISSING) for name in header if name not in text},
    }


def _json_as_written(dataset, path: str, split: str, streaming: bool):
    """`dataset` as loaded from `path`, or, where pyarrow read dates or times out of its text, the file read
    again (row by row, by Python's json) into the same types with those as text; `split` of it ("train", or
    a slice of it)."""
    from datasets import Dataset, Features, IterableDataset, ReadInstruction

    features = dataset.features
    if features is None or not any(_has_temporal(feature) for feature in features.values()):
        return dataset
    stamp = os.stat(path)  # a file changed in place is read again, not taken from the cache
    kwargs = {
        "generator": json_rows,
        "gen_kwargs": {"files": [(path, stamp.st_size, stamp.st_mtime_ns)]},
        "features": Features({column: _as_text(feature) for column, feature in features.items()}),
    }
    if streaming:
        return IterableDataset.from_generator(**kwargs)
    rows = Dataset.from_generator(**kwargs)
    if split == "train":
        return rows
    spans = ReadInstruction.from_spec(split).to_absolute({"train": len(rows)})  # a slice: train[:10%]
    return rows.select([index for span in spans for index in range(span.from_, span.to)])


def json_rows(files: list):
    """The rows of JSON Lines files, or of JSON files holding a list (of rows, or of texts: {"text": ...})."""
    for path, _, _ in files:
        with open(path, encoding="utf-8-sig") as handle:
            start = handle.read(4096).lstrip()[:1]
            handle.seek(0)
            if start == "[":
                for row in json.load(handle):
                    yield row if isinstance(row, dict) else {"text": row}
                continue
            for line in handle:
                if line.strip():
                    yield json.loads(line)


def _has_temporal(feature) -> bool:
    return _as_text(feature) != feature


def _as_text(feature):
    """`feature` with every date, time or timestamp in it (nested in lists and records too) as text."""
    import copy

    from datasets import Value

    if isinstance(feature, Value):
        return Value("string") if str(feature.dtype).startswith(TEMPORAL) else feature
    if isinstance(feature, dict):
        return type(feature)({key: _as_text(value) for key, value in feature.items()})
    if isinstance(feature, list):
        return [_as_text(value) for value in feature]
    if hasattr(feature, "feature"):  # List, LargeList, Sequence
        inner = copy.copy(feature)
        inner.feature = _as_text(feature.feature)
        return inner
    return feature


def refuse_dates_in_text(dataset, text_columns, what: str) -> None:
    """A dataset not read here from local files (the Hub's, a folder's) whose text columns or conversations
    hold dates: its reader took text for dates, which cannot be turned back into the text written."""
    features = getattr(dataset, "features", None) or {}
    for column, feature in features.items():
        chat = isinstance(feature, list) or isinstance(getattr(feature, "feature", None), dict)
        if (column in text_columns or chat) and _has_temporal(feature):
            raise UsageError(
                f"{what}: column {column!r} was read as dates ({feature}), not as the text written; its reader "
                "(pyarrow's JSON) guesses types: save the data as a local .jsonl file and pass that (local files "
                "are read as written)"
            )
