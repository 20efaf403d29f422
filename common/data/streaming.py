"""--streaming: a training split read as it is consumed, for corpora larger than memory or disk.

A datasets IterableDataset, from the Hub or from local files.

* Packed as the map-style path packs (documents joined with EOS, cut into block_size
  blocks, the partial block of every 1,000 documents dropped), on the fly.
* Split across ranks without overlap (`split_dataset_by_node`). With one file, or a number
  of files (shards) the world size does not divide, every rank reads and packs the whole
  stream and keeps every N-th block: rank r gets blocks r, r+N, ... of exactly the
  map-style path's blocks, and step k trains on blocks [k x G, (k+1) x G) for global batch
  G, as the map-style path does on its shuffled order. The reading and tokenizing are then
  repeated on every rank. When the world size divides the number of files, each rank reads
  only its own files (and packs its own documents): give a large corpus as a multiple of the
  process count of files. Nothing is cached, so no node tokenizes for a node-local cache.
* Order: the file (or Hub) order, with no shuffle (pretraining corpora are shuffled when
  they are written); every epoch reads the stream again from the start. The map-style path
  shuffles its blocks every epoch instead: that is the one difference in what is trained on.
* Epochs end together: a step runs only when every rank has a full window of micro-batches
  (one all-reduce); when one rank's stream runs out, all ranks start the next epoch.
* Exact resume: each rank's stream position (`IterableDataset.state_dict`, which counts
  the documents and blocks already read) goes into the checkpoint; a resumed run continues
  at the next block of every rank. On the same number of processes only: blocks (or files)
  are dealt to ranks by the world size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from accelerate import PartialState
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader
from transformers import default_data_collator

from common.data.sources import load_local
from common.launch.errors import UsageError


if TYPE_CHECKING:
    from datasets import IterableDataset


def load_train_stream(builder: str, data_files: dict, text_columns) -> IterableDataset:
    """The training file as an IterableDataset (nothing read ahead), its text columns as written
    (common.data.sources.load_local); a Hub dataset's stream comes from common.data.loading.load_hub_dataset."""
    return load_local(builder, {"train": data_files["train"]}, text_columns, split="train", streaming=True)


def column_names(dataset) -> list[str]:
    """A dataset's columns; a stream that does not know them yet reads its first row for them."""
    return dataset.column_names or list(next(iter(dataset.take(1)), {}).keys())


def tokenize_and_pack_stream(
    stream: IterableDataset, text_column: str, tokenize, pack, block_size: int, eos_token_id: int, accelerator
) -> IterableDataset:
    """This rank's documents, tokenized and packed as they are read."""
    from datasets.distributed import split_dataset_by_node

    columns = column_names(stream)
    if text_column not in columns:
        raise UsageError(f"column {text_column!r} not in the train data (columns: {columns}); set --text_column")
    mine = split_dataset_by_node(stream, rank=accelerator.process_index, world_size=accelerator.num_processes)
    tokenized = mine.map(tokenize, batched=True, remove_columns=columns)
    return tokenized.map(
        pack,
        batched=True,
        batch_size=1000,
        remove_columns=["input_ids"],
        fn_kwargs={"block_size": block_size, "eos_token_id": eos_token_id},
    )


class StreamLoader:
    """Batches of a rank's packed stream (a DataLoader with no workers, so the dataset's
    state is exactly what was consumed). `accelerator.prepare` leaves it as it is: the
    stream is already this rank's share."""

    def __init__(self, dataset: IterableDataset, batch_size: int):
        self.dataset, self.batch_size, self.device = dataset, batch_size, PartialState().device
        self.total_batch_size = batch_size * PartialState().num_processes
        self.epoch, self._batches = 0, None

    def _open(self, stream_state: dict | None = None) -> None:
        """Start reading this epoch, from the beginning or from a saved stream state."""
        self.dataset.set_epoch(self.epoch)
        if stream_state is not None:
            self.dataset.load_state_dict(stream_state)
        self._batches = iter(
            DataLoader(self.dataset, batch_size=self.batch_size, drop_last=True, collate_fn=default_data_collator)
        )

    def window(self, size: int) -> list | None:
        """The next `size` batches of this rank, or None if its stream ends first."""
        if self._batches is None:
            self._open()
        window = []
        for batch in self._batches:
            window.append(send_to_device(batch, self.device))
            if len(window) == size:
                return window
        return None

    @property
    def at_epoch_start(self) -> bool:
        return self._batches is None

    def next_epoch(self) -> None:
        self.epoch, self._batches = self.epoch + 1, None

    def state(self) -> dict:
        """This rank's position: the epoch and the stream's own state within it."""
        return {"epoch": self.epoch, "stream": self.dataset.state_dict() if self._batches is not None else None}

    def restore(self, state: dict) -> None:
        self.epoch, self._batches = state["epoch"], None
        if state["stream"] is not None:  # mid-epoch; None: at the start of the epoch
            self._open(state["stream"])


def every_rank_has(accelerator, window) -> bool:
    """True when no rank's stream has run out (one all-reduce of a flag)."""
    flag = torch.tensor([0 if window is None else 1], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() == accelerator.num_processes)


def check_resumable(position: dict, accelerator) -> None:
    saved = len(position["ranks"])
    if saved != accelerator.num_processes:
        raise UsageError(
            f"this streaming checkpoint was written by {saved} processes and this run has "
            f"{accelerator.num_processes}: a stream's documents are dealt to ranks by their number, so "
            f"resume it on {saved} processes (or start afresh)"
        )
