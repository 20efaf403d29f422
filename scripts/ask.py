"""Ask a saved chat model a question: its own chat template, a greedy answer, printed.

Loads any Hugging Face folder a run exported, the way a user would after training: a full
model (final/, final_merged/), or a LoRA adapter's folder (--use_peft's final/: the base model
it names, with the adapter), or a base model with --adapter_name_or_path.

    python scripts/ask.py --model_name_or_path outputs/sft_chat_demo/final --question "what is 12 plus 5 ?"
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common  # noqa: F401  (keeps torchao's import-time noise off the answer's output)
from common.launch.errors import UsageError
from common.models.loading import adapter_base_model, is_adapter_folder


def answer(
    model_path: str, question: str, max_new_tokens: int = 32, adapter: str | None = None, system: str | None = None
) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if is_adapter_folder(model_path):  # an adapter: on the base it names
        from peft import AutoPeftModelForCausalLM

        try:
            adapter_base_model(model_path)  # one that names none would be looked for on the Hub as "None"
        except UsageError as error:
            raise SystemExit(f"error: {error}") from None
        model = AutoPeftModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    if not tokenizer.chat_template:
        raise SystemExit(
            f"error: the tokenizer in {model_path} has no chat template; ask a chat model, or train one "
            "with recipes/sft.py --chat_template FILE"
        )
    turns = [{"role": "system", "content": system}] if system else []
    inputs = tokenizer.apply_chat_template(
        turns + [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--adapter_name_or_path", default=None)
    parser.add_argument("--question", required=True)
    parser.add_argument("--system", default=None, help="A system turn before the question (else the template's own).")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    args = parser.parse_args(argv)
    print(f"Q: {args.question}")
    reply = answer(args.model_name_or_path, args.question, args.max_new_tokens, args.adapter_name_or_path, args.system)
    print(f"A: {reply}")


if __name__ == "__main__":
    sys.exit(main())
