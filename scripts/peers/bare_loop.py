"""The plainest accelerate loop for the job scripts/benchmark_peers.py times: what the recipe is measured against.

No metrics, no checks, no checkpoints: prepare, forward, backward, clip, step, schedule. The
data are the recipe's packed blocks (common.data, outside the timed steps); the optimizer is
torch's fused AdamW with no weight decay, as the recipe's and Trainer's are in the benchmark.

    accelerate launch --config_file accelerate_configs/ddp.yaml scripts/peers/bare_loop.py \
        --model_config cfg.json --tokenizer tok --train_file train.jsonl --block_size 128 \
        --batch_size 8 --steps 40 --warmup 10 --learning_rate 1e-3 --out result.json
"""

import argparse
import json
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler

from common.arguments import DataArguments
from common.data import load_raw_datasets, make_dataloaders, tokenize_and_pack


def main():
    parser = argparse.ArgumentParser()
    for name in ("model_config", "tokenizer", "train_file", "validation_file", "out"):
        parser.add_argument(f"--{name}", required=True)
    for name, default in (("block_size", 128), ("batch_size", 8), ("steps", 40), ("warmup", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # a CPU host: gloo, as a user writes it there
    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    raw = load_raw_datasets(DataArguments(train_file=args.train_file, validation_file=args.validation_file), 0)
    loader, _ = make_dataloaders(tokenize_and_pack(raw, tokenizer, "text", args.block_size, accelerator),
                                 args.batch_size, args.batch_size, 0)
    config = AutoConfig.from_pretrained(args.model_config, vocab_size=len(tokenizer))
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, fused=True)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    model.train()
    step, started = 0, None
    while step < args.steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step == args.warmup:
                started = time.perf_counter()
            if step == args.steps:
                break
    seconds = time.perf_counter() - started
    tokens = (args.steps - args.warmup) * args.batch_size * args.block_size * accelerator.num_processes
    if accelerator.is_main_process:
        with open(args.out, "w") as handle:
            json.dump({"seconds": seconds, "tokens": tokens, "loss": float(loss.detach()),
                       "processes": accelerator.num_processes}, handle)
    accelerator.end_training()
    if torch.distributed.is_initialized():  # left to the interpreter's exit, gloo's teardown can hang there
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
