"""--streaming (common/data/streaming.py): the training split read as it is consumed, split across
ranks without overlap, packed on the fly, and resumed at the exact block after a stop."""

import json
import shlex
import shutil
from types import SimpleNamespace

import pytest
from conftest import (
    HOST_DTYPE,
    REPO,
    causal_lm_args,
    free_port,
    launch,
    losses,
    read_metrics,
    read_run,
    run_make_warm,
)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A corpus a 2-process run reads through in a few steps, so epochs come round."""
    from common.data.synthetic import write_markov_corpus

    out = tmp_path_factory.mktemp("small_markov")
    write_markov_corpus(str(out), train_docs=90, validation_docs=16, seed=3)
    return out


def packed_train_blocks(corpus, rank, world, streaming=True, block_size=32):
    """The training blocks rank `rank` of `world` gets, through the recipes' data functions."""
    import contextlib

    from transformers import AutoTokenizer

    from common.data.loading import load_raw_datasets, tokenize_and_pack
    from common.options.arguments import DataArguments

    tokenizer = AutoTokenizer.from_pretrained(corpus / "tokenizer")
    args = DataArguments(
        train_file=str(corpus / "train.jsonl"),
        validation_file=str(corpus / "validation.jsonl"),
        block_size=block_size,
        streaming=streaming,
    )
    accelerator = SimpleNamespace(
        process_index=rank, num_processes=world, is_main_process=rank == 0, main_process_first=contextlib.nullcontext
    )
    packed = tokenize_and_pack(load_raw_datasets(args, seed=0), tokenizer, "text", block_size, accelerator)
    return [row["input_ids"] for row in packed["train"]], tokenizer


def test_the_ranks_stream_the_map_style_blocks_dealt_in_turn(small_corpus):
    """One file and 2 ranks: every rank reads and packs the whole stream (packed as the map-style
    path packs: documents joined with EOS, cut into 32-token blocks) and keeps every 2nd block,
    so rank r's blocks are the map-style blocks r, r+2, ... in file order: no block on two
    ranks, none left out, and step k trains on map-style blocks [k x G, (k+1) x G)."""
    mapped, _ = packed_train_blocks(small_corpus, 0, 2, streaming=False)
    streamed = [packed_train_blocks(small_corpus, rank, 2)[0] for rank in (0, 1)]
    print(f"blocks per rank {[len(b) for b in streamed]}, map-style {len(mapped)}")
    assert len(mapped) >= 16
    assert streamed[0] == mapped[0::2] and streamed[1] == mapped[1::2]


def test_streaming_is_refused_where_it_cannot_work():
    from common.data.streaming import check_resumable
    from common.launch.errors import UsageError
    from common.options.arguments import DataArguments, TrainingArguments
    from common.options.parsing import _check_together

    data = DataArguments(train_file=str(REPO / "README.md"), streaming=True)
    with pytest.raises(UsageError, match="--streaming needs --max_steps"):
        _check_together([data, TrainingArguments(num_train_epochs=2)])
    with pytest.raises(UsageError, match="cannot be used with --auto_find_batch_size"):
        _check_together([data, TrainingArguments(max_steps=5, auto_find_batch_size=True)])
    in_memory = SimpleNamespace(reads_data_in_memory=True)
    with pytest.raises(UsageError, match="for the packed-text recipes"):
        _check_together([data, in_memory, TrainingArguments(max_steps=5)])
    with pytest.raises(UsageError, match="written by 2 processes and this run has 1: .* resume it on 2 processes"):
        check_resumable({"ranks": [{}, {}]}, SimpleNamespace(num_processes=1))


@pytest.mark.slow
def test_streaming_a_mixture_crosses_epochs_and_resumes_at_the_exact_block(small_corpus, tmp_path):
    """FSDP2 in bf16 (as fsdp.yaml ships), through `make causal_lm CONFIG=...` (the README's
    command for another config), 2 processes x 2 blocks x accumulation 2, the corpus given as a
    --dataset_mixture of two files (the second's column named otherwise, mapped to `text`) drawn
    3:1: the stream runs out after a few steps and every rank starts the next epoch together; a run
    stopped at its checkpoint after the epoch boundary resumes to the same per-step losses."""
    lines = (small_corpus / "train.jsonl").read_text().splitlines()
    (tmp_path / "first.jsonl").write_text("\n".join(lines[:60]) + "\n")
    (tmp_path / "second.jsonl").write_text(
        "".join(json.dumps({"body": json.loads(line)["text"]}) + "\n" for line in lines[60:])
    )
    mixture = {
        "datasets": [
            {"id": str(tmp_path / "first.jsonl"), "weight": 3},
            {"id": str(tmp_path / "second.jsonl"), "columns": {"body": "text"}},
        ],
        "seed": 5,
    }
    args = dict(
        dataset_mixture=json.dumps(mixture),
        train_file="",
        validation_file=small_corpus / "validation.jsonl",
        tokenizer_name_or_path=small_corpus / "tokenizer",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=16,
        save_steps=12,
        streaming="true",
    )
    out = tmp_path / "run"
    recipe_args = [str(a) for a in causal_lm_args(small_corpus, out, **args)]
    recipe_args = recipe_args[2:] if recipe_args[0] == "--config" else recipe_args  # make passes the demo's
    run_make_warm(  # make demo is causal_lm.py's make target launched as the README writes it (test_docs.py)
        [
            "make",
            "causal_lm",
            "CONFIG=accelerate_configs/fsdp.yaml",
            f"LAUNCH_ARGS=--main_process_port {free_port()}",
            f"ARGS={shlex.join(recipe_args)}",
        ]
    )
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["args"]["streaming"] is True
    assert record["distributed_type"] == "FSDP"
    assert record["compute_dtype"] == HOST_DTYPE and record["train_blocks"] is None
    assert [source["probability"] for source in record["data_sources"]] == [0.75, 0.25]
    state = json.loads((out / "checkpoints" / "step_12" / "trainer_state.json").read_text())["data"]
    epochs = [rank["epoch"] for rank in state["ranks"]]
    print(f"streaming: ranks at epoch {epochs} at step 12; global batch {state['global_batch']}")
    assert len(epochs) == 2 and epochs[0] == epochs[1] >= 1  # the stream ran out and every rank moved on
    full = losses(out)
    assert len(full) == 16

    stopped = tmp_path / "stopped"
    shutil.copytree(out / "checkpoints" / "step_12", stopped / "checkpoints" / "step_12")
    launch("fsdp.yaml", "causal_lm.py", causal_lm_args(small_corpus, stopped, resume_from_checkpoint="latest", **args))
    resumed = read_metrics(stopped)[0]
    assert [r["step"] for r in resumed] == [13, 14, 15, 16]
    gap = max(abs(a - r["loss"]) for a, r in zip(full[12:], resumed))
    print(f"streaming: resumed-loss gap {gap:.2e} (bf16)")
    assert gap < 1e-6
