"""TRL's GRPOTrainer on the GRPO job benchmarks/benchmark_peers.py times: what recipes/grpo.py is measured against.

Same model (the config built as the recipe builds it, pad/EOS/BOS from the tokenizer, initialised by the recipe's
common.models.loading.initialise_weights with the same seed: the same starting weights), prompts (`make grpo`'s: a
conversation in a `prompt` column, rendered by the tokenizer's chat template with its generation prompt), reward
(common.objectives.rewards.accuracy_reward: 1 where the completion's last number is the row's `answer`, the function
the recipe's `--reward_funcs accuracy` runs), G completions per prompt, max completion length, temperature 1.0 (top-p
1, no top-k), loss type dapo, beta 0 (no reference), one iteration per rollout, group-scaled advantages, per-device
batch in completions (TRL's per_device_train_batch_size and the recipe's count the same), steps, learning rate and
linear schedule, clipping at 1.0, optimizer (torch's fused AdamW, no weight decay), dropout off and precision (the
accelerate config's). Generation is TRL's plain `model.generate` (no vLLM, no continuous batching): under ZeRO-3 inside
its `unwrap_model_for_generation`, the whole model gathered on every rank for the rollout (ds3_gather_for_generation,
default True). trl is installed by `make benchmark-peers` only.

    accelerate launch --config_file accelerate_configs/ddp.yaml benchmarks/peers/trl_grpo_loop.py \
        --model_config cfg.json --tokenizer tok --train_file train.jsonl --validation_file validation.jsonl \
        --batch_size 8 --num_generations 8 --max_completion_length 16 --steps 40 --warmup 10 \
        --learning_rate 1e-3 --out result.json
"""

import tempfile

from datasets import load_dataset
from job import job_parser
from trainer_loop import FirstLog, StepClock
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl_job import job_settings, write_result

from common.launch.errors import exit_now
from common.models.loading import initialise_weights
from common.objectives.rewards import accuracy_reward


def main():
    parser = job_parser()  # --block_size is not read: TRL keeps whole prompts (the recipe drops none of these)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=16)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts = load_dataset("json", data_files=args.train_file, split="train")
    config = AutoConfig.from_pretrained(
        args.model_config,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    initialise_weights(model, 0)
    model.config.use_cache = False  # as the recipe's: training forwards fill no cache (generate still caches)
    clock, first = StepClock(args.warmup), FirstLog()
    with tempfile.TemporaryDirectory() as output_dir:
        settings = GRPOConfig(
            **job_settings(args, output_dir),
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=1.0,
            top_p=1.0,
            loss_type="dapo",
            beta=0.0,
            num_iterations=1,
            scale_rewards="group",
            disable_dropout=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=accuracy_reward,
            args=settings,
            train_dataset=prompts,
            processing_class=tokenizer,
            callbacks=[clock, first],
        )
        trainer.train()
    if trainer.accelerator.is_main_process:
        write_result(
            args.out,
            clock,
            trainer,
            samples=(args.steps - args.warmup) * args.batch_size * settings.world_size,  # completions
            tokens=clock.timed(clock.seen),  # prompt + completion tokens, every rank's, padding left out
            first_loss=first.logs.get("loss"),
            first_reward=first.logs.get("reward"),
        )
    # As in trainer_loop.py: DDP's reducer can deadlock in gloo's destructor at exit (common.launch.errors.exit_now).
    exit_now(0)


if __name__ == "__main__":
    main()
