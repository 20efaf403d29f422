"""The export in one process, without launching: what a LoRA run's export gathers, and what it writes.
(The exports of launched runs under every strategy are checked in test_strategies.py and test_recipes.py.)"""

import pytest
import torch
from conftest import assert_same_hf_folder

from common.models.lora import LoraArguments, apply_lora
from common.outputs.export import export_final, master_tensors


LLAMA = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def lora_model(classifier: bool, targets):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA, num_labels=2, pad_token_id=0)
    base = LlamaForSequenceClassification(config) if classifier else LlamaForCausalLM(config)
    model = apply_lora(base, LoraArguments(use_peft=True, lora_r=2, lora_target_modules=targets))
    for name, parameter in model.named_parameters():  # as if trained: LoRA's B starts at zero
        if parameter.requires_grad:
            parameter.data.normal_()
    return model


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)


# (sequence classifier, --lora_target_modules, what peft saves beside the adapters)
CASES = {
    "causal LM, peft's default targets": (False, None, []),
    "classifier: its new head is a module to save": (True, None, ["score.modules_to_save.default.weight"]),
    "embeddings targeted: peft saves them whole": (
        False,
        ["q_proj", "embed_tokens"],
        ["model.embed_tokens.base_layer.weight"],
    ),
}


@pytest.mark.parametrize("classifier,targets,besides", list(CASES.values()), ids=list(CASES))
def test_a_lora_export_gathers_only_what_peft_saves_and_writes_what_peft_writes(
    classifier, targets, besides, accelerator, tmp_path
):
    """The export gathers (one collective per tensor under ZeRO-3 and FSDP2) the tensors peft's
    save_pretrained keeps, not the base model it then drops; its folder equals peft's own save of
    the whole model."""
    from peft.utils import get_peft_model_state_dict

    model = accelerator.prepare(lora_model(classifier, targets))
    gathered = [name for name, _ in master_tensors(accelerator, model)]
    kept = get_peft_model_state_dict(model)  # peft's choice, from the whole state dict
    every = model.state_dict()
    adapters = [name for name in every if "lora_" in name]
    assert sorted(gathered) == sorted(adapters + [f"base_model.model.{name}" for name in besides])
    assert len(gathered) == len(kept) < len(every) / 2, (len(gathered), len(kept), len(every))

    export_final(accelerator, model, None, str(tmp_path), torch.float32)
    model.save_pretrained(tmp_path / "peft", safe_serialization=True)
    assert_same_hf_folder(tmp_path / "final", tmp_path / "peft", model_cards=False)  # peft's template card


def trained_lora_model(tmp_path, minilm, classifier: bool):
    """A LoRA model on a base model read from a folder, its adapters as if trained."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM

    if classifier:  # minilm's file names its tensors without the model's "bert." prefix
        base = AutoModelForSequenceClassification.from_pretrained(minilm, num_labels=2)
    else:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(tmp_path / "base")
        base = LlamaForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    model = apply_lora(base, LoraArguments(use_peft=True, lora_r=2, save_merged_model=True))
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data.normal_(std=0.05)
    return model


@pytest.mark.parametrize(
    "classifier,dtype",
    [(False, torch.bfloat16), (True, torch.float32)],
    ids=["causal LM in bf16", "classifier (its head a module to save) in fp32"],
)
def test_the_merged_export_reads_the_base_model_one_tensor_at_a_time(
    classifier, dtype, accelerator, minilm, tmp_path, monkeypatch
):
    """--save_merged_model merges the adapter into each base tensor as it reads it from the base
    model's files, never reloading the whole base model (at 101M parameters that added the fp32
    model, 386 MB, to the main process's whole-run peak), and writes what peft's merge of the
    reloaded base model writes."""
    from common.models.lora import save_merged

    model = accelerator.prepare(trained_lora_model(tmp_path, minilm, classifier))
    base_class = type(model.get_base_model())

    def reload_whole(*args, **kwargs):
        raise AssertionError(f"{base_class.__name__}.from_pretrained: the whole base model reloaded")

    with monkeypatch.context() as patched:
        patched.setattr(base_class, "from_pretrained", classmethod(reload_whole))
        export_final(accelerator, model, None, str(tmp_path), dtype, merge_adapter=True)
    save_merged(model, str(tmp_path / "final"), str(tmp_path / "whole"), None, dtype)
    assert_same_hf_folder(tmp_path / "final_merged", tmp_path / "whole", model_cards=False)
