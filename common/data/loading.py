"""Datasets: load, tokenize, pack into blocks and batch, with seeded dataloaders.

From the Hub or local files, tokenized with a cached batched `map`; token streams packed
into fixed-length blocks."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from torch.utils.data import DataLoader
from transformers import default_data_collator

from common.data.mixture import announce, load_mixture, stream_mixture
from common.data.sources import TEXT_COLUMNS, load_local, refuse_dates_in_text
from common.data.streaming import StreamLoader, load_train_stream, tokenize_and_pack_stream
from common.launch.errors import UsageError, describe, downloads_off, load_fault
from common.launch.peers import main_process_alone
from common.options.arguments import DataArguments
from common.options.dataset_mixture import FILE_BUILDERS
from common.parallel import sequence_parallel


if TYPE_CHECKING:
    from datasets import DatasetDict


STREAM_HELD_OUT = 1000  # validation rows taken from a stream that has no validation split


def load_raw_datasets(args: DataArguments, seed: int) -> DatasetDict:
    """A DatasetDict with `train` and `validation` (split off train if none is given), every column a
    recipe reads as text as the text written (common.data.sources.load_local).
    With --streaming, `train` is an IterableDataset read as it is consumed (common.data.streaming)."""
    from datasets import DatasetDict

    text = text_columns(args)
    builder = data_files = None
    if not args.dataset_name:
        data_files = {"train": args.train_file} if args.train_file else {}
        if args.validation_file:
            data_files["validation"] = args.validation_file
        extensions = {os.path.splitext(path)[1].lower() for path in data_files.values()}
        if len(extensions) > 1 or not extensions <= FILE_BUILDERS.keys():
            raise UsageError(f"data files must share one of {sorted(FILE_BUILDERS)}; got {sorted(extensions)}")
        builder = FILE_BUILDERS[extensions.pop()] if extensions else None
    if args.streaming:
        return _load_streaming(args, builder, data_files, seed, text)
    if args.mixture:
        raw = _mixed(args, builder, seed, text)
    elif args.dataset_name:
        raw = load_hub_dataset(args)
        for split, dataset in raw.items():
            refuse_dates_in_text(dataset, text, f"--dataset_name {args.dataset_name} split {split}")
    else:
        raw = _load_files(builder, data_files, text)
    for split, dataset in raw.items():
        if len(dataset) == 0:
            raise UsageError(f"the {split} split has no rows{_files_of(args, split)}; give a file with data")
    if "validation" not in raw:
        try:
            split = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=seed)
        except ValueError as error:  # too few rows to split off a validation set
            raise UsageError(
                f"cannot split {len(raw['train'])} training rows at --validation_split_percentage "
                f"{args.validation_split_percentage} ({describe(error)}); give a --validation_file "
                "or more data"
            ) from None
        raw = DatasetDict(train=split["train"], validation=split["test"])
    if args.max_eval_samples:
        raw["validation"] = raw["validation"].select(range(min(args.max_eval_samples, len(raw["validation"]))))
    return raw


def text_columns(args: DataArguments) -> tuple:
    """The columns a recipe reads as text: --text_column and common.data.sources.TEXT_COLUMNS."""
    return (*TEXT_COLUMNS, args.text_column)


def load_hub_dataset(args: DataArguments, **kwargs):
    """load_dataset(--dataset_name, --dataset_config_name, **kwargs); one that does not load (a
    mistyped or unreachable name, a missing config name) is a one-line error."""
    config = f" --dataset_config_name {args.dataset_config_name}" if args.dataset_config_name else ""
    return _from_hub(
        args.dataset_name,
        args.dataset_config_name,
        f"--dataset_name {args.dataset_name}{config}",
        "with --dataset_config_name where it has several) or --train_file",
        **kwargs,
    )


def _from_hub(name: str, config: str | None, what: str, instead: str, **kwargs):
    from datasets import load_dataset

    try:
        return load_dataset(name, config, **kwargs)
    except (ConnectionError, FileNotFoundError, ValueError) as error:  # DatasetNotFoundError: a FileNotFoundError
        raise UsageError(
            f"{what} does not load ({describe(error)}); pass a Hub dataset reachable from here ({instead}"
            f"{downloads_off('HF_DATASETS_OFFLINE', 'HF_HUB_OFFLINE')}"
        ) from None


def _mixture_source(source, streaming: bool):
    """A --dataset_mixture source from the Hub (common.data.mixture loads local ones)."""
    config = f" config {source.config}" if source.config else ""
    return _from_hub(
        source.id,
        source.config,
        f"--dataset_mixture source {source.id}{config} split {source.split}",
        "with its config and split) or a local file as its id",
        split=source.split,
        streaming=streaming,
    )


def _mixed(args: DataArguments, builder: str | None, seed: int, text: tuple) -> DatasetDict:
    """--dataset_mixture: the mixed rows; validation from --validation_file, else held out of them."""
    from datasets import DatasetDict

    size = None if args.validation_file else args.mixture.test_split_size or args.validation_split_percentage / 100
    train, validation = load_mixture(args.mixture, seed, _mixture_source, size, text)
    if validation is None:
        validation = _load_files(builder, {"validation": args.validation_file}, text)["validation"]
    announce(args.mixture)
    return DatasetDict(train=train, validation=validation)


def _load_streaming(
    args: DataArguments, builder: str | None, data_files: dict | None, seed: int, text: tuple
) -> DatasetDict:
    """--streaming: the train stream, and a validation split held in memory: the validation
    file or the Hub's validation split (its first --max_eval_samples rows, default
    STREAM_HELD_OUT), else the stream's first rows, which training then skips."""
    from datasets import Dataset, DatasetDict, load_dataset

    held_out = args.max_eval_samples or STREAM_HELD_OUT
    validation = None
    if args.mixture:  # each source holds out its share of the rows (common.data.mixture)
        train, rows = stream_mixture(
            args.mixture, seed, _mixture_source, None if args.validation_file else held_out, text
        )
        validation = Dataset.from_list(rows) if rows else None
        announce(args.mixture)
    else:
        train = (
            load_hub_dataset(args, split="train", streaming=True)
            if args.dataset_name
            else load_train_stream(builder, data_files, text)
        )
        if args.dataset_name:
            refuse_dates_in_text(train, text, f"--dataset_name {args.dataset_name} split train")
    if args.validation_file:
        validation = _load_files(builder, {"validation": args.validation_file}, text)["validation"]
    elif validation is None:
        if args.dataset_name:
            try:
                validation = load_dataset(
                    args.dataset_name, args.dataset_config_name, split="validation", streaming=True
                )
            except ValueError:  # no validation split on the Hub
                pass
        if validation is None:
            validation, train = train.take(held_out), train.skip(held_out)
        validation = Dataset.from_list(list(validation.take(held_out)))
    if len(validation) == 0:
        raise UsageError(f"the validation split has no rows{_files_of(args, 'validation')}; give a file with data")
    if args.max_eval_samples:
        validation = validation.select(range(min(args.max_eval_samples, len(validation))))
    return DatasetDict(train=train, validation=validation)


