"""Real `accelerate launch` runs of recipes/causal_lm.py on CPU."""

import re

import pytest
from conftest import (
    FP32,
    REPO,
    STEPS,
    causal_lm_args,
    evaluate_in_process,
    launch,
    launch_one_process,
    losses,
    read_metrics,
    read_run,
)


@pytest.mark.slow
def test_ddp_two_processes_train_export_and_reload(markov_data, tmp_path):
    out = tmp_path / "ddp"
    launch(
        "ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, out, max_steps=30, logging_steps=5), launcher_args=FP32
    )  # fp32: make evaluate (fp32) must reproduce the logged eval loss to 1e-5
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
    # Achieved FLOP/s: the model's FLOPs per token (common.training.flops) times the tokens it ran; no MFU on CPU.
    from transformers import AutoModelForCausalLM

    from common.training.flops import ModelFlops

    per_token = ModelFlops(AutoModelForCausalLM.from_pretrained(out / "final")).per_token(32)
    for row in train:
        assert row["tflops_per_device"] == pytest.approx(row["tokens_per_s_per_device"] * per_token / 1e12, rel=1e-6)
        assert row["mfu"] is None and 0 <= row["data_wait_fraction"] < 1
    assert (out / "final" / "model.safetensors").exists() and (out / "final" / "tokenizer.json").exists()

    reloaded = evaluate_in_process(
        [
            "--model_name_or_path",
            out / "final",
            "--train_file",
            markov_data / "train.jsonl",
            "--validation_file",
            markov_data / "validation.jsonl",
            "--block_size",
            "32",
            "--per_device_eval_batch_size",
            "8",
        ]
    )
    assert reloaded["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], abs=1e-5)


@pytest.mark.slow
def test_copied_recipe_runs_outside_the_repository_and_never_overwrites_a_run(copied_recipe_run, markov_data, capsys):
    """A recipe copied into another folder trains there (it imports only `common`: launched from that folder,
    conftest.copied_recipe_run); started again on the same output_dir, without --overwrite_output_dir, it
    refuses in one line and leaves the earlier run as it was (the copy's command line, `python train.py ...`,
    run in this process: the refusal comes before anything starts)."""
    import importlib.util

    from accelerate.state import AcceleratorState

    from common.models.lora import LoraArguments
    from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
    from common.run import run_recipe

    work, out = copied_recipe_run
    assert read_run(out)["participating_processes"] == 2
    assert (out / "final" / "config.json").exists()
    before = (out / "final" / "model.safetensors").read_bytes()
    spec = importlib.util.spec_from_file_location("train", work / "train.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)  # defines main; runs nothing (__name__ is not "__main__")
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as refused:  # the copy's last line, as `python train.py` runs it
            run_recipe(
                copy.main,
                ModelArguments,
                DataArguments,
                LoraArguments,
                TrainingArguments,
                argv=[str(a) for a in causal_lm_args(markov_data, out, max_steps=2)],
            )
    finally:
        AcceleratorState._reset_state(True)
    stderr = capsys.readouterr().err
    assert refused.value.code == 2
    assert stderr.strip().startswith("error: output_dir") and stderr.count("\n") == 1, stderr
    assert (out / "final" / "model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_bad_input_is_one_line_and_nonzero_exit(markov_data, tmp_path):
    """Launched on 2 processes: one error line, not one per rank. The other bad arguments take
    the same path and are checked in-process in test_arguments.py. What follows the line is what
    docs/operating.md says a user sees (issue 54, item 13: it promised exit status 2 and no traceback):
    torchrun's ChildFailedError block naming the worker's exit code 2, and `accelerate launch` exiting 1."""
    override, message = {"config": "/nonexistent/recipe.yaml"}, "does not exist"
    result = launch(
        "ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, tmp_path / "bad", **override), check=False, real=True
    )
    lines = result.stderr.splitlines()
    errors = [index for index, line in enumerate(lines) if line.startswith("error:")]
    assert len(errors) == 1 and message in lines[errors[0]], result.stderr[-2000:]
    assert 'causal_lm.py", line' not in result.stderr  # no traceback from the recipe (torchrun adds its own)
    assert not (tmp_path / "bad").exists()  # failed before anything was written
    block = next(index for index, line in enumerate(lines) if "ChildFailedError" in line)
    assert result.returncode == 1 and errors[0] < block and re.search(r"exitcode\s*: 2\b", result.stderr)
    page = " ".join((REPO / "docs/operating.md").read_text().split())
    said = page.split("**Errors.**", 1)[1].split("**A lost peer", 1)[0]
    for claim in ("`accelerate launch` exits 1", "`ChildFailedError` block", "`exitcode : 2`", "exits 2"):
        assert claim in said, claim


@pytest.mark.slow
def test_rotation_and_gradient_checkpointing(markov_data, reference, tmp_path):
    """save_total_limit keeps the newest checkpoints; gradient checkpointing leaves the losses
    unchanged (against the one-process reference run, which has it off)."""
    checkpointed = tmp_path / "ckpt"
    launch_one_process(
        "causal_lm.py",
        causal_lm_args(
            markov_data,
            checkpointed,
            per_device_train_batch_size=8,
            max_steps=STEPS,
            save_steps=4,
            save_total_limit=2,
            gradient_checkpointing="true",
        ),
        launcher_args=FP32,
    )
    assert read_run(checkpointed)["args"]["gradient_checkpointing"] is True
    assert sorted(p.name for p in (checkpointed / "checkpoints").iterdir()) == ["step_12", "step_8"]
    assert len(losses(checkpointed)) == STEPS
    assert max(abs(a - b) for a, b in zip(losses(reference), losses(checkpointed))) < 1e-5


def budget_stop(out) -> tuple[dict, list[int], list[int]]:
    """run.json's training_time, the steps of the loss rows and of the evaluation rows."""
    train, evals = read_metrics(out)
    return read_run(out)["training_time"], [row["step"] for row in train], [row["step"] for row in evals]


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_max_train_seconds_stops_every_rank_at_one_step_then_evaluates_and_exports(
    processes, markov_data, reference, tmp_path, capsys
):
    """--max_train_seconds: a budget spent after the first step ends the run there (of 12), every rank at the same
    step (2 processes: launched, both taking part, the stop a collective), with the evaluation (once, though step 1 is
    an evaluation step) and final/ of a run that reached --max_steps and the stop in run.json and on the console;
    without a budget (the one-process reference run) the 12 steps are trained and their seconds recorded."""
    args = dict(max_steps=12, eval_steps=1, max_train_seconds=1e-6)  # stopped at an evaluation step: evaluated once
    budgeted = tmp_path / "budgeted"
    if processes == 1:
        launch_one_process("causal_lm.py", causal_lm_args(markov_data, budgeted, **args), launcher_args=FP32)
        said = capsys.readouterr().out
    else:
        result = launch("ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, budgeted, **args), launcher_args=FP32)
        said = result.stdout
        assert read_run(budgeted)["participating_processes"] == 2
    timing, trained, evaluated = budget_stop(budgeted)
    assert timing["stopped_by_time_budget"] == {"step": 1} and timing["max_train_seconds"] == 1e-6
    assert 0 < timing["train_seconds"] and trained == [1] and evaluated == [1]
    assert "--max_train_seconds 1e-06: stopped after step 1 of 12" in said
    assert (budgeted / "final" / "model.safetensors").is_file()
    card = (budgeted / "final" / "README.md").read_text()  # the model card says what trained
    assert re.search(r"trained steps\W+1\b", card) and re.search(r"max_train_seconds\W+1e-06", card), card
    timing, trained, _ = budget_stop(reference)
    assert timing["max_train_seconds"] is None and "stopped_by_time_budget" not in timing
    assert timing["train_seconds"] > 0 and trained == list(range(1, 13))
