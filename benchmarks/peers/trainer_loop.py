"""transformers' Trainer on the job benchmarks/benchmark_peers.py times, with its defaults for what the job leaves
open.

Same model config, packed blocks (common.data.loading, outside the timed steps), per-device batch,
steps, learning rate and schedule as the recipe and the bare loop; the precision comes from
the accelerate config it is launched with (bf16 there: Trainer's bf16=True). Its optimizer
is its default, torch's fused AdamW, with weight decay 0 as in the other two.

    accelerate launch --config_file accelerate_configs/ddp.yaml benchmarks/peers/trainer_loop.py \
        --model_config cfg.json --tokenizer tok --train_file train.jsonl --block_size 128 \
        --batch_size 8 --steps 40 --warmup 10 --learning_rate 1e-3 --out result.json
"""

import os
import tempfile
import time

import torch
from accelerate import PartialState
from job import packed_blocks_and_model, parse_job, write_result
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from common.launch.errors import exit_now


class StepClock(TrainerCallback):
    """The time at the end of step `warmup` and at the end of the last step, and the input tokens seen by then
    (`seen`: Trainer's num_input_tokens_seen, which TRL's GRPOTrainer counts itself)."""

    def __init__(self, warmup: int):
        self.warmup, self.times, self.seen = warmup, {}, {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.warmup, state.max_steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels done, not just queued
            self.times[state.global_step] = time.perf_counter()
            self.seen[state.global_step] = state.num_input_tokens_seen

    def timed(self, figure: dict) -> float:
        """`figure` (`times` or `seen`) over the timed steps: those after the warm-up."""
        return figure[max(figure)] - figure[self.warmup]


class FirstLog(TrainerCallback):
    """What Trainer logs at step 1 (logging_first_step): the loss and a trainer's own figures, before any update."""

    def __init__(self):
        self.logs = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == 1 and logs and "loss" in logs:
            self.logs = dict(logs)


def main():
    args = parse_job()
    state = PartialState()
    blocks, model = packed_blocks_and_model(args, state)
    bf16 = os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16"
    clock = StepClock(args.warmup)
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=args.learning_rate,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            bf16=bf16,
            logging_steps=args.steps,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            seed=0,
            dataloader_drop_last=True,
            disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(),
            torch_compile=args.torch_compile == "true",  # Trainer's own: the whole model, inductor
        )
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=blocks["train"],
            data_collator=default_data_collator,
            callbacks=[clock],
        )
        result = trainer.train()
    if state.is_main_process:
        write_result(
            args,
            clock.timed(clock.times),
            result.training_loss,
            training.world_size,
            optim=training.optim,
        )
    # Seen (torch 2.13, gloo): at the interpreter's exit, garbage-collecting DDP's reducer deadlocks in
    # ProcessGroupGloo's destructor (its worker thread waits for the GIL the exiting thread holds), even
    # with the process group destroyed first. The recipes skip that teardown the same way
    # (common.launch.errors.exit_now).
    exit_now(0)


if __name__ == "__main__":
    main()