def _files_of(args: DataArguments, split: str) -> str:
    path = {"train": args.train_file, "validation": args.validation_file}.get(split)
    return f" ({path})" if path else ""


def _load_files(builder: str, data_files: dict, text: tuple) -> DatasetDict:
    """Local files, each column in `text` as written (common.data.sources.load_local); a file it cannot read is a
    one-line error naming it."""
    from datasets.exceptions import DatasetGenerationError
    from pyarrow import ArrowException

    # a row it cannot read; a file whose schema it cannot read before that (a parquet file cut short)
    unreadable = (DatasetGenerationError, ArrowException)
    try:
        raw = load_local(builder, data_files, text)
        _same_columns({data_files[split]: dataset.column_names for split, dataset in raw.items()})
        return raw
    except StopIteration:  # what datasets raises for an empty file
        empty = [path for path in data_files.values() if os.path.getsize(path) == 0] or list(data_files.values())
        raise UsageError(f"{', '.join(empty)}: no data in the file; give a file with rows") from None
    except unreadable as error:
        if load_fault(error) in ("memory", "io"):  # this host's fault, not the file's: as it is
            raise
    alone = {}  # read each file alone to name the one at fault
    for split, path in data_files.items():
        try:
            alone[path] = load_local(builder, {split: path}, text)[split]
        except unreadable as error:
            if load_fault(error) in ("memory", "io"):
                raise
            raise UsageError(
                f"{path}: not readable as {builder} ({describe(error.__cause__ or error)}); fix the file "
                "(rows count from 0)"
            ) from None
    _same_columns({path: dataset.column_names for path, dataset in alone.items()})
    raise UsageError(  # the same names, of kinds that do not go together
        "the data files' columns differ in kind ("
        + "; ".join(f"{path}: {dataset.features}" for path, dataset in alone.items())
        + "); give every split's columns the same kinds"
    )


