"""TRL's GKDTrainer on the distillation job benchmarks/benchmark_peers.py times: what recipes/distill.py is measured
against.

Same student (the config built as the recipe builds it, pad/EOS/BOS from the tokenizer, initialised by the recipe's
common.models.loading.initialise_weights with the same seed: the same starting weights), teacher (the job's folder,
loaded by both), chats (`make sft`'s arithmetic questions, a `messages` column: TRL's DataCollatorForChatML renders
them with the same chat template, labels on the last answer), --lmbda, --beta, --temperature, --max_new_tokens,
per-device batch, steps, learning rate and linear schedule, clipping at 1.0, optimizer (torch's fused AdamW, no
weight decay), dropout off and precision (the accelerate config's). An on-policy step is TRL's: `random.random() <=
lmbda` at each micro-batch, then `generate` (sampling at the temperature) over the rank's whole batch, left-padded.
trl is installed by `make benchmark-peers` only.

The input tokens each step trains on (prompt and completion, padding left out, every rank's) are counted as the
recipe's `tokens_per_s` counts them: from the batch the loss is computed on, after any on-policy generation.

    accelerate launch --config_file accelerate_configs/ddp.yaml benchmarks/peers/trl_gkd_loop.py \
        --model_config cfg.json --tokenizer tok --train_file train.jsonl --validation_file validation.jsonl \
        --teacher_model_name_or_path teacher --batch_size 8 --steps 40 --warmup 10 --learning_rate 1e-3 \
        --lmbda 0.5 --beta 0.5 --temperature 0.9 --max_new_tokens 16 --out result.json
"""

import tempfile

from datasets import load_dataset
from job import job_parser
from trainer_loop import FirstLog, StepClock
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl_job import job_settings, recipe_built_model, write_result

from common.launch.errors import exit_now


class CountedGKD(GKDTrainer):
    """TRL's GKDTrainer, counting the tokens of each batch its loss is computed on (every rank's) into the state's
    num_input_tokens_seen, which StepClock reads at the timed steps' ends."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        tokens = self.accelerator.gather(inputs["attention_mask"].sum().reshape(1)).sum()
        self.state.num_input_tokens_seen += int(tokens)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def main():
    parser = job_parser()  # the validation file is not read: the job times training only
    parser.add_argument("--teacher_model_name_or_path", required=True)
    parser.add_argument("--lmbda", type=float, default=0.5)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    chats = load_dataset("json", data_files=args.train_file, split="train")
    model = recipe_built_model(args.model_config, tokenizer)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher_model_name_or_path)
    clock, first = StepClock(args.warmup), FirstLog()
    with tempfile.TemporaryDirectory() as output_dir:
        settings = GKDConfig(
            **job_settings(args, output_dir),
            lmbda=args.lmbda,
            beta=args.beta,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            max_length=args.block_size,
            seq_kd=False,
            disable_dropout=True,
        )
        trainer = CountedGKD(
            model=model,
            teacher_model=teacher,
            args=settings,
            train_dataset=chats,
            processing_class=tokenizer,
            callbacks=[clock, first],
        )
        trainer.train()
    if trainer.accelerator.is_main_process:
        write_result(
            args.out,
            clock,
            trainer,
            samples=(args.steps - args.warmup) * args.batch_size * settings.world_size,  # chats
            tokens=clock.timed(clock.seen),  # prompt + completion tokens, every rank's, padding left out
            first_loss=first.logs.get("loss"),
        )
    # As in trainer_loop.py: DDP's reducer can deadlock in gloo's destructor at exit (common.launch.errors.exit_now).
    exit_now(0)


if __name__ == "__main__":
    main()
