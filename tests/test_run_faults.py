"""Faults around a run that cost a user the job or the right result without saying so: fp16's loss-scale
overflows taken for non-finite steps, a lost peer guessed from the word "timeout"."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import causal_lm_args, load_script, read_metrics, read_run, run_in_process


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_fp16_loss_scale_overflows_are_the_scalers_not_skipped_steps(optim, markov_data, tmp_path, monkeypatch):
    """accelerate runs fp16 with a GradScaler (on a GPU only): here torch's real CPU GradScaler is
    given to the Accelerator as accelerate gives it on a GPU, and the recipe's own loop runs. A scale
    of 2^24 overflows fp16's backward for real: the first steps overflow, the scaler halves its scale
    each time, then trains; growing again every 2 good steps, it overflows again later. None of that
    may stop the run (--max_nonfinite_skips 0: one counted skip would) or break the scaler
    (skipping optimizer.step() also skipped the scaler's update: "unscale_() has already been called
    on this optimizer since the last update()" at the next step). adamw_torch reads the norm on the
    host each step, the fused kernel skips on the device (common.training.nonfinite)."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    scalers = []

    def with_grad_scaler(accelerator):
        accelerator.native_amp = True  # what accelerate sets for fp16 on a GPU, with its scaler
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
        scalers.append(accelerator.scaler)

    out = tmp_path / "run"
    run_in_process(
        "recipes/causal_lm.py",
        causal_lm_args(
            markov_data,
            out,
            max_steps=10,
            gradient_accumulation_steps=2,
            warmup_steps=0,
            optim=optim,
            max_nonfinite_skips=0,
            save_steps=5,
        ),
        monkeypatch,
        with_grad_scaler,
    )

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    overflows = [row["step"] for row in rows if row.get("event") == "loss_scale_overflow"]
    assert not [row for row in rows if row.get("event") == "nonfinite"], rows
    assert overflows[:3] == [1, 2, 3] and len(overflows) < 10, overflows  # the scale came down, then trained
    train, _ = read_metrics(out)
    # the schedule steps only with the optimizer: the learning rate of an overflowed step is the one before it
    lrs = {0: read_run(out)["args"]["learning_rate"], **{row["step"]: row["lr"] for row in train}}
    assert all(lrs[step] == lrs[step - 1] for step in overflows), (overflows, lrs)
    assert lrs[overflows[-1] + 1] < lrs[overflows[-1]], lrs
    assert train[-1]["loss"] < train[0]["loss"], train
    assert scalers[0].get_scale() < 2.0**24
    assert (out / "checkpoints" / "step_10").is_dir() and (out / "final" / "model.safetensors").is_file()


def test_a_lost_peer_is_read_from_the_backends_error_not_from_the_word_timeout(monkeypatch):
    from common.launch.peers import lost_peer_message

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
        "3000ms for recv operation to complete"
    )
    closed = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[10.77.1.2]:48875. This is typically caused by a remote worker crashing."
    )
    nccl = torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0: operation timed out")
    in_backward = RuntimeError("Application timeout caused pair closure")  # gloo's, through DDP's backward
    for error in (gloo, closed, nccl, in_backward):
        assert lost_peer_message(error, 60) is not None, error
    assert "10.77.1.2" in lost_peer_message(closed, 60) and "(the main node is " in lost_peer_message(closed, 60)
    # gloo's advice after its reason (and the emoji a newer gloo adds) gives way to the line's own
    advised = RuntimeError(
        closed.args[0] + " Check the logs of the remote worker before reporting an error. \U0001f3d6\ufe0f"
    )
    assert ": Connection closed by peer [10.77.1.2]:48875. A process" in lost_peer_message(advised, 60)
    # under an elastic agent MASTER_ADDR is the workers' store; gloo's "GLHF!" sign-off is not part of the reason
    monkeypatch.setenv("RECIPES_ELASTIC", "1:2:127.0.0.1:29400")  # common.launch.elastic's, for its workers
    signed = RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.77.1.2]:48875 GLHF!")
    said = lost_peer_message(signed, 60)
    assert "(the workers' store is " in said and "GLHF" not in said and "main node" not in said, said
    assert ": Connection closed by peer [10.77.1.2]:48875. A process" in said, said
    monkeypatch.delenv("RECIPES_ELASTIC")
    text = "Connection closed by peer [10.77.1.2]:48875. " + "the backend goes on at length " * 12
    reason = lost_peer_message(RuntimeError(text), 60).split(": ", 1)[1].split(". A process", 1)[0]
    kept = reason.removesuffix(" ...")  # cut at a word, not mid-word, and said to be cut
    assert len(reason) <= 204 and kept != reason and text.startswith(kept + " "), reason
    for error in (
        RuntimeError("CUDA error: the launch timed out and was terminated"),
        RuntimeError("tokenizing timed out after 600 s"),
        TimeoutError("timed out"),
    ):
        assert lost_peer_message(error, 60) is None, error