def _same_columns(columns: dict) -> None:
    """`columns`: each file's column names."""
    if len({tuple(names) for names in columns.values()}) > 1:
        raise UsageError(
            "the data files do not have the same columns ("
            + "; ".join(f"{path}: {names}" for path, names in columns.items())
            + "); give every split the same columns"
        )


def check_text_column(raw: DatasetDict, column: str) -> None:
    """Every value of `column` is a string (no numbers, lists or nulls), in every split. A column
    Arrow typed as text can only hold nulls besides strings, which its null count tells without
    reading the rows; only a mixed column is read to name the first value that is not text."""
    for split, dataset in raw.items():
        if getattr(dataset.features[column], "dtype", None) in ("string", "large_string"):
            bad = None if dataset.with_format("arrow")[column].null_count == 0 else [None]
        else:
            bad = [value for value in dataset[column] if not isinstance(value, str)][:1]
        if bad:
            raise UsageError(
                f"column {column!r} of the {split} data holds {bad[0]!r}, not text; every value "
                "must be a string (no nulls, numbers or lists)"
            )


def pack_sequences(examples: dict, block_size: int, eos_token_id: int) -> dict:
    """Concatenate `input_ids` documents with EOS after each, cut into `block_size` blocks.

    Blocks tile the stream exactly; only the final partial block (< block_size
    tokens) of each batch passed in is dropped. No padding, so no compute is spent on it."""
    stream: list[int] = []
    for ids in examples["input_ids"]:
        stream.extend(ids)
        stream.append(eos_token_id)
    usable = len(stream) // block_size * block_size
    blocks = [stream[start : start + block_size] for start in range(0, usable, block_size)]
    return {"input_ids": blocks, "labels": [list(block) for block in blocks]}


def tokenize_and_pack(
    raw: DatasetDict, tokenizer, text_column: str, block_size: int, accelerator, num_proc: int | None = None
) -> DatasetDict:
    """Tokenize every split (batched, cached) and pack it into blocks of `block_size`."""
    from datasets import DatasetDict, IterableDataset

    stream = raw["train"] if isinstance(raw["train"], IterableDataset) else None
    if stream is not None:  # --streaming: each rank packs its own documents as they are read
        raw = DatasetDict(validation=raw["validation"])
    _check_columns(raw, text_column)
    check_text_column(raw, text_column)
    if tokenizer.eos_token_id is None:
        raise UsageError("the tokenizer has no eos_token, which packing puts between documents; set one")

    def tokenize(batch):
        return tokenizer(batch[text_column], add_special_tokens=False, return_attention_mask=False)

    # rank 0 builds the cache, the others read it
    with accelerator.main_process_first(), main_process_alone(accelerator, "tokenizing"):
        tokenized = raw.map(
            tokenize, batched=True, num_proc=num_proc, remove_columns=raw["validation"].column_names, desc="tokenizing"
        )
        packed = tokenized.map(
            pack_sequences,
            batched=True,
            batch_size=1000,
            num_proc=num_proc,
            fn_kwargs={"block_size": block_size, "eos_token_id": tokenizer.eos_token_id},
            remove_columns=tokenized["validation"].column_names,
            desc=f"packing into {block_size}-token blocks",
        )
    if getattr(accelerator, "is_local_main_process", False) and not accelerator.is_main_process:  # another node
        cache = (
            os.path.dirname(packed["validation"].cache_files[0]["filename"])
            if packed["validation"].cache_files
            else "?"
        )
        print(
            f"note: the first node tokenized into {cache}; this node used it only if that path is on a filesystem "
            "all nodes share, else it tokenized its own copy (set HF_DATASETS_CACHE to a shared path, or use "
            "--streaming)",
            file=sys.stderr,
        )
    for split, dataset in packed.items():
        if len(dataset) == 0:
            raise UsageError(f"the {split} split has fewer than block_size={block_size} tokens; lower --block_size")
    if stream is not None:
        packed["train"] = tokenize_and_pack_stream(
            stream, text_column, tokenize, pack_sequences, block_size, tokenizer.eos_token_id, accelerator
        )
    return packed


