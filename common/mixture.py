"""--dataset_mixture: several data sources mixed into one training set, seeded and exact.

As the alignment-handbook's `dataset_mixture` (its recipe YAMLs run as they are), in a recipe YAML
or on the command line (a YAML or JSON file, or the JSON itself):

    dataset_mixture:
      datasets:
        - id: HuggingFaceH4/ultrachat_200k   # a Hub name, or a local file (.jsonl, .json, .csv, .parquet, .txt) or folder
          config: default                    # the Hub dataset's config, where it has several
          split: train_sft                   # a split or a split expression (train[:10%]); default train
          columns: [messages]                # the columns used; {their_name: recipe_name} renames them
          weight: 0.5                        # the share of this source's rows taken (the handbook's meaning; 2 takes
        - id: data/sharegpt.jsonl            # every row twice) ...
          columns: {conversations: messages}
          samples: 3000                      # ... or a number of rows
      seed: 0                                # default: --seed
      test_split_size: 2000                  # held-out rows (or a fraction); or give --validation_file;
                                             # neither: --validation_split_percentage of the mixed rows

Each source's rows are taken by a seeded shuffle, so the mixed set is the same on every rank and
every resume; the rows each source gave to train and validation are logged and written to run.json
(`data_sources`). Conversations in other shapes (ShareGPT turns, OpenAI text parts) are read as
role/content messages where the sources differ, so they mix. With --streaming the sources are
interleaved, each document drawn from a source with the probability of its weight (or count) over
their sum, until one source ends the epoch (so no document repeats within one).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import yaml

from common.errors import UsageError

SOURCE_KEYS = ("id", "config", "split", "columns", "weight", "samples")
MIXTURE_KEYS = ("datasets", "seed", "test_split_size")
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass
class Source:
    id: str
    config: str | None = None
    split: str = "train"
    columns: dict | None = None  # their name -> the recipe's name; None: every column as it is
    weight: float | None = None
    samples: int | None = None

    def rows_from(self, available: int) -> int:  # the rows it gives the mixture out of those it has
        return self.samples if self.samples is not None else int(available * (1.0 if self.weight is None else self.weight))


@dataclass
class Mixture:
    sources: list[Source]
    seed: int | None = None
    test_split_size: float | None = None
    counts: list[dict] = field(default_factory=list)  # filled as it loads: each source's rows, for run.json


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
            raise UsageError(f"--dataset_mixture {value[:80]!r} is neither a file nor JSON; pass a YAML file holding "
                             "the mixture (datasets: [{id: ..., weight: ...}, ...]) or the same as JSON") from None
    if isinstance(block, list):  # the list of sources alone
        block = {"datasets": block}
    if not isinstance(block, dict) or not block.get("datasets"):
        raise UsageError(f"{where}: a dataset mixture is a mapping with `datasets:`, a list of sources "
                         "({id: NAME_OR_FILE, weight: 0.5}, ...)")
    _no_unknown(block, MIXTURE_KEYS, where, "the mixture")
    if not isinstance(block["datasets"], list):
        raise UsageError(f"{where}: `datasets` must be a list of sources, got {block['datasets']!r}")
    sources = [_source(entry, index, where) for index, entry in enumerate(block["datasets"])]
    seed = block.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32):
        raise UsageError(f"{where}: seed must be a whole number from 0 to 2**32 - 1, got {seed!r}")
    test_split = block.get("test_split_size")
    if test_split is not None and (isinstance(test_split, bool) or not isinstance(test_split, (int, float))
                                   or test_split <= 0 or (isinstance(test_split, float) and test_split >= 1)):
        raise UsageError(f"{where}: test_split_size must be a number of rows (>= 1) or a fraction in (0, 1), "
                         f"got {test_split!r}")
    return Mixture(sources, seed, test_split)


def _no_unknown(block: dict, known: tuple, where: str, what: str) -> None:
    unknown = [key for key in block if key not in known]
    if unknown:
        raise UsageError(f"{where}: {what} has unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                         f"{', '.join(known)}")


def _source(entry, index: int, where: str) -> Source:
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
        raise UsageError(f"{where}: source {index} must be a mapping with an `id` (a Hub name or a local file), "
                         f"got {entry!r}")
    name = f"{where}: source {index} ({entry['id']})"
    _no_unknown(entry, SOURCE_KEYS, name, "it")
    path = entry["id"]
    if os.path.isfile(path) and os.path.splitext(path)[1].lower() not in FILE_BUILDERS:
        raise UsageError(f"{name}: a local file must be one of {', '.join(sorted(FILE_BUILDERS))}")
    if not os.path.exists(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1
                                     or os.path.splitext(path)[1].lower() in FILE_BUILDERS):
        raise UsageError(f"{name}: no such file or folder; check the path (relative paths start at {os.getcwd()}) "
                         "or give a Hub name (org/name)")
    weight, samples = entry.get("weight"), entry.get("samples")
    if weight is not None and samples is not None:
        raise UsageError(f"{name}: give weight (a share of its rows) or samples (a number of rows), not both")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0):
        raise UsageError(f"{name}: weight must be a number above 0 (the share of its rows taken: 0.5 takes half, "
                         f"2 every row twice), got {weight!r}; leave the source out to use none of it")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
        raise UsageError(f"{name}: samples must be a whole number of rows >= 1, got {samples!r}")
    columns = entry.get("columns")
    if isinstance(columns, list) and all(isinstance(column, str) for column in columns) and columns:
        columns = {column: column for column in columns}
    elif columns is not None and not (isinstance(columns, dict) and columns and all(
            isinstance(key, str) and isinstance(value, str) for key, value in columns.items())):
        raise UsageError(f"{name}: columns must be a list of column names or a mapping {{their_name: "
                         f"recipe_name}}, got {columns!r}")
    for key in [key for key in ("config", "split") if entry.get(key) is not None and not isinstance(entry[key], str)]:
        raise UsageError(f"{name}: {key} must be text, got {entry[key]!r}")
    return Source(path, entry.get("config"), entry.get("split") or "train", columns,
                  None if weight is None else float(weight), samples)


def _load_source(source: Source, streaming: bool, load_hub):
    from datasets import load_dataset

    if os.path.isfile(source.id):
        builder = FILE_BUILDERS[os.path.splitext(source.id)[1].lower()]
        dataset = load_dataset(builder, data_files={"train": source.id}, split=source.split, streaming=streaming)
    elif os.path.isdir(source.id):
        dataset = load_dataset(source.id, source.config, split=source.split, streaming=streaming)
    else:
        dataset = load_hub(source, streaming)
    columns = dataset.column_names or list(next(iter(dataset.take(1)), {}).keys())
    if source.columns:
        missing = [column for column in source.columns if column not in columns]
        if missing:
            raise UsageError(f"--dataset_mixture: source {source.id} has no column(s) {', '.join(map(repr, missing))} "
                             f"(its columns: {columns}); fix its `columns`")
        dataset = dataset.select_columns(list(source.columns))
        renames = {old: new for old, new in source.columns.items() if old != new}
        if renames:
            dataset = dataset.rename_columns(renames)
    return dataset


def load_mixture(mixture: Mixture, seed: int, load_hub):
    """The mixed training rows (a Dataset). `load_hub(source, streaming)` loads a Hub source."""
    from datasets import concatenate_datasets

    seed = mixture.seed if mixture.seed is not None else seed
    parts = []
    for index, source in enumerate(mixture.sources):
        dataset = _load_source(source, False, load_hub)
        if len(dataset) == 0:
            raise UsageError(f"--dataset_mixture: source {source.id} (split {source.split}) has no rows; give it data "
                             "or leave it out")
        wanted = source.rows_from(len(dataset))
        if wanted < 1:
            raise UsageError(f"--dataset_mixture: source {source.id} gives no rows at weight {source.weight} of its "
                             f"{len(dataset)}; raise its weight")
        order = dataset.shuffle(seed=seed + index)
        whole, rest = divmod(wanted, len(dataset))  # beyond its size: every row again, then a seeded share
        parts.append(concatenate_datasets([order] * whole + [order.select(range(rest))]) if whole else
                     order.select(range(rest)))
        mixture.counts.append({"source": source.id, "split": source.split, "available": len(dataset), "rows": wanted})
    return concatenate_datasets(_alike(parts, mixture))


def _alike(parts: list, mixture: Mixture) -> list:
    """Sources whose columns differ in type made alike: conversations read as role/content messages
    (common.chat.as_messages), then each cast to the first's types; what cannot be is one line."""
    from common.chat import as_messages

    first = parts[0]
    names = set(first.column_names)
    for part, source in zip(parts[1:], mixture.sources[1:]):
        if set(part.column_names) != names:
            raise UsageError(f"--dataset_mixture: source {source.id} has columns {sorted(part.column_names)} and "
                             f"{mixture.sources[0].id} {sorted(names)}; map them to the same names with `columns`")
    if all(part.features == first.features for part in parts):
        return parts
    differing = [name for name in first.column_names if any(part.features[name] != first.features[name] for part in parts)]
    chats = [name for name in differing  # lists (of turns) in every source
             if all(type(part.features[name]).__name__ in ("list", "List", "LargeList") for part in parts)]
    if chats:
        def read(batch):
            return {name: [as_messages(conversation) for conversation in batch[name]] for name in chats}
        parts = [part.map(read, batched=True, desc="reading conversations as messages") for part in parts]
    alike = [parts[0]]
    for part, source in zip(parts[1:], mixture.sources[1:]):
        try:
            alike.append(part.cast(parts[0].features))
        except (ValueError, TypeError) as error:
            name = next((n for n in part.column_names if part.features[n] != parts[0].features[n]), "?")
            raise UsageError(f"--dataset_mixture: column {name!r} of {source.id} ({part.features[name]}) is not "
                             f"of the type of {mixture.sources[0].id}'s ({parts[0].features[name]}) and cannot be "
                             f"cast ({str(error).splitlines()[0][:120]}); make them the same") from None
    return alike


