"""Non-finite gradients in a real run: every rank agrees, the step is skipped (weights,
optimizer and schedule untouched) or the run stops, and no checkpoint holds non-finite weights.

The run goes non-finite for real: a bf16 checkpoint whose embedding row for one word is
3e38 (finite, near the top of the bf16/fp32 range). Its forward stays finite, but the
backward of the RMSNorm over it overflows to NaN, in the batches that hold that word only.
"""

import json
import math
import re
import shutil

import pytest
import torch
from conftest import EMULATED_BF16, launch, load_weights, losses, pretrained_args, read_metrics, read_run


# bf16 as the configs ask, where the non-finite steps of users' runs come from (emulated on a CPU without bf16)
pytestmark = pytest.mark.bf16


POISON = 3e38


@pytest.fixture(scope="module")
def poisoned(markov_data, bf16_checkpoint, tmp_path_factory):
    """(data folder, model folder): 150 Markov documents plus one that holds the unknown word,
    and the bf16 checkpoint with that word's (<unk>'s) embedding row set to POISON."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("poisoned")
    model = root / "model"
    shutil.copytree(bf16_checkpoint, model)
    unk = AutoTokenizer.from_pretrained(model).unk_token_id
    weights = load_file(str(model / "model.safetensors"))
    weights["model.embed_tokens.weight"][unk] = POISON
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})

    docs = (markov_data / "train.jsonl").read_text().splitlines()[:150]
    docs.insert(70, json.dumps({"text": "zzzunseenword " + json.loads(docs[70])["text"]}))
    (root / "train.jsonl").write_text("\n".join(docs) + "\n")
    return root, model


def events(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row.get("event") == "nonfinite"]


def run_args(markov_data, poisoned, out, **overrides):
    root, model = poisoned
    values = dict(
        train_file=root / "train.jsonl",
        validation_file=markov_data / "validation.jsonl",
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        max_steps=10,
        save_steps=1,
        save_total_limit=20,
        max_grad_norm=1.0,
        warmup_steps=0,
    )
    values.update(overrides)
    return pretrained_args(markov_data, model, out, **values)


@pytest.fixture(scope="module")
def skipping_run(markov_data, poisoned, tmp_path_factory):
    """ddp.yaml (bf16), 2 processes, accumulation 2, 10 steps over 2 epochs, a checkpoint a step."""
    out = tmp_path_factory.mktemp("skipping") / "run"
    result = launch("ddp.yaml", "causal_lm.py", run_args(markov_data, poisoned, out), env=EMULATED_BF16)
    return out, result.stdout + result.stderr


@pytest.mark.slow
def test_a_non_finite_step_is_skipped_on_every_rank_and_training_goes_on(skipping_run):
    """Each epoch's window with the poisoned word is skipped; the checkpoint after a skipped
    step equals the one before it (weights and optimizer), and every other step trains."""
    out, output = skipping_run
    assert read_run(out)["participating_processes"] == 2
    assert read_run(out)["mixed_precision"] == "bf16"
    assert read_run(out)["nonfinite_check"] == "device"  # DDP + fused AdamW: no host read between logging steps
    skipped = events(out)
    print("skipped steps:", [(e["step"], e["grad_norm"]) for e in skipped])
    assert 2 <= len(skipped) <= 4, skipped  # once per epoch (twice if the word's block spans two windows)
    assert all(e["action"] == "skipped" and e["grad_norm"] == "nan" for e in skipped)
    assert re.search(rf"warning: step {skipped[0]['step']}: non-finite gradients .* step skipped", output)
    for event in skipped:
        before, after = out / f"checkpoints/step_{event['step'] - 1}", out / f"checkpoints/step_{event['step']}"
        assert (before / "model.safetensors").read_bytes() == (after / "model.safetensors").read_bytes()
        assert (before / "optimizer.bin").read_bytes() == (after / "optimizer.bin").read_bytes()
        schedules = [torch.load(folder / "scheduler.bin", weights_only=False) for folder in (before, after)]
        assert schedules[0]["last_epoch"] == schedules[1]["last_epoch"]  # the schedule did not step either
    trained = [s for s in range(2, 11) if s not in {e["step"] for e in skipped}]
    changed = [
        s
        for s in trained
        if (out / f"checkpoints/step_{s - 1}/model.safetensors").read_bytes()
        != (out / f"checkpoints/step_{s}/model.safetensors").read_bytes()
    ]
    assert changed == trained
    final = load_weights(out / "final")
    assert all(torch.isfinite(t.float()).all() for t in final.values())
    assert all(math.isfinite(loss) for loss in losses(out))


@pytest.mark.slow
def test_steps_skipped_on_the_device_are_read_at_the_logging_steps(markov_data, poisoned, skipping_run, tmp_path):
    """Logging every 4 steps and no checkpoints: the steps are decided on the device and read every
    4 steps and at the end; the same steps are skipped as in the run read at every step, and the
    losses follow it (the schedule runs at most 3 steps ahead of a skip until it is read)."""
    reference, _ = skipping_run
    out = tmp_path / "run"
    launch("ddp.yaml", "causal_lm.py", run_args(markov_data, poisoned, out, save_steps=0, logging_steps=4))
    assert read_run(out)["participating_processes"] == 2 and read_run(out)["nonfinite_check"] == "device"
    assert [(e["step"], e["action"]) for e in events(out)] == [(e["step"], e["action"]) for e in events(reference)]
    assert [row["step"] for row in read_metrics(out)[0]] == [4, 8]
    every_step = {row["step"]: row["loss"] for row in read_metrics(reference)[0]}
    # a window's mean loss against the mean of the per-step run's losses over the same steps
    gaps = [
        abs(row["loss"] - sum(every_step[s] for s in range(row["step"] - 3, row["step"] + 1)) / 4)
        for row in read_metrics(out)[0]
    ]
    print(f"loss gap, logging every 4 steps vs every step: {max(gaps):.2e}")
    assert max(gaps) < 2e-2
    assert all(torch.isfinite(t.float()).all() for t in load_weights(out / "final").values())


@pytest.mark.slow
@pytest.mark.exhaustive
def test_zero3_skips_the_same_steps_and_follows_the_ddp_run(markov_data, poisoned, skipping_run, tmp_path):
    """DeepSpeed steps inside backward; ZeRO-3 (bf16) discards the non-finite step itself, and the
    loop skips its schedule step: the same steps are skipped and the losses follow ddp's."""
    ddp, _ = skipping_run
    out = tmp_path / "run"
    launch("zero3.yaml", "causal_lm.py", run_args(markov_data, poisoned, out, save_steps=0))
    assert read_run(out)["participating_processes"] == 2 and read_run(out)["nonfinite_check"] == "host"
    assert [(e["step"], e["action"]) for e in events(out)] == [(e["step"], e["action"]) for e in events(ddp)]
    gap = max(abs(a - b) for a, b in zip(losses(out), losses(ddp)))
    print(f"zero3 vs ddp loss gap over {len(losses(out))} steps: {gap:.2e}")
    assert len(losses(out)) == 10 and gap < 2e-2