def make_dataloaders(
    datasets: DatasetDict,
    train_batch_size: int,
    eval_batch_size: int,
    seed: int,
    collate_fn=default_data_collator,
    eval_collate_fn=None,
):
    """Shuffled train loader (the order is a function of seed and epoch, so it resumes; its rows splittable under
    sequence parallelism) and an eval loader (with `eval_collate_fn` if given, else `collate_fn`)."""
    import torch
    from datasets import IterableDataset

    generator = torch.Generator().manual_seed(seed)
    if isinstance(datasets["train"], IterableDataset):  # --streaming: already this rank's share
        train = StreamLoader(datasets["train"], train_batch_size)
    else:
        train = DataLoader(
            datasets["train"],
            shuffle=True,
            batch_size=train_batch_size,
            collate_fn=sequence_parallel.splittable(collate_fn),
            generator=generator,
            drop_last=True,
        )
    evaluation = DataLoader(
        datasets["validation"], batch_size=eval_batch_size, collate_fn=eval_collate_fn or collate_fn
    )
    return train, evaluation


def _check_columns(raw: DatasetDict, *columns: str) -> None:
    for column in columns:
        for split, dataset in raw.items():
            if column not in dataset.column_names:
                raise UsageError(
                    f"column {column!r} not in the {split} data (columns: {dataset.column_names}); "
                    "set --text_column/--label_column/--messages_column"
                )


def check_labels(raw: DatasetDict, label_column: str) -> list[str]:
    """The label names (sorted, as text) a classifier learns from `label_column`: every row of every split has
    one label (no null, no NaN: a CSV's empty cell; no list), and the train split at least two classes."""
    for split, dataset in raw.items():
        for row, label in enumerate(dataset[label_column]):
            if label is None or label != label:  # NaN is not equal to itself
                raise UsageError(
                    f"row {row} of the {split} data has no label ({label!r} in column {label_column!r}); give every "
                    "row a label or drop the row (rows count from 0)"
                )
            if isinstance(label, (list, dict)):
                raise UsageError(
                    f"row {row} of the {split} data has {str(label)[:60]} in column {label_column!r}, not one "
                    "label; a row here has one class (rows count from 0)"
                )
    label_names = sorted({str(label) for label in raw["train"][label_column]})
    if len(label_names) < 2:
        raise UsageError(
            f"the train data has one class (label {label_names[0]!r}) in column {label_column!r}: a classifier "
            "learns nothing from it, and scores every row of that class right; give rows of at least two "
            "classes, or set --label_column"
        )
    return label_names


def tokenize_for_classification(
    raw: DatasetDict,
    tokenizer,
    text_column: str,
    label_column: str,
    max_length: int,
    accelerator,
    num_proc: int | None = None,
):
    """Tokenize (truncated to max_length, padded later per batch) and map labels to ids.

    Returns the datasets and the label names, sorted, as found in the train split."""
    _check_columns(raw, text_column, label_column)
    check_text_column(raw, text_column)
    label_names = check_labels(raw, label_column)
    unseen = {str(label) for label in raw["validation"][label_column]} - set(label_names)
    if unseen:
        raise UsageError(f"validation labels {sorted(unseen)} never occur in train; fix the split or the labels")
    label_ids = {name: index for index, name in enumerate(label_names)}

    def tokenize(batch):
        encoded = tokenizer(batch[text_column], truncation=True, max_length=max_length)
        encoded["labels"] = [label_ids[str(label)] for label in batch[label_column]]
        return encoded

    with accelerator.main_process_first(), main_process_alone(accelerator, "tokenizing"):
        tokenized = raw.map(
            tokenize, batched=True, num_proc=num_proc, remove_columns=raw["train"].column_names, desc="tokenizing"
        )
    return tokenized, label_names
