"""A training checkpoint, from any strategy, as a Hugging Face folder, without launching.

Give it a run's checkpoints/step_N folder: DDP's or one process's model.safetensors,
FSDP2's sharded DCP files (any number of ranks) or DeepSpeed ZeRO-1/2/3 partitions.
It reads the weights in one CPU process (the fp32 master weights where DeepSpeed keeps
them apart from the model), builds the model from the config the checkpoint carries
(in `model_files/`, on the meta device: no memory for weights twice) and writes what the
run's own `final/` export writes: safetensors in the export dtype, config, generation
config and tokenizer; a LoRA run's adapter only. Given the last checkpoint, the folder
equals `final/`.

    python scripts/export_checkpoint.py --checkpoint outputs/causal_lm_demo/checkpoints/step_200
    make export-checkpoint CHECKPOINT=outputs/causal_lm_demo/checkpoints/step_200 OUT=outputs/step_200

The folder goes to --output_dir (default: exported/step_N beside the run's checkpoints/);
one that exists is left as it is and the export refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from common.launch.errors import UsageError, exits_on_usage_error
from common.launch.internals import set_base_model_name
from common.outputs.export import read_checkpoint_weights, tensors_written, write_hf_folder
from common.outputs.model_card import write_model_card
from common.outputs.run_dir import ABANDONED, MODEL_FILES, STATE_FILE, write_folder


MODEL_CONFIGS = ("config.json", "generation_config.json", "adapter_config.json")


def build_model(model_files: str):
    """The model the checkpoint's weights belong to, with meta parameters (peft-wrapped for
    a LoRA run), and the dtype its export is written in."""
    import torch
    import transformers
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_files)
    architecture = (config.architectures or [None])[0]
    model_class = getattr(transformers, architecture or "", None)
    if model_class is None:
        raise UsageError(
            f"{model_files}/config.json names architecture {architecture!r}, which this "
            f"transformers ({transformers.__version__}) does not have; export with the versions the run used"
        )
    with torch.device("meta"):
        model = model_class(config)
    if os.path.isfile(os.path.join(model_files, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(model_files)
    if os.path.isfile(os.path.join(model_files, "adapter_config.json")):
        from peft import PeftConfig, get_peft_model

        adapter = PeftConfig.from_pretrained(model_files)
        # the adapter config and model card name the run's base model, as in its final/ export
        set_base_model_name(model, adapter.base_model_name_or_path)
        model = get_peft_model(model, adapter)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype or "float32")
    return model, dtype


def load_weights(model, state_dict: dict) -> None:
    """Put the checkpoint's tensors in place of the meta parameters; every one must be there
    (tied weights share one tensor and may be saved once)."""
    result = model.load_state_dict(state_dict, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    missing = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if missing or result.unexpected_keys:
        raise UsageError(
            f"the checkpoint's weights do not fit its model_files/config.json (missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}); the checkpoint is damaged or its folder mixed up"
        )


@exits_on_usage_error
def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a run's checkpoints/step_N folder")
    parser.add_argument("--output_dir", help="where the Hugging Face folder goes (must not exist)")
    args = parser.parse_args(argv)
    checkpoint = os.path.normpath(args.checkpoint)
    if not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
        raise UsageError(
            f"--checkpoint {checkpoint} is not a complete checkpoint (no {STATE_FILE}); pass a "
            "checkpoints/step_N folder of a run"
        )
    model_files = os.path.join(checkpoint, MODEL_FILES)
    if not os.path.isfile(os.path.join(model_files, "config.json")):
        raise UsageError(
            f"--checkpoint {checkpoint} has no {MODEL_FILES}/config.json (written by this project's "
            "save_checkpoint since export_checkpoint exists); resume the run from it with "
            "--resume_from_checkpoint and save again, or export the run's final/ instead"
        )
    parent, name = os.path.dirname(checkpoint), os.path.basename(checkpoint)
    logged_until = None  # metrics.jsonl's rows after it are not this checkpoint's history
    if os.path.basename(parent).startswith(ABANDONED):  # a continuation a resume set aside: exported/<that>/step_N
        logged_until = int(os.path.basename(parent)[len(ABANDONED) :].split("_")[0])  # abandoned_after_step_N[_k]
        parent, name = os.path.dirname(parent), os.path.join(os.path.basename(parent), name)
    run_dir = os.path.dirname(parent)
    output_dir = args.output_dir or os.path.join(run_dir, "exported", name)
    if os.path.exists(output_dir):
        raise UsageError(
            f"--output_dir {output_dir} already exists; it is left as it is: remove it or pass another --output_dir"
        )

    with open(os.path.join(checkpoint, STATE_FILE)) as handle:
        try:
            step = int(json.load(handle)["step"])
        except (ValueError, KeyError, TypeError) as error:
            raise UsageError(
                f"--checkpoint {checkpoint}: its {STATE_FILE} is damaged ({type(error).__name__}: {error}); "
                "export another checkpoint of the run"
            )
    model, dtype = build_model(model_files)
    load_weights(model, read_checkpoint_weights(checkpoint))

    def write(folder):
        write_hf_folder(model, model.state_dict(), None, dtype, folder)
        for name in sorted(set(os.listdir(model_files)) - set(MODEL_CONFIGS)):  # the run's tokenizer files
            shutil.copy2(os.path.join(model_files, name), folder)
        write_model_card(folder, run_dir, os.path.basename(checkpoint), step=step, logged_until=logged_until)

    os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)
    write_folder(output_dir, write)
    what = ", the LoRA adapter's" if hasattr(model, "peft_config") else ""
    print(
        f"step {step} of {run_dir} ({tensors_written(output_dir)} tensors{what}) exported in "
        f"{str(dtype).replace('torch.', '')} to {output_dir}"
    )
    return output_dir


if __name__ == "__main__":
    main()
