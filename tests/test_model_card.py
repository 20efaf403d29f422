"""Every exported folder carries a model card (README.md) that huggingface_hub reads, its fields from run.json."""

import json

from conftest import export_checkpoint, pretrained_args, read_metrics, read_run, run_in_process
from huggingface_hub import ModelCard


def card_table(card: ModelCard) -> dict:
    """The card's `| key | value |` rows."""
    rows = [
        line.strip("|").split("|") for line in card.text.splitlines() if line.startswith("| ") and "---" not in line
    ]
    return {key.strip(): value.strip() for key, value in (row for row in rows if len(row) == 2)}


def test_the_adapter_the_merged_model_and_a_checkpoints_export_each_carry_a_card_from_run_json(
    markov_data, bf16_checkpoint, tmp_path, monkeypatch
):
    """LoRA on the bf16 checkpoint, one process in-process, accumulation 2, a checkpoint at step 4: final/
    (the adapter: peft's empty template replaced), final_merged/ and the checkpoint's export."""
    out = tmp_path / "run"
    run_in_process(
        "recipes/causal_lm.py",
        pretrained_args(
            markov_data,
            bf16_checkpoint,
            out,
            max_steps=4,
            gradient_accumulation_steps=2,
            save_steps=4,
            eval_steps=2,
            use_peft="true",
            save_merged_model="true",
            lora_r=4,
        ),
        monkeypatch,
    )
    run, (train, evaluations) = read_run(out), read_metrics(out)
    exported = export_checkpoint(out / "checkpoints/step_4", tmp_path / "step_4")
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
        assert "--use_peft true" in card.text and f"written by the run's `{what}` export" in card.text.lower()
        assert str(bf16_checkpoint) in card.text


def test_a_hub_base_model_and_dataset_go_to_the_metadata(tmp_path):
    from common.model_card import write_model_card

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
