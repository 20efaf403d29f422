"""TRL's DPOTrainer on the DPO job scripts/benchmark_peers.py times: what recipes/dpo.py is measured against.

Same model config (a Llama built from it, seeded, though not initialised as the recipe initialises it;
its reference a frozen copy, as the recipe holds one under DDP), pairs (`make dpo`'s data in TRL's
conversational format, rendered by the same chat template; TRL tokenizes them before training),
per-device batch, steps, learning rate and linear schedule, beta, sigmoid loss, clipping at 1.0,
optimizer (torch's fused AdamW, no weight decay) and precision (the accelerate config's: bf16=True under
ddp.yaml), no activation checkpointing (TRL's configs turn it on by default; the recipe's leave it off).
trl is installed by `make benchmark-peers` only; the recipes do not use it.

    accelerate launch --config_file accelerate_configs/ddp.yaml scripts/peers/trl_dpo_loop.py \
        --model_config cfg.json --tokenizer tok --train_file train.jsonl --validation_file validation.jsonl \
        --block_size 32 --batch_size 8 --steps 40 --warmup 10 --learning_rate 1e-3 --beta 0.1 --out result.json
"""

import copy
import json
import os
import tempfile

import torch
from accelerate import PartialState
from accelerate.utils import set_seed
from datasets import load_dataset
from job import job_parser
from trainer_loop import StepClock
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

from common.errors import exit_now


class FirstLoss(TrainerCallback):
    """The loss Trainer logs at step 1 (logging_first_step), before any update."""

    def __init__(self):
        self.loss = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == 1 and logs and "loss" in logs:
            self.loss = logs["loss"]


def main():
    parser = job_parser()  # the validation file is not read: the job times training only
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args()

    state = PartialState()
    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    pairs = load_dataset("json", data_files=args.train_file, split="train")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config, vocab_size=len(tokenizer)))
    model.config.use_cache = False
    reference = copy.deepcopy(model)
    bf16 = os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16"
    clock, first = StepClock(args.warmup), FirstLoss()
    with tempfile.TemporaryDirectory() as output_dir:
        config = DPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=args.learning_rate,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            bf16=bf16,
            logging_steps=args.warmup,
            logging_first_step=True,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            seed=0,
            dataloader_drop_last=True,
            disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(),
            gradient_checkpointing=False,
            beta=args.beta,
            loss_type=["sigmoid"],
            max_length=args.block_size,
        )
        trainer = DPOTrainer(
            model=model,
            ref_model=reference,
            args=config,
            train_dataset=pairs,
            processing_class=tokenizer,
            callbacks=[clock, first],
        )
        trainer.train()
    if state.is_main_process:
        pairs_timed = (args.steps - args.warmup) * args.batch_size * config.world_size
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "seconds": clock.times[args.steps] - clock.times[args.warmup],
                    "pairs": pairs_timed,
                    "first_loss": first.loss,
                    "processes": config.world_size,
                    "optim": config.optim,
                },
                handle,
            )
    # As in trainer_loop.py: DDP's reducer can deadlock in gloo's destructor at exit (common.errors.exit_now).
    exit_now(0)


if __name__ == "__main__":
    main()
