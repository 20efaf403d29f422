"""Packed vs padded SFT batches, one process, same model, data and batches: label tokens/s
of full training steps (forward, backward, AdamW) for

  padded          one row per conversation, padded to the batch's longest
  packed-sdpa     one row per batch, transformers' dense block-diagonal mask
  packed-varlen   one row per batch, attention per conversation (common.data.packing)
  auto            what sft.py --packing does: packed-varlen, or padded for a batch whose padding
                  would waste at most 20% (common.data.packing.PackOrPad)

    make benchmark-packing ARGS="--steps 20 --batch_size 64"

on three kinds of chats (--data): `equal`, the SFT demo's arithmetic questions (nearly equal
lengths); `mixed`, with counting questions among them (answers of 1 to 12 tokens); and
`varied`, chats whose lengths spread as real ones do (20 to 400 tokens, uniformly). Each layout
trains its own copy of the model; the layouts take turns step by step (the order rotated each
step), so the machine's slow and fast moments are shared. Prints one row per layout and its
speed relative to padded (same run, same machine, same batches).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from datasets import Dataset, DatasetDict  # noqa: E402
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, DataCollatorWithFlattening  # noqa: E402

from common.data import packing  # noqa: E402
from common.data.chat import tokenize_sft  # noqa: E402
from common.data.synthetic import write_arithmetic_data, write_jsonl  # noqa: E402
from common.launch.internals import attention_implementation  # noqa: E402
from common.models.loading import load_model  # noqa: E402
from common.options.arguments import ModelArguments  # noqa: E402


class _OneProcess:
    from contextlib import nullcontext as main_process_first

    is_main_process = True

    def print(self, *args):
        pass


DATA = {
    "equal": "the SFT demo's arithmetic chats (nearly equal lengths)",
    "mixed": "arithmetic and counting chats (answers of 1 to 12 tokens)",
    "varied": "chats of 20 to 400 tokens (lengths spread as real chats' are)",
}


def varied_chats(count: int, seed: int) -> list[dict]:
    """Chats of the arithmetic tokenizer's words whose lengths spread uniformly over 20-400 tokens
    (a question of n words, an answer of about a quarter of that)."""
    rng = random.Random(seed)
    words = [str(n) for n in range(19)]
    chats = []
    for _ in range(count):
        total = rng.randint(20, 400) - 8  # the template's role tokens
        answer = max(1, total // 4)
        chats.append(
            {
                "messages": [
                    {"role": "user", "content": " ".join(rng.choice(words) for _ in range(total - answer))},
                    {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(answer))},
                ]
            }
        )
    return chats


def measure(kind: str, args) -> tuple[str, list]:
    """Each layout's label tokens/s on `kind` of chats: (the run's summary, table rows)."""
    data = tempfile.mkdtemp(prefix="packing-bench-")
    count = args.batch_size * (args.steps + args.warmup)
    write_arithmetic_data(data, train=count, validation=8, counting=kind == "mixed")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(data, "tokenizer"))
    if kind == "varied":
        write_jsonl(os.path.join(data, "train.jsonl"), varied_chats(count, seed=0))
    raw = DatasetDict(
        {split: Dataset.from_json(os.path.join(data, f"{split}.jsonl")) for split in ("train", "validation")}
    )
    examples = tokenize_sft(raw, tokenizer, "messages", 512, "drop", _OneProcess())[0]["train"]
    features = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
    batches = [
        features[i : i + args.batch_size] for i in range(0, len(features) - args.batch_size + 1, args.batch_size)
    ]
    padded = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    layouts = {
        "padded": (padded, False),
        "packed-sdpa": (DataCollatorWithFlattening(), False),
        "packed-varlen": (DataCollatorWithFlattening(), True),
        "auto": (packing.PackOrPad(padded), True),
    }

    model_args = ModelArguments(model_config=args.model_config, tokenizer_name_or_path=os.path.join(data, "tokenizer"))
    label_tokens = sum(sum(label != -100 for label in f["labels"]) for batch in batches[args.warmup :] for f in batch)
    summary = (
        f"{len(batches) - args.warmup} steps of {args.batch_size} conversations ({label_tokens} label tokens), "
        f"precision {args.precision}, {torch.get_num_threads()} threads"
    )
    print(f"{DATA[kind]}: {summary}")
    print(f"{'layout':<14} {'attention':<12} {'label tok/s':>11} {'vs padded':>9} {'final loss':>10}")
    runs = {}  # each layout's own model (the same initial weights), optimizer and attention
    for name, (collate, per_example) in layouts.items():
        model = load_model(model_args, tokenizer, seed=0, max_position_embeddings=512)
        attention = packing.use_per_example_attention(model) if per_example else attention_implementation(model)
        runs[name] = (collate, model, torch.optim.AdamW(model.parameters(), lr=1e-3), attention)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    seconds, losses, names = dict.fromkeys(layouts, 0.0), {}, list(layouts)
    for index, batch in enumerate(batches):  # interleaved: every layout takes each step, in rotated order
        for name in names[index % len(names) :] + names[: index % len(names)]:
            collate, model, optimizer, _ = runs[name]
            started = time.perf_counter()
            inputs = collate(batch)
            with autocast:
                loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if index >= args.warmup:
                seconds[name] += time.perf_counter() - started
            losses[name] = loss.item()
    rates = {name: label_tokens / seconds[name] for name in names}
    rows = []
    for name in names:
        attention, ratio = runs[name][3], rates[name] / rates["padded"]
        print(f"{name:<14} {attention:<12} {rates[name]:>11.0f} {ratio:>8.2f}x {losses[name]:>10.4f}")
        rows.append([name, attention, f"{rates[name]:.0f}", f"{ratio:.2f}x", f"{losses[name]:.4f}"])
    return summary, rows


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--model_config", default="recipes/configs/tiny_llama.json")
    parser.add_argument("--precision", choices=["bf16", "no"], default="bf16")
    parser.add_argument("--data", nargs="+", choices=list(DATA), default=list(DATA))
    parser.add_argument(
        "--docs", help="also write the table to this markdown page (make benchmark-packing: docs/benchmark-packing.md)"
    )
    args = parser.parse_args(argv)

    tables = [(kind, *measure(kind, args)) for kind in args.data]
    if args.docs:
        from figures import markdown_table, write_page

        write_page(
            args.docs,
            "SFT packing: packed vs padded batches",
            "\n\n".join(
                [
                    "One process, the demo's tiny Llama from its config (positions up to 512). Label tokens/s of whole "
                    "training steps (forward, backward, AdamW), each layout on the same batches, in one run, the layouts "
                    "interleaved step by step."
                ]
                + [
                    f"**{DATA[kind]}**: {summary}.\n\n"
                    + markdown_table(["layout", "attention", "label tokens/s", "vs padded", "final loss"], rows)
                    for kind, summary, rows in tables
                ]
            ),
        )


if __name__ == "__main__":
    main()
