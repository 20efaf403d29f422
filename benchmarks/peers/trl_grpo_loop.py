"""TRL's GRPOTrainer on the GRPO job benchmarks/benchmark_peers.py times: what recipes/grpo.py is measured against.

Same model (the config built as the recipe builds it, pad/EOS/BOS from the tokenizer, initialised by the recipe's
common.models.loading.initialise_weights with the same seed: the same starting weights), prompts (`make grpo`'s: a
conversation in a `prompt` column, rendered by the tokenizer's chat template with its generation prompt), reward
(common.objectives.rewards.accuracy_reward: 1 where the completion's last number is the row's `answer`, the function
the recipe's `--reward_funcs accuracy` runs), G completions per prompt, max completion length, temperature (top-p 1,
no top-k), loss type dapo, beta 0 (no reference), one iteration per rollout, group-scaled advantages, per-device
batch in completions (TRL's per_device_train_batch_size and the recipe's count the same), steps, learning rate and
linear schedule, clipping at 1.0, optimizer (torch's fused AdamW, no weight decay), dropout off and precision (the
accelerate config's). Generation is TRL's plain `model.generate` (no vLLM, no continuous batching): under ZeRO-3 inside
its `unwrap_model_for_generation`, the whole model gathered on every rank for the rollout (ds3_gather_for_generation,
default True). trl is installed by `make benchmark-peers` only.

With --recipe_samples TRL's GRPOTrainer draws its completions as the recipe does (RecipeSampled, below) and logs
every step: the same completions, so that each figure both log (loss, gradient norm, entropy at the temperature,
rewards, lengths) can be compared step by step, everything but the sampling TRL's own.

    accelerate launch --config_file accelerate_configs/ddp.yaml benchmarks/peers/trl_grpo_loop.py \
        --model_config cfg.json --tokenizer tok --train_file train.jsonl --validation_file validation.jsonl \
        --batch_size 8 --num_generations 8 --max_completion_length 16 --steps 40 --warmup 10 \
        --learning_rate 1e-3 --out result.json
"""

import tempfile

import torch
from datasets import load_dataset
from job import job_parser
from trainer_loop import FirstLog, StepClock
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl_job import job_settings, recipe_built_model, write_result

from common.launch.errors import exit_now
from common.objectives.rewards import accuracy_reward
from common.objectives.rollout import SamplingSettings, row_seed, sample_group, stop_token_ids


class RecipeSampled(GRPOTrainer):
    """TRL's GRPOTrainer with the recipe's sampler in place of `generate`: each prompt's G completions drawn by
    common.objectives.rollout.sample_group, token by token the inverse CDF (at the temperature, in float64) at
    uniforms seeded by (seed, rollout, the prompt's row), as recipes/grpo.py draws them. The prompts are TRL's
    (its RepeatSampler's order, its chat-template rendering); rewards, advantages, log-probabilities, loss,
    gradient and metrics are TRL's own. One rollout a step (one iteration, no accumulation): the rollout's index is
    the step's."""

    def _generate_and_score_completions(self, inputs):
        self._rows = [row["row"] for row in inputs]  # each completion's prompt row (a column this script adds)
        return super()._generate_and_score_completions(inputs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        group = self.num_generations
        stop, pad = stop_token_ids(self._tokenizer, self.model), self._tokenizer.pad_token_id
        settings = SamplingSettings(self.temperature, self.top_p, self.max_completion_length, stop, pad)
        completions = []
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as model, torch.no_grad():
            for start in range(0, len(prompt_ids), group):
                rows = set(self._rows[start : start + group])
                if len(rows) != 1:
                    raise SystemExit(f"error: a group of {group} completions spans prompt rows {sorted(rows)}")
                seed = row_seed(self.args.seed, self.state.global_step, rows.pop())
                uniforms = torch.rand(
                    group,
                    self.max_completion_length,
                    generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64,
                )
                ids, _, _ = sample_group(model, prompt_ids[start], uniforms, settings, self.accelerator)
                completions += ids
        return completions, None


class EveryLog(TrainerCallback):
    """Every training log Trainer writes, with its step."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({"step": state.global_step, **logs})


def main():
    parser = job_parser()  # --block_size is not read: TRL keeps whole prompts (the recipe drops none of these)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--recipe_samples", action="store_true", help="sample as the recipe does (RecipeSampled)")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts = load_dataset("json", data_files=args.train_file, split="train")
    if args.recipe_samples:
        prompts = prompts.add_column("row", list(range(len(prompts))))
    model = recipe_built_model(args.model_config, tokenizer)
    clock, first, every = StepClock(args.warmup), FirstLog(), EveryLog()
    with tempfile.TemporaryDirectory() as output_dir:
        settings = GRPOConfig(
            **job_settings(args, output_dir),
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            top_p=1.0,
            loss_type="dapo",
            beta=0.0,
            num_iterations=1,
            scale_rewards="group",
            disable_dropout=True,
        )
        trainer = (RecipeSampled if args.recipe_samples else GRPOTrainer)(
            model=model,
            reward_funcs=accuracy_reward,
            args=settings,
            train_dataset=prompts,
            processing_class=tokenizer,
            callbacks=[clock, first, every],
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
            logs=every.logs,
        )
    # As in trainer_loop.py: DDP's reducer can deadlock in gloo's destructor at exit (common.launch.errors.exit_now).
    exit_now(0)


if __name__ == "__main__":
    main()
