"""The plainest accelerate loop for the job benchmarks/benchmark_peers.py times: what the recipe is measured against.

No metrics, no checks, no checkpoints: prepare, forward, backward, clip, step, schedule. The
data are the recipe's packed blocks (common.data.loading, outside the timed steps); the optimizer is
torch's fused AdamW with no weight decay, as the recipe's and Trainer's are in the benchmark.

    accelerate launch --config_file accelerate_configs/ddp.yaml benchmarks/peers/bare_loop.py \
        --model_config cfg.json --tokenizer tok --train_file train.jsonl --block_size 128 \
        --batch_size 8 --steps 40 --warmup 10 --learning_rate 1e-3 --out result.json
"""

import time

import torch
from accelerate import Accelerator
from accelerate.utils import TorchDynamoPlugin, set_seed
from job import packed_blocks_and_model, parse_job, write_result
from transformers import get_scheduler

from common.data.loading import make_dataloaders
from common.launch.errors import exit_now


def main():
    args = parse_job()
    # --torch_compile true: accelerate's regional compilation (each repeated layer once), as its docs advise
    compiled = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # a CPU host: gloo, as a user writes it there
        dynamo_plugin=compiled if args.torch_compile == "true" else None,
    )
    set_seed(0)
    blocks, model = packed_blocks_and_model(args, accelerator)
    loader, _ = make_dataloaders(blocks, args.batch_size, args.batch_size, 0)
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
            if step in (args.warmup, args.steps) and torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels done, not just queued
            if step == args.warmup:
                started = time.perf_counter()
            if step == args.steps:
                break
    seconds = time.perf_counter() - started
    if accelerator.is_main_process:
        write_result(args, seconds, float(loss.detach()), accelerator.num_processes)
    accelerator.end_training()
    # Seen (torch 2.13, gloo): at the interpreter's exit, garbage-collecting DDP's reducer deadlocks in
    # ProcessGroupGloo's destructor (its worker thread waits for the GIL the exiting thread holds), even
    # with the process group destroyed first. The recipes skip that teardown the same way
    # (common.launch.errors.exit_now).
    exit_now(0)


if __name__ == "__main__":
    main()