@pytest.mark.slow
def test_nonfinite_stop_ends_the_run_with_one_line_and_keeps_finite_checkpoints(markov_data, poisoned, tmp_path):
    out = tmp_path / "run"
    result = launch("ddp.yaml", "causal_lm.py", run_args(markov_data, poisoned, out, nonfinite="stop"), check=False)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, output[-4000:]
    print(errors[0])
    assert re.search(r"non-finite gradients \(gradient norm nan\); stopped \(--nonfinite stop\)", errors[0])
    step = int(re.search(r"step (\d+)", errors[0]).group(1))
    assert events(out)[-1]["step"] == step and events(out)[-1]["action"] == "stopped"
    saved = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert saved == list(range(1, step)), saved  # nothing from the non-finite step on
    assert not (out / "final").exists()


def test_max_nonfinite_skips_counts_the_skips_before_a_resume(markov_data, poisoned, tmp_path, monkeypatch):
    """--max_nonfinite_skips bounds the run's skips, not each launch's: a resumed run went on counting
    from 0, so a run resumed after each skip never stopped. In-process (one rank, fp32, global batch 16),
    the recipe's own loop on the poisoned data: steps 5 and 8 are non-finite."""
    from conftest import run_in_process

    from common.launch.errors import RunStopped

    out, stopped = tmp_path / "run", tmp_path / "stopped"
    steps = dict(per_device_train_batch_size=8, max_steps=8, save_steps=5)
    run_in_process(
        "recipes/causal_lm.py", run_args(markov_data, poisoned, out, max_nonfinite_skips=5, **steps), monkeypatch
    )
    assert [(row["step"], row["skipped_steps"]) for row in events(out)] == [(5, 1), (8, 2)], events(out)
    shutil.copytree(out / "checkpoints" / "step_5", stopped / "checkpoints" / "step_5")  # a run stopped after step 5
    resume = run_args(markov_data, poisoned, stopped, max_nonfinite_skips=1, resume_from_checkpoint="latest", **steps)
    with pytest.raises(RunStopped, match=r"step 8: .*2 steps were non-finite, more than --max_nonfinite_skips 1"):
        run_in_process("recipes/causal_lm.py", resume, monkeypatch)
    assert [(row["step"], row["skipped_steps"], row["action"]) for row in events(stopped)] == [(8, 2, "stopped")]
