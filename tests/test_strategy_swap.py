"""A checkpoint saved under one config resumes under another (common/outputs/portable.py, portable_load.py).

Each source run trains 6 steps on 2 processes (fp32, accumulation 2) with a checkpoint at step 3; the
target run resumes that checkpoint under another config (and number of processes) and finishes. Its losses at steps 4-6 and its final weights
are compared with the source run's own (the run resumed under its own config gives the
uninterrupted run's weights bit for bit: tests/test_crashes.py). The rewrite leaves the original
checkpoint as it was, and a second resume reuses it (as it reuses `make convert-checkpoint`'s).
"""

from __future__ import annotations

import hashlib

import pytest
from conftest import FP32, LaunchedOnce, causal_lm_args, launch, losses, max_weight_difference, read_run, run, tiered


RUN = dict(
    max_steps=6,
    save_steps=3,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    warmup_steps=2,
    block_size=32,
    logging_steps=1,
)
PAIRS = [
    ("ddp.yaml", "fsdp.yaml", 2),
    ("fsdp.yaml", "zero3.yaml", 2),
    ("zero3.yaml", "fsdp.yaml", 2),
    ("zero2.yaml", "ddp.yaml", 2),
    ("zero3_offload.yaml", "fsdp.yaml", 2),
    ("fsdp.yaml", "ddp.yaml", 1),
    ("ddp.yaml", "zero2_offload.yaml", 2),
]
# make test: ZeRO-3 (offloaded, converted ahead by make convert-checkpoint) to FSDP2; make test-all: every pair
IN_MAKE_TEST = [("zero3_offload.yaml", "fsdp.yaml", 2)]


def fingerprint(folder) -> dict:
    """The checkpoint's own files (not its rewrite, portable/) and their digests."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.relative_to(folder).parts[0].startswith("portable")
    }


@pytest.fixture(scope="module")
def sources(markov_data, tmp_path_factory) -> LaunchedOnce:
    """One finished run per source config, fp32 on 2 processes, with its step_3 checkpoint."""

    def source_run(config):
        out = tmp_path_factory.mktemp(config.removesuffix(".yaml"))
        launch(config, "causal_lm.py", causal_lm_args(markov_data, out, **RUN), launcher_args=FP32)
        return out

    return LaunchedOnce(source_run)


@pytest.fixture(scope="module")
def rewritten() -> set:
    """The source configs whose checkpoint has its rewrite for another strategy."""
    return set()


@pytest.mark.slow
@pytest.mark.parametrize(
    "source,target,processes", tiered(PAIRS, IN_MAKE_TEST), ids=[f"{s[:-5]}-to-{t[:-5]}-{n}p" for s, t, n in PAIRS]
)
def test_a_checkpoint_resumes_under_another_config_to_the_same_losses_and_weights(
    sources, rewritten, source, target, processes, markov_data, tmp_path
):
    """fp32: the resumed steps' losses within 1e-6 (relative) of the source run's, the final weights within
    1e-6; the Adam moments, step count, schedule, RNG and data position all come back (a moment or a
    schedule left at zero moves the losses by far more); the original checkpoint is left as it was."""
    checkpoint = sources[source] / "checkpoints" / "step_3"
    before = fingerprint(checkpoint)
    out = tmp_path / "resumed"
    if source == "zero3_offload.yaml":  # converted ahead by the make target; the resume finds it done
        converted = run(
            ["make", "-s", "convert-checkpoint", f"CHECKPOINT={checkpoint}", f"CONFIG=accelerate_configs/{target}"]
        )
        assert f"converted into {checkpoint}/portable" in converted.stdout, converted.stdout
        rewritten.add(source)
    batch = RUN["per_device_train_batch_size"] * 2 // processes  # the same global batch
    # regional compile (its copy of the model names the parameters otherwise) on one pair
    compiled = {"torch_compile": "true"} if (source, target) == ("zero2.yaml", "ddp.yaml") else {}
    resume = dict(RUN, per_device_train_batch_size=batch, resume_from_checkpoint=checkpoint, **compiled)
    result = launch(
        target, "causal_lm.py", causal_lm_args(markov_data, out, **resume), num_processes=processes, launcher_args=FP32
    )
    output = result.stdout + result.stderr
    assert f"loading its rewrite {checkpoint}/portable" in output
    assert ("rewriting" in output) == (source not in rewritten)  # once: a second resume reuses it
    rewritten.add(source)
    assert read_run(out)["participating_processes"] == processes
    resumed, original = losses(out), losses(sources[source])[3:]
    gap = max(abs(a - b) / b for a, b in zip(resumed, original))
    weights = max_weight_difference(out / "final", sources[source] / "final")
    print(f"{source} -> {target} on {processes}: loss gap {gap:.2e} (relative), weight gap {weights:.2e}")
    assert len(resumed) == 3 and gap < 1e-6 and weights < 1e-6
    portable = checkpoint / "portable"
    assert fingerprint(checkpoint) == before
    assert (portable / "model.safetensors").is_file() and (portable / "optimizer.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.bf16
def test_a_bf16_checkpoint_resumes_under_another_config_within_bf16s_noise(markov_data, tmp_path):
    """fsdp.yaml's bf16 run (2 processes, accumulation 2) resumed at step 3 under zero2.yaml's bf16, where the
    compute copy is bf16 weights rather than autocast over fp32 ones: the resumed losses within 1e-2 (relative)
    of the source run's, and the final weights (the fp32 master copies) within 1e-3."""
    source, out = tmp_path / "fsdp_bf16", tmp_path / "resumed"
    launch("fsdp.yaml", "causal_lm.py", causal_lm_args(markov_data, source, **RUN))
    launch(
        "zero2.yaml",
        "causal_lm.py",
        causal_lm_args(markov_data, out, **dict(RUN, resume_from_checkpoint=source / "checkpoints" / "step_3")),
    )
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["compute_dtype"] == "bfloat16"
    gap = max(abs(a - b) / b for a, b in zip(losses(out), losses(source)[3:]))
    weights = max_weight_difference(out / "final", source / "final")
    print(f"fsdp bf16 -> zero2 bf16: loss gap {gap:.2e} (relative), weight gap {weights:.2e}")
    assert len(losses(out)) == 3 and gap < 1e-2 and weights < 1e-3