def held_out_split(mixed, mixture: Mixture, size: float, seed: int):
    """(train, validation): `size` rows (or that fraction) of the mixed rows held out by a seeded
    permutation; each source's share of both is added to mixture.counts."""
    import numpy as np

    total = len(mixed)
    held = int(round(size * total)) if size < 1 else int(size)
    if not 1 <= held < total:
        raise UsageError(f"cannot hold out {size} of the {total} mixed rows for validation; give test_split_size "
                         "(or --validation_split_percentage) between 1 row and all of them, or --validation_file")
    order = np.random.default_rng(mixture.seed if mixture.seed is not None else seed).permutation(total)
    ends = np.cumsum([count["rows"] for count in mixture.counts])
    held_by_source = np.bincount(np.searchsorted(ends, order[:held], side="right"), minlength=len(ends))
    for count, held_rows in zip(mixture.counts, held_by_source.tolist()):
        count.update(train=count["rows"] - held_rows, validation=held_rows)
    return mixed.select(order[held:]), mixed.select(order[:held])


def stream_mixture(mixture: Mixture, seed: int, load_hub):
    """--streaming: the sources interleaved, drawn with their weights (or counts) as probabilities."""
    from datasets import interleave_datasets

    streams = [_load_source(source, True, load_hub) for source in mixture.sources]
    shares = [source.samples if source.samples is not None else (source.weight or 1.0) for source in mixture.sources]
    probabilities = [share / sum(shares) for share in shares]
    for source, probability in zip(mixture.sources, probabilities):
        mixture.counts.append({"source": source.id, "split": source.split, "probability": round(probability, 6)})
    return interleave_datasets(streams, probabilities=probabilities,
                               seed=mixture.seed if mixture.seed is not None else seed,
                               stopping_strategy="first_exhausted")


def announce(mixture: Mixture) -> None:
    """One line in the main process's log: each source and what it gave."""
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(describe_counts(mixture), file=sys.stderr)


def describe_counts(mixture: Mixture) -> str:
    said = []
    for count in mixture.counts:
        if "probability" in count:
            said.append(f"{count['source']} p={count['probability']:.3g}")
        else:
            split = f" (train {count['train']}, validation {count['validation']})" if "train" in count else ""
            said.append(f"{count['source']}: {count['rows']} rows of its {count['available']}{split}")
    return f"data mixture of {len(mixture.counts)} sources: {'; '.join(said)}"
