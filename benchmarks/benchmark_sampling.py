"""GRPO's sampling, one group at a time (as a rollout sampled before) against all of a rank's groups in one decoding
call (as it samples now, common.objectives.rollout.sample_rows), on the real chat model in one process: the same
prompts and uniforms both ways, rounds interleaved; the median seconds of each, their ratio, and how many completions
differ (allowed only at a draw counted as a near tie: the batch's shape changes the logits by rounding).

    python benchmarks/benchmark_sampling.py --groups 1 4 --num_generations 8 --max_completion_length 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import markdown_table, write_page  # noqa: E402


QUESTIONS = [
    "What is 7 plus 8?",
    "Name a colour of the sky at noon.",
    "How many legs does a spider have? Answer with a number.",
    "Write one word that rhymes with cat.",
    "What is the capital of France?",
    "Count from one to five.",
    "Which is larger, 12 or 21?",
    "Say hello in French.",
]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(REPO, "outputs/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 4], help="prompt groups a rank samples")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--docs", help="write the table to this markdown page")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.model):
        sys.exit(f"error: --model {args.model} is not a model folder; run `make real-model` or pass one")

    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.objectives.rollout import SamplingSettings, row_seed, sample_group, sample_rows, stop_token_ids

    torch.set_num_threads(1)  # a rank's share of a 2-core host, as a 2-process launch has it
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    accelerator = Accelerator(cpu=True)
    settings = SamplingSettings(
        args.temperature, 1.0, args.max_completion_length, stop_token_ids(tokenizer, model), tokenizer.pad_token_id
    )
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        ).input_ids
        for q in QUESTIONS
    ]
    rows, results = [], {}
    for count in args.groups:
        groups = []
        for index in range(count):
            generator = torch.Generator().manual_seed(row_seed(0, 0, index))
            uniforms = torch.rand(
                args.num_generations, args.max_completion_length, generator=generator, dtype=torch.float64
            )
            groups.append((prompts[index % len(prompts)], uniforms))

        def each():
            return [sample_group(model, p, u, settings, accelerator) for p, u in groups]

        def together():
            flat = [p for p, u in groups for _ in range(len(u))]
            return sample_rows(model, flat, torch.cat([u for _, u in groups]), settings, accelerator)

        seconds = {"each": [], "together": []}
        each(), together()  # warm-up
        for _ in range(args.rounds):
            for name, sample in (("each", each), ("together", together)):
                started = time.perf_counter()
                out = sample()
                seconds[name].append(time.perf_counter() - started)
                if name == "each":
                    one_by_one = [c for completions, _, _ in out for c in completions]
                    ties_each = torch.cat([t for _, _, t in out])
                else:
                    batched, _, ties_together = out
        differing = [i for i, (a, b) in enumerate(zip(one_by_one, batched)) if a != b]
        unexplained = [i for i in differing if not (ties_each[i] or ties_together[i])]
        tokens = sum(len(c) for c in batched)
        each_s, together_s = statistics.median(seconds["each"]), statistics.median(seconds["together"])
        results[count] = {"each_s": each_s, "together_s": together_s, "differing": len(differing)}
        rows.append(
            [
                str(count),
                str(count * args.num_generations),
                str(tokens),
                f"{each_s * 1000:.0f}",
                f"{together_s * 1000:.0f}",
                f"{each_s / together_s:.2f}x",
                f"{len(differing)} ({len(unexplained)} without a near tie)",
            ]
        )
        if unexplained:
            sys.exit(f"error: {len(unexplained)} completions differ without a near tie at {count} groups")
    text = markdown_table(
        [
            "groups a rank",
            "completions",
            "tokens",
            "a group at a time (ms)",
            "one call (ms)",
            "speed-up",
            "completions differing",
        ],
        rows,
    ) + (
        f"\n\nMedians of {args.rounds} interleaved rounds in one process on one thread (a rank's share of a 2-core "
        f"host), {os.path.basename(args.model)} in fp32, G = {args.num_generations}, up to "
        f"{args.max_completion_length} tokens at temperature {args.temperature}; both ways draw each row's tokens "
        "from the same seeded uniforms (a difference is allowed only at a draw within 1e-4 of a CDF boundary).\n"
    )
    print(text)
    if args.docs:
        write_page(args.docs, "GRPO's sampling: one decoding call a rank", text)
    return results


if __name__ == "__main__":
    main()
