"""Generate the demo data sets (seeded, offline). Idempotent: an existing set is kept.

    python scripts/make_demo_data.py --task markov --out outputs/data/markov
    python scripts/make_demo_data.py --task markov --seed 1 --out outputs/data/markov_shift
    python scripts/make_demo_data.py --task sentiment --out outputs/data/sentiment
    python scripts/make_demo_data.py --task arithmetic --out outputs/data/arithmetic
    python scripts/make_demo_data.py --task preference --out outputs/data/preference
    python scripts/make_demo_data.py --task format_preference --out outputs/data/format_preference
    python scripts/make_demo_data.py --task prompts --out outputs/data/prompts
    python scripts/make_demo_data.py --task format_prompts --out outputs/data/format_prompts

markov: a word-level Markov corpus with a known entropy floor (source.json) and its
tokenizer; another --seed gives a different chain over the same vocabulary.
sentiment: labelled sentences for classification. arithmetic: chat-formatted
questions with checkable answers, with a tokenizer that has a chat template. preference:
the same questions as pairs, the right answer chosen over a near miss (for DPO). format_preference:
for a real chat model (no tokenizer written), a system turn asking for the number only, the bare
right number chosen over the right number in a sentence. prompts: the arithmetic questions as GRPO's prompts, the right number in an
`answer` column (for the `accuracy` reward). format_prompts: format_preference's questions and system turn as
GRPO's prompts for a real chat model, the same 50 held out.
"""

import argparse
import json
import os


# each task's writer in common.data.synthetic, imported only when a set is written (the import takes seconds; a make
# target that finds its data already there runs this script at every call)
WRITERS = {
    "markov": "write_markov_corpus",
    "sentiment": "write_sentiment_data",
    "arithmetic": "write_arithmetic_data",
    "preference": "write_preference_data",
    "format_preference": "write_format_preference_data",
    "prompts": "write_prompt_data",
    "format_prompts": "write_format_prompt_data",
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(WRITERS), default="markov")
    parser.add_argument("--out", default="outputs/data/markov")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    marker = os.path.join(args.out, "generated.json")
    wanted = {"task": args.task, "seed": args.seed}
    if os.path.exists(marker) and json.load(open(marker)) == wanted:
        print(f"demo data already in {args.out}")
        return
    from common.data import synthetic

    info = getattr(synthetic, WRITERS[args.task])(args.out, seed=args.seed)
    with open(marker, "w") as handle:
        json.dump(wanted, handle)
    floor = f": entropy floor {info['entropy_rate_nats']:.4f} nats/token" if info else ""
    print(f"wrote {args.task} data to {args.out}{floor}")


if __name__ == "__main__":
    main()
