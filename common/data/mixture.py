"""--dataset_mixture: several data sources mixed into one training set, seeded and exact.

The alignment-handbook's `dataset_mixture` (its recipe YAMLs run as they are), in a recipe YAML or
on the command line (a YAML or JSON file, or the JSON itself); docs/data.md shows the format. Each
source's rows are taken by a seeded shuffle, so the mixed set is the same on every rank and every
resume. The held-out rows are taken from each source's distinct rows before any row is repeated (a
weight above 1), so none is also trained on; a weight above 1 then repeats each row left for
training weight times (2.0: each twice; 1.5: each once, half of them twice), a count (`samples`)
fills its count. The rows each source gave to both, and how often its training rows repeat, are
logged and go to run.json (`data_sources`: `train`, `held_out`, `repeats` {times: rows}). Conversations in other shapes (ShareGPT turns, OpenAI text parts)
are read as role/content messages where the sources differ, so they mix; other columns must agree
in name and kind. With --streaming the sources are interleaved, each document drawn from a source
with the probability of its weight (or count) over their sum, until one ends the epoch.
"""

from __future__ import annotations

import os
import sys

from common.data.sources import load_local, refuse_dates_in_text
from common.data.streaming import column_names
from common.launch.errors import UsageError
from common.options.dataset_mixture import FILE_BUILDERS, Mixture, Source


def _load_source(source: Source, streaming: bool, load_hub, text_columns):
    """A source's rows, with its columns renamed by its `columns`; those a recipe reads as text
    (`text_columns`, under their names in the source) as the text written (common.data.sources.load_local)."""
    from datasets import load_dataset

    from common.launch.errors import describe, load_fault

    if source.columns:
        text_columns = [own for own, name in source.columns.items() if name in text_columns]
    builder = FILE_BUILDERS.get(os.path.splitext(source.id)[1].lower()) if os.path.isfile(source.id) else None
    if source.on_hub:
        dataset = load_hub(source, streaming)
    else:
        try:
            dataset = (
                load_local(builder, {"train": source.id}, text_columns, source.split, streaming)
                if builder
                else load_dataset(source.id, source.config, split=source.split, streaming=streaming)
            )
        except Exception as error:  # datasets' and pyarrow's errors for what a file holds (StopIteration: empty)
            if load_fault(error) in ("memory", "io"):
                raise
            raise UsageError(
                f"--dataset_mixture: source {source.id} split {source.split} does not load "
                f"({describe(error.__cause__ or error) if str(error) else 'no data in it'}); fix the "
                "file or its split (a local file's split is train, or a slice: train[:10%])"
            ) from None
    if not builder:  # the Hub's, a folder's: read by datasets as it reads them
        refuse_dates_in_text(dataset, text_columns, f"--dataset_mixture source {source.id} split {source.split}")
    columns = column_names(dataset)
    if source.columns:
        missing = [column for column in source.columns if column not in columns]
        if missing:
            raise UsageError(
                f"--dataset_mixture: source {source.id} has no column(s) {', '.join(map(repr, missing))} "
                f"(its columns: {columns}); fix its `columns`"
            )
        dataset = dataset.select_columns(list(source.columns))
        renames = {old: new for old, new in source.columns.items() if old != new}
        if renames:
            dataset = dataset.rename_columns(renames)
    return dataset


