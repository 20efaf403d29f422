"""Optimizer groups, schedule scaling and checkpoint bookkeeping, without launching anything."""

import os

import pytest

from common.arguments import TrainingArguments, UsageError
from common.checkpoints import check_output_dir, list_checkpoints, resolve_checkpoint
from common.training import create_optimizer, create_scheduler, total_training_steps


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def test_weight_decay_skips_norms_and_biases():
    model = tiny_llama()
    optimizer = create_optimizer(model, TrainingArguments(weight_decay=0.1))
    decayed, plain = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all("norm" in names[id(p)] for p in plain["params"])
    assert all("norm" not in names[id(p)] for p in decayed["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_schedule_horizon_counts_accelerates_per_process_steps():
    args = TrainingArguments(warmup_steps=2, lr_scheduler_type="linear", learning_rate=1.0)
    optimizer = create_optimizer(tiny_llama(), args)
    scheduler = create_scheduler(optimizer, args, max_steps=10, num_processes=2)
    lrs = []
    for _ in range(10):  # accelerate's prepared scheduler steps num_processes times per optimizer step
        optimizer.step()
        scheduler.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs[:2] == pytest.approx([0.5, 1.0]) and lrs[-1] == pytest.approx(0.0)  # warmup is 2 optimizer steps
    assert total_training_steps(TrainingArguments(num_train_epochs=3, gradient_accumulation_steps=2), 10) == 15
    assert total_training_steps(TrainingArguments(num_train_epochs=3, gradient_accumulation_steps=3), 10) == 9
    with pytest.raises(UsageError, match="fewer than gradient_accumulation_steps=4"):
        total_training_steps(TrainingArguments(gradient_accumulation_steps=4), 3)
    assert total_training_steps(TrainingArguments(max_steps=7), 10) == 7


def test_latest_checkpoint_ignores_unfinished_saves(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_2", "step_10", "tmp-step_12"):  # tmp-: a save that crashed before its rename
        (root / name).mkdir(parents=True)
        (root / name / "trainer_state.json").write_text("{}")
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["step_2", "step_10"]
    assert resolve_checkpoint(str(tmp_path), "latest").endswith("step_10")
    assert resolve_checkpoint(str(tmp_path / "fresh"), "latest") is None
    with pytest.raises(UsageError, match="not a complete checkpoint"):
        resolve_checkpoint(str(tmp_path), str(root / "tmp-step_12" / "missing"))
    with pytest.raises(UsageError, match="already holds a run"):
        check_output_dir(str(tmp_path), None, overwrite=False)
    check_output_dir(str(tmp_path), "latest", overwrite=False)