def test_overwrite_clears_every_export_of_the_earlier_run_and_a_resume_from_an_earlier_step_sets_the_later_ones_aside(
    markov_data, tmp_path, monkeypatch
):
    """Three short runs in one folder, one process each:
    A, with --overwrite_output_dir over an earlier run's exports (best/, *_merged/, exported/) and a file of
    the user's: checkpoints at steps 2, 4, 6 and 8; the exports go (each counted by the output-dir check
    first), the user's file stays.
    B, resumed from step_2 clipping at another norm, saving at 3 and 6 and keeping 2: the later
    checkpoints (A's continuation) move to checkpoints/abandoned_after_step_2/, so the pruning keeps B's
    step_3 and step_6 (by step number it kept A's 6 and 8, deleting B's step_3 as soon as written).
    C, resumed from 'latest' with B's arguments, must continue B: its final weights are B's (before, it
    resumed A's step_8 and ended at once with A's weights)."""
    from conftest import load_weights, max_weight_difference

    from common.launch.errors import UsageError
    from common.outputs.run_dir import check_output_dir, list_checkpoints

    out = tmp_path / "run"
    for stale in ("best", "final_merged", "best_merged", "exported/step_4"):
        (out / stale).mkdir(parents=True)
        (out / stale / "model.safetensors").write_text("an earlier run's export")
    (out / "notes.txt").write_text("the user's own file")
    with pytest.raises(UsageError, match=r"already holds a run \(best, best_merged, exported, final_merged\)"):
        check_output_dir(str(out), None, overwrite=False)

    def recipe_args(**overrides):
        return causal_lm_args(markov_data, out, max_steps=8, gradient_accumulation_steps=2, **overrides)

    run_in_process(
        "recipes/causal_lm.py", recipe_args(save_steps=2, save_total_limit=10, overwrite_output_dir=True), monkeypatch
    )
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "final", "metrics.jsonl", "notes.txt", "run.json"]
    run_a = load_weights(out / "final")
    run_a_final = tmp_path / "run_a_final"
    shutil.copytree(out / "final", run_a_final)

    changed = dict(max_grad_norm=0.05, save_steps=3, save_total_limit=2)
    run_in_process(
        "recipes/causal_lm.py", recipe_args(resume_from_checkpoint=out / "checkpoints/step_2", **changed), monkeypatch
    )
    assert [Path(p).name for p in list_checkpoints(str(out))] == ["step_3", "step_6"]
    aside = out / "checkpoints/abandoned_after_step_2"
    assert sorted(p.name for p in aside.iterdir()) == ["step_4", "step_6", "step_8"]
    # a set-aside checkpoint still exports, beside the run's own exports (not inside checkpoints/)
    exported = load_script("scripts/export_checkpoint.py").main(["--checkpoint", str(aside / "step_8")])
    assert Path(exported) == out / "exported/abandoned_after_step_2/step_8"
    assert max_weight_difference(exported, run_a_final) < 1e-6  # A's step 8 is A's final
    run_b = load_weights(out / "final")
    assert max_weight_difference(out / "final", out / "checkpoints/step_6") > 0  # B trained past its step 6
    assert max(float((run_a[k] - run_b[k]).abs().max()) for k in run_a) > 1e-4  # clipped at another norm

    (out / "final").rename(out / "final_b")
    run_in_process("recipes/causal_lm.py", recipe_args(resume_from_checkpoint="latest", **changed), monkeypatch)
    assert max_weight_difference(out / "final", out / "final_b") < 1e-6
    assert not (out / ".launch_starting").exists()


