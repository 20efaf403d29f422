"""Evaluate a saved causal LM (e.g. output_dir/final) on a text file: loss and perplexity.

Evaluates the validation split training used (--validation_file, or the seeded
hold-out of --train_file) with the same packing and evaluation code, so the
figure matches the eval_loss the run logged.

    python scripts/evaluate_model.py --model_name_or_path outputs/causal_lm_demo/final \
        --train_file outputs/data/markov/train.jsonl \
        --validation_file outputs/data/markov/validation.jsonl --block_size 64 --mixed_precision bf16
"""

import json
from dataclasses import dataclass, field

from accelerate import Accelerator

from common.data.loading import load_raw_datasets, make_dataloaders, tokenize_and_pack
from common.models.loading import load_model, load_tokenizer
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.options.parsing import parse_args
from common.training.loop import evaluate_loss


@dataclass
class EvalArguments:
    mixed_precision: str = field(
        default="no",
        metadata={
            "help": "no or bf16: evaluate as the run did (bf16 autocast for a run launched with a bf16 config)."
        },
    )


def main(argv=None):
    model_args, data_args, eval_args, args = parse_args(
        (ModelArguments, DataArguments, EvalArguments, TrainingArguments), argv
    )
    accelerator = Accelerator(cpu=True, mixed_precision=eval_args.mixed_precision)
    tokenizer = load_tokenizer(model_args)
    # The same validation split training used: --validation_file, or the seeded hold-out of train.
    raw = load_raw_datasets(data_args, args.seed)
    packed = tokenize_and_pack(raw, tokenizer, data_args.text_column, data_args.block_size, accelerator)
    _, loader = make_dataloaders(packed, 1, args.per_device_eval_batch_size, args.seed)
    model = load_model(model_args, tokenizer, args.seed)
    model, loader = accelerator.prepare(model, loader)
    result = evaluate_loss(model, loader, accelerator)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