def load_mixture(mixture: Mixture, seed: int, load_hub, held_out: float | None, text_columns=()):
    """(train, validation): the mixed rows, and `held_out` rows (or that fraction) of them held out
    (None: no validation split, the validation set comes from elsewhere). `load_hub(source,
    streaming)` loads a Hub source; `text_columns` are read as the text written."""
    from datasets import concatenate_datasets

    seed = mixture.seed_or(seed)
    parts = []
    for index, source in enumerate(mixture.sources):
        dataset = _load_source(source, False, load_hub, text_columns)
        if len(dataset) == 0:
            raise UsageError(
                f"--dataset_mixture: source {source.id} (split {source.split}) has no rows; give it data "
                "or leave it out"
            )
        wanted = source.rows_from(len(dataset))
        if wanted < 1:
            raise UsageError(
                f"--dataset_mixture: source {source.id} gives no rows at weight {source.weight} of its "
                f"{len(dataset)}; raise its weight"
            )
        parts.append(dataset.shuffle(seed=seed + index))
        mixture.counts.append(
            {
                "source": source.id,
                "split": source.split,
                "hub": source.on_hub,
                "available": len(dataset),
                "rows": wanted,
            }
        )
    parts = _alike(parts, mixture)
    held = [0] * len(parts) if held_out is None else _held_per_source(mixture, held_out, seed)
    train, validation = [], []
    for part, count, rows, source in zip(parts, mixture.counts, held, mixture.sources):
        if rows >= count["available"]:
            raise UsageError(
                f"--dataset_mixture: cannot hold out {rows} of the {count['available']} rows of "
                f"{count['source']} for validation; lower test_split_size or give --validation_file"
            )
        validation.append(part.select(range(rows)))
        rest = part.select(range(rows, len(part)))
        # a weight above 1 repeats each row left for training weight times (2: each twice); a count (samples),
        # or a weight up to 1, takes the rows it gives the mixture less those held out
        taken = source.rows_from(len(rest)) if (source.weight or 0) > 1 else count["rows"] - rows
        whole, share = divmod(taken, len(rest))  # beyond its size: every row again, then a share
        train.append(concatenate_datasets([rest] * whole + [rest.select(range(share))]))
        count["rows"] = taken + rows
        if held_out is not None:
            count.update(train=taken, held_out=rows)
        if taken > len(rest):  # how many of its training rows come how many times
            count["repeats"] = {str(times): n for times, n in ((whole, len(rest) - share), (whole + 1, share)) if n}
    held_rows = concatenate_datasets(validation).shuffle(seed=seed) if held_out is not None else None
    return concatenate_datasets(train), held_rows


def _alike(parts: list, mixture: Mixture) -> list:
    """Sources whose columns differ in type made alike: conversations read as role/content messages
    (common.data.chat.as_messages), then each cast to the first's types; what cannot be is one line."""
    from common.data.chat import as_messages

    first = parts[0]
    _same_column_names([part.column_names for part in parts], mixture)
    if all(part.features == first.features for part in parts):
        return parts
    differing = [
        name for name in first.column_names if any(part.features[name] != first.features[name] for part in parts)
    ]
    chats = [name for name in differing if all(_turns(part.features[name]) for part in parts)]
    if chats:

        def read(batch):
            return {
                name: [
                    [{"role": turn["role"], "content": turn["content"]} for turn in as_messages(conversation)]
                    for conversation in batch[name]
                ]
                for name in chats
            }

        parts = [part.map(read, batched=True, desc="reading conversations as messages") for part in parts]
    for part, source in zip(parts[1:], mixture.sources[1:]):
        for name in part.column_names:  # only a cast that keeps every value: int32 to int64, string to large_string
            mine, theirs = part.features[name], parts[0].features[name]
            if mine != theirs and _kind(mine) != _kind(theirs) or _kind(mine) is None and mine != theirs:
                raise UsageError(
                    f"--dataset_mixture: column {name!r} of {source.id} ({mine}) is not of the kind of "
                    f"{mixture.sources[0].id}'s ({theirs}); make them the same (labels as text in "
                    "both, or numbers in both)"
                )
    return [parts[0]] + [part.cast(parts[0].features) for part in parts[1:]]


def _same_column_names(names: list[list[str]], mixture: Mixture) -> None:
    for columns, source in zip(names[1:], mixture.sources[1:]):
        if sorted(columns) != sorted(names[0]):
            raise UsageError(
                f"--dataset_mixture: source {source.id} has columns {sorted(columns)} and "
                f"{mixture.sources[0].id} {sorted(names[0])}; map them to the same names with `columns`"
            )


def _turns(feature) -> bool:
    """A column of conversations: a list of records (turns)."""
    inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    return isinstance(inner, dict)


def _kind(feature) -> str | None:
    dtype = getattr(feature, "dtype", None) if type(feature).__name__ == "Value" else None
    return next(
        (
            kind
            for kind, prefixes in (
                ("whole numbers", ("int", "uint")),
                ("numbers", ("float",)),
                ("text", ("string", "large_string")),
            )
            if str(dtype).startswith(prefixes)
        ),
        None,
    )


