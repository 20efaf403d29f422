"""Data sources: local files read as written, and a --dataset_mixture's block read and checked.

A mixture's block is a recipe YAML's mapping, a file, or JSON.

Local files (`load_local`): every column a recipe reads as text comes as the text written. The
readers guess types where a file has none: pyarrow's JSON reader takes a column whose values all look
like dates ("1971-05-08") for timestamps, and pandas' CSV reader takes "4" or "007" for numbers and
"NA", "None" or an empty cell for a missing value. A JSON file whose inferred types hold a date or
time is read again with those as text; a CSV file's text columns are read as they are written. A
Hub dataset (or a folder) whose text columns were read as dates is refused in one line
(`refuse_dates_in_text`).

A mixture's every fault (an unknown key, a weight of 0, a missing file, two columns mapped to one
name) is one line before anything loads; common.mixture loads and mixes what it describes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import yaml

from common.errors import UsageError


SOURCE_KEYS = ("id", "config", "split", "columns", "weight", "samples")
MIXTURE_KEYS = ("datasets", "seed", "test_split_size")
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
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


@dataclass
class Source:
    id: str
    config: str | None = None
    split: str = "train"
    columns: dict | None = None  # their name -> the recipe's name; None: every column as it is
    weight: float | None = None
    samples: int | None = None

    @property
    def on_hub(self) -> bool:  # not a local file or folder
        return not os.path.exists(self.id)

    def rows_from(self, available: int) -> int:  # the rows it gives the mixture out of those it has
        return (
            self.samples
            if self.samples is not None
            else int(available * (1.0 if self.weight is None else self.weight))
        )


@dataclass
class Mixture:
    sources: list[Source]
    seed: int | None = None
    test_split_size: float | None = None
    counts: list[dict] = field(default_factory=list)  # filled as it loads: each source's rows, for run.json

    def seed_or(self, seed: int) -> int:  # its own seed, else the run's
        return self.seed if self.seed is not None else seed


def parse_mixture(value: str) -> Mixture:
    """--dataset_mixture's value (a YAML/JSON file, or JSON) as a checked Mixture: every fault in one line."""
    where = "--dataset_mixture"
    if os.path.isfile(value):
        where = value
        with open(value) as handle:
            try:
                block = yaml.safe_load(handle)
            except yaml.YAMLError as error:
                raise UsageError(f"{value}: not valid YAML ({str(error).splitlines()[0]})") from None
        if isinstance(block, dict) and "dataset_mixture" in block:  # a recipe YAML's block, or the block alone
            block = block["dataset_mixture"]
    else:
        try:
            block = json.loads(value)
        except json.JSONDecodeError:
            raise UsageError(
                f"--dataset_mixture {value[:80]!r} is neither a file nor JSON; pass a YAML file holding "
                "the mixture (datasets: [{id: ..., weight: ...}, ...]) or the same as JSON"
            ) from None
    if isinstance(block, list):  # the list of sources alone
        block = {"datasets": block}
    if not isinstance(block, dict) or not block.get("datasets"):
        raise UsageError(
            f"{where}: a dataset mixture is a mapping with `datasets:`, a list of sources "
            "({id: NAME_OR_FILE, weight: 0.5}, ...)"
        )
    _no_unknown(block, MIXTURE_KEYS, where, "the mixture")
    if not isinstance(block["datasets"], list):
        raise UsageError(f"{where}: `datasets` must be a list of sources, got {block['datasets']!r}")
    sources = [_source(entry, index, where) for index, entry in enumerate(block["datasets"])]
    seed = block.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32):
        raise UsageError(f"{where}: seed must be a whole number from 0 to 2**32 - 1, got {seed!r}")
    test_split = block.get("test_split_size")
    if test_split is not None and (
        isinstance(test_split, bool)
        or not isinstance(test_split, (int, float))
        or not 0 < test_split < 1
        and not (test_split >= 1 and test_split == int(test_split))
    ):
        raise UsageError(
            f"{where}: test_split_size must be a number of rows (>= 1) or a fraction in (0, 1), got {test_split!r}"
        )
    return Mixture(sources, seed, test_split if test_split is None or test_split < 1 else int(test_split))


def _no_unknown(block: dict, known: tuple, where: str, what: str) -> None:
    unknown = [key for key in block if key not in known]
    if unknown:
        raise UsageError(
            f"{where}: {what} has unknown key(s) {', '.join(map(repr, unknown))}; the keys are {', '.join(known)}"
        )


def _source(entry, index: int, where: str) -> Source:
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
        raise UsageError(
            f"{where}: source {index} must be a mapping with an `id` (a Hub name or a local file), got {entry!r}"
        )
    name = f"{where}: source {index} ({entry['id']})"
    _no_unknown(entry, SOURCE_KEYS, name, "it")
    path = os.path.expanduser(entry["id"])
    if os.path.isfile(path) and os.path.splitext(path)[1].lower() not in FILE_BUILDERS:
        raise UsageError(f"{name}: a local file must be one of {', '.join(sorted(FILE_BUILDERS))}")
    if not os.path.exists(path) and (
        path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.splitext(path)[1].lower() in FILE_BUILDERS
    ):
        raise UsageError(
            f"{name}: no such file or folder; check the path (relative paths start at {os.getcwd()}) "
            "or give a Hub name (org/name)"
        )
    weight, samples = entry.get("weight"), entry.get("samples")
    if weight is not None and samples is not None:
        raise UsageError(f"{name}: give weight (a share of its rows) or samples (a number of rows), not both")
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < 1e9
    ):
        raise UsageError(
            f"{name}: weight must be a number above 0 (the share of its rows taken: 0.5 takes half, "
            f"2 every row twice), got {weight!r}; leave the source out to use none of it"
        )
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
        raise UsageError(f"{name}: samples must be a whole number of rows >= 1, got {samples!r}")
    columns = entry.get("columns")
    if isinstance(columns, list) and all(isinstance(column, str) for column in columns) and columns:
        columns = {column: column for column in columns}
    elif columns is not None and not (
        isinstance(columns, dict)
        and columns
        and all(isinstance(key, str) and isinstance(value, str) for key, value in columns.items())
    ):
        raise UsageError(
            f"{name}: columns must be a list of column names or a mapping {{their_name: recipe_name}}, got {columns!r}"
        )
    if columns and len(set(columns.values())) < len(columns):
        raise UsageError(f"{name}: columns maps two columns to one name ({columns}); give each its own")
    for key in [key for key in ("config", "split") if entry.get(key) is not None and not isinstance(entry[key], str)]:
        raise UsageError(f"{name}: {key} must be text, got {entry[key]!r}")
    return Source(
        path,
        entry.get("config"),
        entry.get("split") or "train",
        columns,
        None if weight is None else float(weight),
        samples,
    )
