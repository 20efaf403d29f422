"""A trained LoRA adapter as the start of a run: --adapter_name_or_path X with --use_peft trains X on
(DPO's reference is base + X, frozen), without --use_peft it is refused in one line, and a LoRA run's
final/ (an adapter folder) given as --model_name_or_path loads as its base plus the adapter, as
transformers loads such a folder where peft is installed. All in-process: no launch."""

import json
import shutil

import pytest
import torch
from conftest import load_script, pretrained_args, read_run, run_in_process


@pytest.fixture(scope="module")
def adapter(bf16_checkpoint, tmp_path_factory):
    """A LoRA adapter on the bf16 checkpoint whose B matrices are not zero (as after training), saved
    with the tokenizer as a --use_peft run's final/ is."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("adapter") / "final"
    base = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out)
    AutoTokenizer.from_pretrained(bf16_checkpoint).save_pretrained(out)
    return out


def base_plus(bf16_checkpoint, adapter, is_trainable=False):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter, is_trainable=is_trainable)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=torch.arange(3, 19).reshape(2, 8)).logits


def trainable(model) -> set:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_an_adapter_with_use_peft_trains_on_from_its_own_weights(bf16_checkpoint, adapter, recwarn):
    """The policy is base + X with X's parameters the trainable ones, as PeftModel.from_pretrained(...,
    is_trainable=True) makes it; it was base + a fresh adapter on top (peft's "modify a model with PEFT
    for a second time"), X dropped."""
    from common.models.loading import load_model, load_tokenizer
    from common.models.lora import LoraArguments, apply_lora
    from common.options.arguments import ModelArguments

    args = ModelArguments(model_name_or_path=str(bf16_checkpoint), adapter_name_or_path=str(adapter))
    model = apply_lora(load_model(args, load_tokenizer(args), seed=0), LoraArguments(use_peft=True))
    expected = base_plus(bf16_checkpoint, adapter, is_trainable=True)
    assert trainable(model) == trainable(expected) and trainable(model)
    assert torch.allclose(logits(model), logits(expected), atol=1e-6)
    assert not [w for w in recwarn if "second time" in str(w.message)]
    # final/'s adapter_config.json names the base it was trained on (a --use_peft run's would)
    assert model.peft_config["default"].base_model_name_or_path == str(bf16_checkpoint)
    assert model.peft_config["default"].inference_mode is False


def test_an_adapter_given_other_lora_shapes_is_refused_in_one_line(bf16_checkpoint, adapter):
    from common.launch.errors import UsageError
    from common.models.loading import load_model, load_tokenizer
    from common.models.lora import LoraArguments, apply_lora
    from common.options.arguments import ModelArguments

    args = ModelArguments(model_name_or_path=str(bf16_checkpoint), adapter_name_or_path=str(adapter))
    model = load_model(args, load_tokenizer(args), seed=0)
    with pytest.raises(UsageError, match=r"--lora_r 16 .* adapter .* has r 4") as refused:
        apply_lora(model, LoraArguments(use_peft=True, lora_r=16))
    assert "\n" not in str(refused.value)


def test_dpo_with_an_adapter_scores_the_reference_as_base_plus_the_adapter(bf16_checkpoint, adapter, tmp_path):
    """DPO after a LoRA SFT: the reference is base + X, frozen (it was the policy with its adapters
    off: the bare base)."""
    from common.models.loading import load_tokenizer
    from common.objectives.reference import build_reference
    from common.options.arguments import ModelArguments, TrainingArguments

    args = ModelArguments(model_name_or_path=str(bf16_checkpoint), adapter_name_or_path=str(adapter))
    reference = build_reference(
        args, load_tokenizer(args), TrainingArguments(output_dir=str(tmp_path)), use_peft=True, precompute=False
    )
    assert reference.kind == "model"
    assert not trainable(reference.model)
    assert torch.allclose(logits(reference.model), logits(base_plus(bf16_checkpoint, adapter)), atol=1e-6)


def test_an_adapter_without_use_peft_is_refused_in_one_line_before_anything_is_written(
    markov_data, bf16_checkpoint, adapter, tmp_path, monkeypatch
):
    """It ended in a traceback after the data and the model loaded ("optimizer got an empty parameter list")."""
    from common.launch.errors import UsageError

    out = tmp_path / "run"
    argv = pretrained_args(markov_data, bf16_checkpoint, out, max_steps=2) + ["--adapter_name_or_path", adapter]
    with pytest.raises(UsageError, match=r"--adapter_name_or_path .* trains only with --use_peft") as refused:
        run_in_process("recipes/causal_lm.py", argv, monkeypatch)
    assert "\n" not in str(refused.value) and "final_merged" in str(refused.value)
    assert not out.exists()


def test_a_lora_runs_final_as_model_name_or_path_continues_base_plus_adapter(
    markov_data, bf16_checkpoint, adapter, tmp_path, monkeypatch
):
    """The README's DPO row after a LoRA SFT, shown on causal_lm.py: final/ holds an adapter, not a model
    (it was "no model config loads from .../final (ValueError: Unrecognized model ...)")."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    argv = pretrained_args(markov_data, adapter, out, max_steps=2, warmup_steps=0, learning_rate=1e-4)
    run_in_process("recipes/causal_lm.py", argv + ["--use_peft"], monkeypatch)
    args = read_run(out)["args"]
    assert (args["model_name_or_path"], args["adapter_name_or_path"]) == (str(bf16_checkpoint), str(adapter))
    # the record and the card say the shape that trained (the adapter's r 4, alpha 8), not the flags' defaults
    assert (args["lora_r"], args["lora_alpha"]) == (4, 8)
    card = (out / "final" / "README.md").read_text()
    assert "| lora_r | 4 |" in card and f"with the LoRA adapter `{adapter}`, trained on from its weights" in card
    saved = json.loads((out / "final" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(bf16_checkpoint) and saved["r"] == 4
    before, after = (
        load_file(adapter / "adapter_model.safetensors"),
        load_file(out / "final" / "adapter_model.safetensors"),
    )
    assert before.keys() == after.keys()
    # trained on from X: two small steps moved it a little (a fresh adapter's B would be near zero)
    for key in before:
        assert 0 < (after[key] - before[key]).abs().max() < 0.05 * before[key].abs().max(), key


def test_a_lora_runs_final_as_model_without_use_peft_names_final_merged_in_one_line(
    markov_data, adapter, tmp_path, monkeypatch
):
    from common.launch.errors import UsageError

    out = tmp_path / "run"
    with pytest.raises(UsageError, match=r"final_merged.*--adapter_name_or_path|--adapter_name_or_path.*final_merged"):
        run_in_process("recipes/causal_lm.py", pretrained_args(markov_data, adapter, out, max_steps=2), monkeypatch)
    assert not out.exists()


@pytest.fixture
def baseless(adapter, tmp_path):
    """An adapter folder whose adapter_config.json names no base (base_model_name_or_path null)."""
    folder = tmp_path / "baseless"
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    return folder


def test_an_adapter_folder_naming_no_base_is_one_line(baseless):
    from common.launch.errors import UsageError
    from common.models.loading import load_model, load_tokenizer
    from common.options.arguments import ModelArguments

    args = ModelArguments(model_name_or_path=str(baseless))
    with pytest.raises(UsageError, match=r"names no base model .* --adapter_name_or_path"):
        load_model(args, load_tokenizer(args), seed=0)


def test_ask_on_an_adapter_folder_naming_no_base_is_one_line(baseless, bf16_checkpoint, monkeypatch, capsys):
    """It tried the Hub for a model named "None" and ended in a traceback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ask = load_script("scripts/ask.py")
    with pytest.raises(SystemExit) as stopped:
        ask.main(["--model_name_or_path", str(baseless), "--question", "what is 1 plus 2 ?"])
    message = str(stopped.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert "--adapter_name_or_path" in message and "base_model_name_or_path" in message


def test_an_adapter_continued_with_its_own_target_modules_in_any_spelling_trains_and_another_is_one_short_line(
    bf16_checkpoint, tmp_path
):
    """peft saves all-linear as the full path of every module it adapted: the spelling the adapter was trained
    with (all-linear), and the same modules named, continue it; other modules are refused in one short line that
    names the kinds adapted, not each module."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from common.launch.errors import UsageError
    from common.models.loading import load_model, load_tokenizer
    from common.models.lora import LoraArguments, apply_lora
    from common.options.arguments import ModelArguments

    adapter = tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).save_pretrained(adapter)
    args = ModelArguments(model_name_or_path=str(bf16_checkpoint), adapter_name_or_path=str(adapter))
    every = ["all-linear"], "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj".split()
    for targets in every:
        model = apply_lora(
            load_model(args, load_tokenizer(args), seed=0), LoraArguments(True, lora_target_modules=targets)
        )
        assert trainable(model) and all("lora_" in name for name in trainable(model)), targets
    with pytest.raises(
        UsageError, match=r"--lora_target_modules q_proj v_proj .* adapts \d+ modules \(down_proj, "
    ) as no:
        apply_lora(
            load_model(args, load_tokenizer(args), seed=0),
            LoraArguments(True, lora_target_modules=["q_proj", "v_proj"]),
        )
    assert "\n" not in str(no.value) and len(str(no.value)) < 300, str(no.value)


def test_a_classifiers_adapter_counts_its_head_trained_whole_apart_from_the_adapted_modules(bf16_checkpoint, tmp_path):
    """A reward model's or classifier's adapter (task SEQ_CLS) trains its `score` head whole (peft's modules_to_save):
    the head's copies are not modules all-linear adapts, so the adapter continues with the spelling it was made
    with."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForSequenceClassification

    from common.models.lora import modules_named

    def classifier():
        return AutoModelForSequenceClassification.from_pretrained(bf16_checkpoint, num_labels=1, dtype=torch.float32)

    config = LoraConfig(r=4, lora_alpha=8, task_type="SEQ_CLS", target_modules="all-linear")
    get_peft_model(classifier(), config).save_pretrained(tmp_path / "adapter")
    model = PeftModel.from_pretrained(classifier(), tmp_path / "adapter", is_trainable=True)
    base = model.get_base_model()
    adapted = {name for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    assert adapted and "score" not in adapted
    assert modules_named(base, ["all-linear"]) == adapted