def test_fp16_overflowing_at_every_scale_stops_the_run_in_one_line(markov_data, tmp_path, monkeypatch):
    """A scale of 2^126 overflows fp16's backward at every halving the scaler makes within 30 steps:
    the gradients are not finite at any scale the run reaches, so it stops at the 31st overflow in a
    row (before, fp16 overflows were never counted and it trained to the end, every step skipped)."""
    from common.launch.errors import RunStopped

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")

    def with_grad_scaler(accelerator):
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126)

    with pytest.raises(
        RunStopped,
        match=r"step 31: the gradients overflowed 31 steps in a row while every loss was "
        r"finite",
    ):
        run_in_process(
            "recipes/causal_lm.py",
            causal_lm_args(markov_data, tmp_path / "run", max_steps=40, optim="adamw_torch"),
            monkeypatch,
            with_grad_scaler,
        )


def test_a_worker_restarted_before_any_checkpoint_starts_again_over_its_own_first_attempt(tmp_path, monkeypatch):
    """A launch without --overwrite_output_dir into a new folder, whose first attempt wrote run.json and
    metrics but no checkpoint yet (--save_steps 0, or a crash before the first save): the restarted
    worker starts again over those (they are this launch's), rather than being refused as a run
    already there."""
    from common.options.arguments import TrainingArguments
    from common.outputs.run_dir import check_output_dir
    from common.run import resume_after_restart

    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    args = TrainingArguments(output_dir=str(out))
    resume_after_restart(args)
    assert args.overwrite_output_dir and args.resume_from_checkpoint is None
    check_output_dir(args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir)


def test_overwrite_empties_a_symlinked_run_folder_and_keeps_the_link(tmp_path):
    """output_dir/checkpoints -> /scratch/...: the earlier run's checkpoints there go, the link (where the
    user wants checkpoints written) stays, and nothing outside it is touched."""
    from common.outputs.run_dir import clear_earlier_run

    scratch, out = tmp_path / "scratch", tmp_path / "run"
    (scratch / "step_2").mkdir(parents=True)
    (scratch / "step_2" / "model.safetensors").write_text("earlier")
    (tmp_path / "elsewhere.txt").write_text("the user's")
    out.mkdir()
    (out / "checkpoints").symlink_to(scratch)
    clear_earlier_run(str(out))
    assert (out / "checkpoints").is_symlink() and scratch.is_dir() and not list(scratch.iterdir())
    assert (tmp_path / "elsewhere.txt").exists()


