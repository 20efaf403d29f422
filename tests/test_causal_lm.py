"""Real `accelerate launch` runs of recipes/causal_lm.py on CPU."""

import json
import shutil

import pytest

from conftest import BIN, FP32, REPO, causal_lm_args, launch, losses, read_metrics, read_run, run


def test_ddp_two_processes_train_export_and_reload(markov_data, tmp_path):
    out = tmp_path / "ddp"
    launch("ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, out, max_steps=30, logging_steps=5),
           launcher_args=FP32)  # fp32: make evaluate (fp32) must reproduce the logged eval loss to 1e-5
    record = read_run(out)
    assert record["world_size"] == 2 and record["participating_processes"] == 2
    assert record["distributed_type"] == "MULTI_CPU"
    assert record["effective_batch_size"] == 4 * 1 * 2
    assert record["mixed_precision"] == "no" and record["compute_dtype"] == "float32"  # --mixed_precision no
    train, evals = read_metrics(out)
    assert train[-1]["loss"] < 0.7 * train[0]["loss"]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "elapsed_s"):
        assert key in train[-1]
    assert train[-1]["tokens_per_s"] > 0 and evals[-1]["step"] == 30
    # Achieved FLOP/s: the model's FLOPs per token (common.flops) times the tokens it ran; no MFU on CPU.
    from transformers import AutoModelForCausalLM

    from common.flops import ModelFlops
    per_token = ModelFlops(AutoModelForCausalLM.from_pretrained(out / "final")).per_token(32)
    for row in train:
        assert row["tflops_per_device"] == pytest.approx(row["tokens_per_s_per_device"] * per_token / 1e12, rel=1e-6)
        assert row["mfu"] is None and 0 <= row["data_wait_fraction"] < 1
    assert (out / "final" / "model.safetensors").exists() and (out / "final" / "tokenizer.json").exists()

    reloaded = run([BIN / "python", REPO / "scripts/evaluate_model.py", "--model_name_or_path", out / "final",
                    "--train_file", markov_data / "train.jsonl", "--validation_file", markov_data / "validation.jsonl",
                    "--block_size", "32", "--per_device_eval_batch_size", "8"])
    assert json.loads(reloaded.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(
        evals[-1]["eval_loss"], abs=1e-5)


@pytest.mark.slow
def test_one_process_and_two_processes_log_the_same_losses(markov_data, reference, tmp_path):
    """Global batch 8: two processes x 4 see the same data per step as the one-process reference
    (1 x 8). Two processes x 2 with accumulation 2, and resuming, are in test_strategies.py."""
    launch("ddp.yaml", "causal_lm.py",
           causal_lm_args(markov_data, tmp_path / "two", per_device_train_batch_size=4), launcher_args=FP32)
    assert read_run(tmp_path / "two")["participating_processes"] == 2
    one, two = losses(reference), losses(tmp_path / "two")
    assert len(one) == len(two) == 12
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)


def test_copied_recipe_runs_outside_the_repository(markov_data, tmp_path):
    work = tmp_path / "my_project"
    work.mkdir()
    shutil.copy(REPO / "recipes" / "causal_lm.py", work / "train.py")
    launch("ddp.yaml", work / "train.py", causal_lm_args(markov_data, work / "out", max_steps=4), cwd=work)
    assert read_run(work / "out")["participating_processes"] == 2
    assert (work / "out" / "final" / "config.json").exists()


@pytest.mark.parametrize("override, message", [
    ({"config": "/nonexistent/recipe.yaml"}, "does not exist"),
    pytest.param({"train_file": "/nonexistent/train.jsonl"}, "train_file: /nonexistent/train.jsonl does not exist",
                 marks=pytest.mark.slow),
    pytest.param({"no_such_key": "1"}, "unknown argument", marks=pytest.mark.slow),
    pytest.param({"max_steps": "ten"}, "invalid int value: 'ten'", marks=pytest.mark.slow),
])
def test_bad_input_is_one_line_and_nonzero_exit(markov_data, tmp_path, override, message):
    result = launch("ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, tmp_path / "bad", **override), check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "causal_lm.py\", line" not in result.stderr  # no traceback from the recipe (torchrun adds its own)
    assert not (tmp_path / "bad").exists()  # failed before anything was written


def test_existing_run_is_not_overwritten(markov_data, tmp_path):
    out = tmp_path / "run"
    launch("single.yaml", "causal_lm.py", causal_lm_args(markov_data, out, max_steps=2))
    before = (out / "final" / "model.safetensors").read_bytes()
    result = run([BIN / "python", REPO / "recipes/causal_lm.py"] + causal_lm_args(markov_data, out, max_steps=2),
                 check=False)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: output_dir") and result.stderr.count("\n") == 1
    assert (out / "final" / "model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_rotation_and_gradient_checkpointing(markov_data, tmp_path):
    """save_total_limit keeps the newest checkpoints; gradient checkpointing leaves the losses unchanged."""
    plain, checkpointed = tmp_path / "plain", tmp_path / "ckpt"
    launch("single.yaml", "causal_lm.py", causal_lm_args(markov_data, plain, max_steps=6), launcher_args=FP32)
    launch("single.yaml", "causal_lm.py", causal_lm_args(markov_data, checkpointed, max_steps=6, save_steps=2,
                                                         save_total_limit=2, gradient_checkpointing="true"),
           launcher_args=FP32)
    assert sorted(p.name for p in (checkpointed / "checkpoints").iterdir()) == ["step_4", "step_6"]
    assert max(abs(a - b) for a, b in zip(losses(plain), losses(checkpointed))) < 1e-5