def _held_per_source(mixture: Mixture, size: float, seed: int) -> list[int]:
    """How many of each source's rows `size` rows (or that fraction) of the mixed rows hold out:
    the first `held` of a permutation of the mixed rows by `seed` (the mixture's), counted by source."""
    import numpy as np

    total = sum(count["rows"] for count in mixture.counts)
    held = int(round(size * total)) if size < 1 else int(size)
    if not 1 <= held < total:
        raise UsageError(
            f"cannot hold out {size} of the {total} mixed rows for validation; give test_split_size "
            "(or --validation_split_percentage) between 1 row and all of them, or --validation_file"
        )
    order = np.random.default_rng(seed).permutation(total)
    ends = np.cumsum([count["rows"] for count in mixture.counts])
    return np.bincount(np.searchsorted(ends, order[:held], side="right"), minlength=len(ends)).tolist()


def stream_mixture(mixture: Mixture, seed: int, load_hub, held_out: int | None, text_columns=()):
    """--streaming: (train stream, validation rows or None). The sources interleaved, drawn with their
    weights (or counts) as probabilities; `held_out` rows held out of the sources' first documents
    in those proportions (each source skipping its own, so no epoch's draws reach them)."""
    from datasets import interleave_datasets

    streams = [_load_source(source, True, load_hub, text_columns) for source in mixture.sources]
    _same_column_names([column_names(stream) for stream in streams], mixture)
    shares = [source.samples if source.samples is not None else (source.weight or 1.0) for source in mixture.sources]
    probabilities = [share / sum(shares) for share in shares]
    held = [int((held_out or 0) * probability) for probability in probabilities]  # then the rest by largest share
    for index in sorted(range(len(held)), key=lambda i: (held_out or 0) * probabilities[i] - held[i], reverse=True):
        held[index] += sum(held) < (held_out or 0)
    validation = [row for stream, rows in zip(streams, held) if rows for row in stream.take(rows)]
    for source, probability, rows in zip(mixture.sources, probabilities, held):
        mixture.counts.append(
            {
                "source": source.id,
                "split": source.split,
                "hub": source.on_hub,
                "probability": round(probability, 6),
                **({"held_out": rows} if held_out else {}),
            }
        )
    train = interleave_datasets(
        [stream.skip(rows) if rows else stream for stream, rows in zip(streams, held)],
        probabilities=probabilities,
        seed=mixture.seed_or(seed),
        stopping_strategy="first_exhausted",
    )
    return train, validation if held_out else None


def announce(mixture: Mixture) -> None:
    """One line in the main process's log: each source and what it gave."""
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(describe_counts(mixture), file=sys.stderr)


def describe_counts(mixture: Mixture) -> str:
    said = []
    for count in mixture.counts:
        if "probability" in count:  # --streaming: a weight is the chance a document comes from the source
            held = f", {count['held_out']} held out" if "held_out" in count else ""
            said.append(f"{count['source']}: drawn with probability {count['probability']:.3g}{held}")
        elif "train" in count:
            distinct = count["available"] - count["held_out"]
            train = (
                f"train {count['train']}: its other {distinct} rows{_repeats_said(count)}"
                if "repeats" in count
                else f"train {count['train']}"
            )
            said.append(
                f"{count['source']}: {count['rows']} rows of its {count['available']} (held out {count['held_out']}; "
                f"{train})"
            )
        else:
            repeats = f" (its rows{_repeats_said(count)})" if "repeats" in count else ""
            said.append(f"{count['source']}: {count['rows']} rows of its {count['available']}{repeats}")
    return f"data mixture of {len(mixture.counts)} sources: {'; '.join(said)}"


def _repeats_said(count: dict) -> str:
    """How often a source's training rows come: " 2 times each", ", 5 of them 2 times", " 2 times, 7 of them 3 times"."""
    (low, _), *more = sorted((int(times), n) for times, n in count["repeats"].items())
    if not more:
        return f" {low} times each"
    high, n = more[0]
    return f"{',' if low == 1 else f' {low} times,'} {n} of them {high} times"
