"""Every exported folder carries a model card (README.md) that huggingface_hub reads, its fields from run.json."""

import json
import re
import shutil

from conftest import causal_lm_args, export_checkpoint, pretrained_args, read_metrics, read_run, run_in_process
from huggingface_hub import ModelCard


def card_table(card: ModelCard) -> dict:
    """The card's `| key | value |` rows."""
    rows = [
        line.strip("|").split("|") for line in card.text.splitlines() if line.startswith("| ") and "---" not in line
    ]
    return {key.strip(): value.strip() for key, value in (row for row in rows if len(row) == 2)}


def test_the_adapter_the_merged_model_and_a_checkpoints_export_each_carry_a_card_from_run_json(
    markov_data, bf16_checkpoint, tmp_path, monkeypatch, capsys
):
    """LoRA on the bf16 checkpoint, one process in-process, accumulation 2, checkpoints at steps 2 and 4: final/
    (the adapter: peft's empty template replaced), final_merged/ and the checkpoints' exports. Issue 54, item 6:
    step_2's card is step 2's (its rows, its trained steps), not the run's last; item 13: the export's line counts
    the tensors it wrote (the adapter's), not the checkpoint's."""
    out = tmp_path / "run"
    run_in_process(
        "recipes/causal_lm.py",
        pretrained_args(
            markov_data,
            bf16_checkpoint,
            out,
            max_steps=4,
            gradient_accumulation_steps=2,
            save_steps=2,
            eval_steps=2,
            use_peft="true",
            save_merged_model="true",
            lora_r=4,
        ),
        monkeypatch,
    )
    run, (train, evaluations) = read_run(out), read_metrics(out)
    capsys.readouterr()
    exported = export_checkpoint(out / "checkpoints/step_4", tmp_path / "step_4")
    from safetensors import safe_open

    with safe_open(str(exported / "adapter_model.safetensors"), "pt") as handle:
        written = len(list(handle.keys()))
    assert f"({written} tensors, the LoRA adapter's)" in capsys.readouterr().out  # was the checkpoint's: 29
    for folder, library, what in (
        (out / "final", "peft", "final"),
        (out / "final_merged", "transformers", "final_merged"),
        (exported, "peft", "step_4"),
    ):
        card = ModelCard.load(folder / "README.md")
        assert "Model Card for Model ID" not in card.text  # peft's template
        assert card.data.library_name == library and card.data.base_model is None  # a local folder, not a Hub id
        assert {"accelerate-recipes", "causal_lm", run["launched_strategy"], "lora"} <= set(card.data.tags)
        table = card_table(card)
        assert table["learning_rate"] == str(run["args"]["learning_rate"]) and table["lora_r"] == "4"
        assert table["processes"] == str(run["participating_processes"]) and table["recipe"] == "recipes/causal_lm.py"
        assert table["gradient_accumulation_steps"] == "2" and table["train file"] == run["args"]["train_file"]
        assert float(table["eval at step 4: eval_loss"]) == round(evaluations[-1]["eval_loss"], 4)
        assert float(table["train loss at step 4"]) == round(train[-1]["loss"], 4)
        assert table["trained steps"] == "4"
        assert "--use_peft true" in card.text and f"written by the run's `{what}` export" in card.text.lower()
        assert str(bf16_checkpoint) in card.text

    card = ModelCard.load(export_checkpoint(out / "checkpoints/step_2", tmp_path / "step_2") / "README.md")
    table = card_table(card)
    assert table["trained steps"] == "2" and table["max_steps"] == "4"  # what the folder holds; what the run planned
    assert float(table["eval at step 2: eval_loss"]) == round(evaluations[0]["eval_loss"], 4)
    assert float(table["train loss at step 2"]) == round(train[1]["loss"], 4)
    assert not any("step 4" in key for key in table), table
    assert table["lora_r"] == "4" and "written by the run's `step_2` export" in card.text.lower()

    # a checkpoint a resume set aside (here: as if the run had resumed from step 2): the rows after step 2 in
    # metrics.jsonl are the new continuation's, not this folder's history
    aside = out / "checkpoints/abandoned_after_step_2"
    aside.mkdir()
    shutil.move(out / "checkpoints/step_4", aside / "step_4")
    table = card_table(ModelCard.load(export_checkpoint(aside / "step_4", tmp_path / "aside_4") / "README.md"))
    assert table["trained steps"] == "4" and "train loss at step 2" in table
    assert not any("step 4" in key for key in table), table


def card_of(run_dir, data, overrides: dict, rows: list, what: str = "final", **step) -> dict:
    """The card table write_model_card writes for a run whose arguments are causal_lm_args with `overrides`,
    parsed as causal_lm.py parses them (every field, defaults included, as run.json holds them), and whose
    metrics.jsonl is `rows`."""
    from common.models.lora import LoraArguments
    from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
    from common.options.parsing import _parse, to_dict
    from common.outputs.model_card import write_model_card

    argv = causal_lm_args(data, run_dir, **overrides)
    args = to_dict(*_parse((ModelArguments, DataArguments, LoraArguments, TrainingArguments), argv))
    run = {"args": args, "command": ["recipes/causal_lm.py", *argv], "max_steps": args["max_steps"]}
    folder = run_dir / what
    folder.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps(run))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    write_model_card(str(folder), str(run_dir), what, **step)
    return card_table(ModelCard.load(folder / "README.md"))


def test_lora_fields_only_where_lora_was_used_and_trained_steps_are_the_folders(markov_data, tmp_path):
    """Issue 54, item 6: a run without --use_peft has lora_r/alpha/dropout in run.json (their defaults) but its
    card lists none of them; with --use_peft it does. A run that ended before --max_steps (early stopping) has
    trained the steps it logged last, and a checkpoint's card counts its own step."""
    rows = [{"step": s, "loss": 3.0 - s / 10} for s in (1, 2, 3)] + [{"step": 3, "eval_loss": 2.5}]
    plain = card_of(tmp_path / "plain", markov_data, {"max_steps": 6}, rows)
    assert not [key for key in plain if key.startswith("lora")], plain
    assert plain["trained steps"] == "3" and plain["max_steps"] == "6"
    lora = card_of(tmp_path / "lora", markov_data, {"use_peft": "true", "lora_r": 4, "max_steps": 6}, rows)
    assert lora["lora_r"] == "4" and lora["lora_alpha"] == "16" and lora["lora_dropout"] == "0.0"
    early = card_of(tmp_path / "step", markov_data, {"max_steps": 6}, rows, what="step_2", step=2)
    assert early["trained steps"] == "2" and "train loss at step 2" in early
    assert not re.search(r"step 3", " ".join(early)), early


def test_a_hub_base_model_and_dataset_go_to_the_metadata(tmp_path):
    from common.outputs.model_card import write_model_card

    run = {
        "args": {
            "model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "dataset_name": "org/chats",
            "learning_rate": 2e-5,
        },
        "command": ["recipes/sft.py", "--learning_rate", "2e-5"],
        "launched_strategy": "deepspeed",
        "participating_processes": 8,
        "zero_stage": 3,
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "final").mkdir()
    write_model_card(str(tmp_path / "final"), str(tmp_path), "final")
    card = ModelCard.load(tmp_path / "final/README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.datasets == ["org/chats"]
    assert {"sft", "deepspeed"} <= set(card.data.tags) and card_table(card)["ZeRO stage"] == "3"
    assert "No evaluation was logged." in card.text
