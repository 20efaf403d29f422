"""The job both peers of the recipe run (benchmarks/benchmark_peers.py): its options, its packed blocks, its model."""

import argparse
import json

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.data.loading import load_raw_datasets, tokenize_and_pack
from common.options.arguments import DataArguments


def job_parser() -> argparse.ArgumentParser:
    """The options every peer takes (benchmarks/benchmark_peers.py passes each)."""
    parser = argparse.ArgumentParser()
    for name in ("model_config", "tokenizer", "train_file", "validation_file", "out"):
        parser.add_argument(f"--{name}", required=True)
    for name, default in (("block_size", 128), ("batch_size", 8), ("steps", 40), ("warmup", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--torch_compile", choices=("true", "false"), default="false", help="torch.compile the model")
    return parser


def parse_job():
    return job_parser().parse_args()


def packed_blocks_and_model(args, state):
    """The recipe's packed blocks (common.data.loading, before any timed step) and a model built from the config."""
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    raw = load_raw_datasets(DataArguments(train_file=args.train_file, validation_file=args.validation_file), 0)
    blocks = tokenize_and_pack(raw, tokenizer, "text", args.block_size, state)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config, vocab_size=len(tokenizer)))
    return blocks, model


def write_result(args, seconds: float, loss: float, processes: int, **extra) -> None:
    tokens = (args.steps - args.warmup) * args.batch_size * args.block_size * processes
    with open(args.out, "w") as handle:
        json.dump({"seconds": seconds, "tokens": tokens, "loss": loss, "processes": processes, **extra}, handle)
