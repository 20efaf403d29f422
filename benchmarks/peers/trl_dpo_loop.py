"""TRL's DPOTrainer on the DPO job benchmarks/benchmark_peers.py times: what recipes/dpo.py is measured against.

Same model config (a Llama built from it, seeded, though not initialised as the recipe initialises it;
its reference a frozen copy, as the recipe holds one under DDP), pairs (`make dpo`'s data in TRL's
conversational format, rendered by the same chat template; TRL tokenizes them before training),
per-device batch, steps, learning rate and linear schedule, beta, sigmoid loss, clipping at 1.0,
optimizer (torch's fused AdamW, no weight decay) and precision (the accelerate config's: bf16=True under
ddp.yaml), no activation checkpointing (TRL's configs turn it on by default; the recipe's leave it off).
trl is installed by `make benchmark-peers` only; the recipes do not use it.

    accelerate launch --config_file accelerate_configs/ddp.yaml benchmarks/peers/trl_dpo_loop.py \
        --model_config cfg.json --tokenizer tok --train_file train.jsonl --validation_file validation.jsonl \
        --block_size 32 --batch_size 8 --steps 40 --warmup 10 --learning_rate 1e-3 --beta 0.1 --out result.json
"""

import copy
import tempfile

from accelerate.utils import set_seed
from datasets import load_dataset
from job import job_parser
from trainer_loop import FirstLog, StepClock
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
from trl_job import job_settings, write_result

from common.launch.errors import exit_now


def main():
    parser = job_parser()  # the validation file is not read: the job times training only
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args()

    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    pairs = load_dataset("json", data_files=args.train_file, split="train")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config, vocab_size=len(tokenizer)))
    model.config.use_cache = False
    reference = copy.deepcopy(model)
    clock, first = StepClock(args.warmup), FirstLog()
    with tempfile.TemporaryDirectory() as output_dir:
        config = DPOConfig(
            **job_settings(args, output_dir),
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
    if trainer.accelerator.is_main_process:
        write_result(
            args.out,
            clock,
            trainer,
            samples=(args.steps - args.warmup) * args.batch_size * config.world_size,  # pairs
            first_loss=first.logs.get("loss"),
        )
    # As in trainer_loop.py: DDP's reducer can deadlock in gloo's destructor at exit (common.launch.errors.exit_now).
    exit_now(0)


if __name__ == "__main__":
    main()
