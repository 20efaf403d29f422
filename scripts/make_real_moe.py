"""A real mixture-of-experts chat model, upcycled from the real dense one: SmolLM2-135M-Instruct's MLPs copied into
the experts of a Mixtral model (common/models/upcycle.py), its routers new, every other tensor the dense model's.

Its logits at step 0 equal the dense model's (each token's experts are copies of one MLP, their weights sum to 1):
the script reloads the saved folder and prints the largest gap over a few chat prompts, and refuses to keep a
folder whose gap is not at float precision. Saved once in bf16, as the dense folder is; a second call prints its
path and does nothing else.

    make real-moe          # outputs/models/SmolLM2-135M-Instruct-MoE: 4 experts per layer, 2 per token
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DENSE = os.path.join("outputs", "models", "SmolLM2-135M-Instruct")
DEFAULT = os.path.join("outputs", "models", "SmolLM2-135M-Instruct-MoE")
PROMPTS = ("what is 7 plus 8 ?", "Name a colour of the sky.", "Write one short sentence about rivers.")
TOLERANCE = 1e-3  # of the logits' scale: fp32's sums in another order, never a different function


def step0_gap(dense_model, folder: str, tokenizer) -> tuple[float, float, int]:
    """(largest |logit gap|, largest |logit|, tokens) between the dense model and the saved MoE, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    gap = scale = 0.0
    tokens = 0
    with torch.no_grad():
        for chat in chats:
            ids = tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            ids = ids["input_ids"]
            theirs, mine = dense_model(input_ids=ids).logits, moe(input_ids=ids).logits
            gap, scale = max(gap, (theirs - mine).abs().max().item()), max(scale, theirs.abs().max().item())
            tokens += ids.numel()
    return gap, scale, tokens


def make(dense: str, out: str, num_experts: int, experts_per_token: int, seed: int) -> str:
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    if not os.path.isfile(os.path.join(dense, "config.json")):
        raise SystemExit(f"error: --model {dense} holds no model; run `make real-model` first (make real-moe does)")
    print(
        f"making {out}: {dense}'s MLPs copied into {num_experts} experts per layer ({experts_per_token} per token), "
        "saved in bf16 (once, about a minute; later calls reuse the folder)",
        file=sys.stderr,
        flush=True,
    )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.launch.errors import UsageError
    from common.models.upcycle import upcycle

    tokenizer = AutoTokenizer.from_pretrained(dense)
    dense_model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    try:
        moe = upcycle(dense_model, num_experts, experts_per_token, seed)
    except UsageError as error:
        raise SystemExit(f"error: {error}") from None
    tmp = f"{out}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    moe.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    gap, scale, tokens = step0_gap(dense_model, tmp, tokenizer)
    print(
        f"step-0 logits of the upcycled model against the dense one: max gap {gap:.2e} (logits up to {scale:.1f}) "
        f"over {tokens} tokens of {len(PROMPTS)} chat prompts",
        flush=True,
    )
    if gap > TOLERANCE * scale:
        shutil.rmtree(tmp)
        raise SystemExit(f"error: the upcycled model's logits differ from the dense model's by {gap:.2e}; not kept")
    os.replace(tmp, out)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DENSE, help="the dense Llama-family folder (make real-model's)")
    parser.add_argument("--out", default=DEFAULT)
    parser.add_argument("--num_experts", type=int, default=4)
    parser.add_argument("--experts_per_token", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the routers' initialisation")
    args = parser.parse_args(argv)
    print(make(args.model, args.out, args.num_experts, args.experts_per_token, args.seed))


if __name__ == "__main__":
    sys.exit(main())
