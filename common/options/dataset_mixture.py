"""--dataset_mixture's block (a recipe YAML's mapping, a file, or JSON) read and checked into a Mixture.

Every fault (an unknown key, a weight of 0, a missing file, two columns mapped to one name) is one line while the
options are parsed, before anything loads; common.data.mixture loads and mixes what it describes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import yaml

from common.launch.errors import UsageError


SOURCE_KEYS = ("id", "config", "split", "columns", "weight", "samples")
MIXTURE_KEYS = ("datasets", "seed", "test_split_size")
# the local files datasets reads, by extension, and the builder each is read with
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


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