def test_after_a_resume_the_schedule_sets_the_rate_of_the_optimizer_accelerate_swapped_in():
    """Under optimizer offload on a GPU, accelerate replaces the recipe's AdamW by a DeepSpeedCPUAdam built on the
    same param-group dicts (map_pytorch_optim_to_deepspeed) and the schedule keeps the AdamW. Loading a checkpoint
    gives the new optimizer new groups: the schedule then moved a rate nobody read (on an H100 every step after a
    resume ran at the checkpoint's rate). Here the swap is made the same way with torch's Adam (DeepSpeedCPUAdam
    needs its C++ op built), under accelerate's own wrappers; after the load the schedule reaches it again."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from common.outputs.checkpoints import schedule_the_loaded_optimizer

    model = torch.nn.Linear(4, 4)
    recipes = torch.optim.AdamW(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(recipes, lambda step: 0.5**step)
    swapped = torch.optim.Adam(recipes.param_groups)  # the same dicts, as accelerate builds DeepSpeedCPUAdam
    AcceleratorState._reset_state(True)
    try:
        optimizer, scheduler = Accelerator(
            cpu=True, device_placement=False, step_scheduler_with_optimizer=False
        ).prepare(swapped, schedule)
        scheduler.step()
        assert swapped.param_groups[0]["lr"] == 0.5  # before a load the dicts are shared: the schedule reaches it
        swapped.load_state_dict(swapped.state_dict())  # what a checkpoint load does: new group dicts
        scheduler.step()
        assert swapped.param_groups[0]["lr"] == 0.5  # the rate nobody updates any more
        schedule_the_loaded_optimizer(optimizer, scheduler)
        scheduler.step()
        assert swapped.param_groups[0]["lr"] == 0.125 and schedule.get_last_lr() == [0.125]
    finally:
        AcceleratorState._reset_state(True)


def refused_start(recipe: str, argv: list, monkeypatch) -> int:
    """common.run.run_recipe as a launched worker runs it, in this process: its exit status (a refusal
    prints its one line and exits)."""
    import sys

    from accelerate.state import AcceleratorState

    from common.run import run_recipe

    module = load_script(recipe)
    types = [annotation for annotation in module.main.__annotations__.values() if isinstance(annotation, type)]
    monkeypatch.setattr(sys, "argv", [recipe, *map(str, argv)])
    AcceleratorState._reset_state(True)
    try:
        with pytest.raises(SystemExit) as ended:
            run_recipe(module.main, *types, argv=[str(a) for a in argv])
    finally:
        AcceleratorState._reset_state(True)
    return ended.value.code


def folder_state(folder: Path) -> dict:
    """Every file's bytes and every folder under `folder`, by relative path."""
    return {
        str(path.relative_to(folder)): path.read_bytes() if path.is_file() else None
        for path in sorted(folder.rglob("*"))
    }


def test_a_refused_resume_leaves_the_output_folder_exactly_as_it_was(markov_data, tmp_path, monkeypatch, capsys):
    """Refused for another global batch (before the checkpoint loads or a line says it resumes: not after
    converting and loading it), run.json was already the refused command's (the record the model
    card and the exports read), and a resume from step 1 had set step_2 aside; refused for a checkpoint
    that does not load into the model (another --model_config), .launch_starting stayed behind."""
    out = tmp_path / "run"
    run_in_process("recipes/causal_lm.py", causal_lm_args(markov_data, out, max_steps=2, save_steps=1), monkeypatch)
    before = folder_state(out)
    assert "checkpoints/step_2/trainer_state.json" in before and "run.json" in before

    resume = dict(max_steps=2, save_steps=1, resume_from_checkpoint=out / "checkpoints" / "step_1")
    status = refused_start(
        "recipes/causal_lm.py",
        causal_lm_args(markov_data, out, per_device_train_batch_size=2, **resume),
        monkeypatch,
    )
    said = capsys.readouterr()
    error = said.err.strip().splitlines()[-1]
    assert status == 2 and error.startswith("error: the checkpoint was trained with a global batch of 4"), error
    assert "resumed from" not in said.out + said.err  # refused from its state file, before anything loads
    assert folder_state(out) == before

    wider = tmp_path / "wider.json"
    config = json.loads((Path(__file__).parents[1] / "recipes/configs/tiny_llama.json").read_text())
    wider.write_text(json.dumps({**config, "hidden_size": 128}))
    status = refused_start(
        "recipes/causal_lm.py", causal_lm_args(markov_data, out, model_config=wider, **resume), monkeypatch
    )
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and "does not load into this run" in error, error
    assert folder_state(out) == before
