"""Every shipped accelerate config that runs on CPU, launched for real on 2 processes.

fp32 parity: each strategy builds its model from the config with the same seed as a
single-process reference (global batch 8 there as 1 x 8; here 2 processes x 2 x
accumulation 2) and must reproduce its per-step losses and final weights, shard what
it claims to shard, and resume to the same losses: eight configs on another world size (1 or
4 processes, the global batch kept: FSDP2 through DCP resharding, DeepSpeed through its
universal checkpoint), fsdp_shard_grad_op and zero2_offload on the 2 that wrote it. Its last checkpoint, exported without
launching (scripts/export_checkpoint.py), equals its final/ export, in fp32 and in bf16.

bf16, as the configs ask: each strategy fine-tunes a checkpoint saved in bf16 with
fp32 master weights and bf16 compute, stays within a stated tolerance of a
single-process bf16 run, keeps fp32 optimizer states in its checkpoint and exports
bf16 weights (the checkpoint's dtype) equal to the reference's within tolerance; fsdp, zero2
and zero3 resume it on 1 process within the same tolerance of the run on 2.

Every run's memory account (common/training/memory.py, run.json) holds, on every rank and in each
model-state category, the bytes scripts/estimate_memory.py predicts for that run's world
size, precision and accumulation, to within MODEL_STATE_TOLERANCE: all ten configs in fp32
and in bf16 on 2 processes, and the eight resumed on 1 or 4 (tests/test_memory.py: peaks, at
101M).

A ZeRO-3 checkpoint written with another sub_group_size (its flat partitions cut otherwise)
resumes through its universal conversion and continues exactly.
"""

import json
import math

import pytest
import torch
from conftest import (
    CONFIGS,
    FP32,
    SAVE_AT,
    STEPS,
    assert_same_hf_folder,
    causal_lm_args,
    export_checkpoint,
    launch,
    load_weights,
    losses,
    max_weight_difference,
    model_state_gaps,
    optimizer_state_dtypes,
    pretrained_args,
    read_metrics,
    read_run,
    resume_elsewhere,
    tiered,
)


# config -> (distributed type, parameters sharded?)
STRATEGIES = {
    "ddp.yaml": ("MULTI_CPU", False),
    "fsdp.yaml": ("FSDP", True),
    "fsdp_shard_grad_op.yaml": ("FSDP", True),
    "fsdp_offload.yaml": ("FSDP", True),
    "zero1.yaml": ("DEEPSPEED", False),
    "zero2.yaml": ("DEEPSPEED", False),
    "zero2_offload.yaml": ("DEEPSPEED", False),
    "zero2_json.yaml": ("DEEPSPEED", False),
    "zero3.yaml": ("DEEPSPEED", True),
    "zero3_offload.yaml": ("DEEPSPEED", True),
}
FP32_TOLERANCE = 1e-5  # per-step loss and final weights vs the single-process run
# bf16 (8 significant bits): bf16 compute and, under FSDP2/DeepSpeed, bf16 gradient reduction.
BF16_LOSS_TOLERANCE = 2e-2  # per-step loss vs single-process bf16 (losses about 3.9)
# Exported bf16 weights vs single-process bf16, as the size of the difference between the two
# runs' weight updates (final - initial, all tensors) relative to the reference's update.
BF16_UPDATE_TOLERANCE = 0.05  # seen: 0.005 (ddp) to 0.009 (fsdp, zero2, zero3)
# Counted vs estimated model-state bytes per category and rank (seen at most 0.037: ZeRO-1/2's
# bf16 copy is padded to the partition alignment, which matters at this size only)
MODEL_STATE_TOLERANCE = 0.05
# config -> processes its stopped run resumes on (the checkpoint was written by 2); the others resume on 2.
RESUME_PROCESSES = {
    "ddp.yaml": 4,
    "fsdp.yaml": 4,
    "fsdp_offload.yaml": 1,
    "zero1.yaml": 1,
    "zero2.yaml": 1,
    "zero2_json.yaml": 1,
    "zero3.yaml": 4,
    "zero3_offload.yaml": 1,
}
# config -> processes its bf16 run resumes on (from the step-6 checkpoint its 2 processes wrote)
BF16_RESUME_PROCESSES = {"fsdp.yaml": 1, "zero2.yaml": 1, "zero3.yaml": 1}
# make test: these two in fp32 against one process (resumed on 4: FSDP2's DCP resharding, DeepSpeed's universal
# checkpoint), and in bf16 zero2 (resumed on 1); make test-all: every config both ways. (DDP against one process in
# make test: tests/test_numerics.py's SFT and tests/test_causal_lm.py.)
FP32_IN_MAKE_TEST = ["fsdp.yaml", "zero3.yaml"]
BF16_IN_MAKE_TEST = ["zero2.yaml"]
FSDP_FLAGS = {
    "fsdp.yaml": ("True", False, False),
    "fsdp_shard_grad_op.yaml": ("False", False, False),
    "fsdp_offload.yaml": ("True", True, True),
}


def deepspeed_json_config(tmp_path, name: str, ds: dict, zero3_init: bool = False):
    """zero2_json.yaml with its DeepSpeed JSON replaced by `ds` (tmp_path/name.json, .yaml)."""
    (tmp_path / f"{name}.json").write_text(json.dumps(ds))
    yaml_text = (
        (CONFIGS / "zero2_json.yaml")
        .read_text()
        .replace("accelerate_configs/deepspeed/zero2_auto.json", str(tmp_path / f"{name}.json"))
    )
    if zero3_init:
        yaml_text = yaml_text.replace("zero3_init_flag: false", "zero3_init_flag: true")
    assert str(tmp_path) in yaml_text and ("zero3_init_flag: true" in yaml_text) == zero3_init
    (tmp_path / f"{name}.yaml").write_text(yaml_text)
    return tmp_path / f"{name}.yaml"


def fp32_launch(config: str, tmp_path) -> tuple:
    """(config, launcher flags) for an fp32 run. zero2_json.yaml's precision lives in its
    DeepSpeed JSON (accelerate refuses --mixed_precision beside it): use a copy with bf16 off."""
    if config != "zero2_json.yaml":
        return config, FP32
    ds = json.loads((CONFIGS / "deepspeed" / "zero2_auto.json").read_text())
    ds["bf16"]["enabled"] = False
    return deepspeed_json_config(tmp_path, "zero2_fp32", ds), []


def assert_two_processes(record, config):
    assert record["distributed_type"] == STRATEGIES[config][0]
    assert record["world_size"] == 2 and record["participating_processes"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(STRATEGIES, FP32_IN_MAKE_TEST))
def test_strategy_matches_single_process(config, markov_data, reference, tmp_path):
    out = tmp_path / "run"
    args = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS, save_steps=SAVE_AT)
    config_file, precision = fp32_launch(config, tmp_path)
    launch(config_file, "causal_lm.py", causal_lm_args(markov_data, out, **args), launcher_args=precision)
    record = read_run(out)
    assert_two_processes(record, config)
    assert record["compute_dtype"] == "float32" and record["effective_batch_size"] == 8

    total, local = record["total_parameters"], record["local_parameter_elements"]
    print(f"{config}: local parameter elements per rank {local} of {total}")
    if STRATEGIES[config][1]:  # each rank stores about half (FSDP and ZeRO-3 pad shards a little)
        assert all(0.45 * total <= n <= 0.55 * total for n in local), (local, total)
        assert sum(local) >= total
    else:
        assert local == [total, total]
    assert_model_state_as_estimated(out, CONFIGS / config_file)

    mine, ref = losses(out), losses(reference)
    loss_gap = max(abs(a - b) for a, b in zip(mine, ref))
    weight_gap = max_weight_difference(out / "final", reference / "final")
    print(f"{config}: max loss gap {loss_gap:.2e}, max final-weight gap {weight_gap:.2e} (fp32, accumulation 2)")
    assert len(mine) == STEPS and loss_gap < FP32_TOLERANCE
    assert weight_gap < FP32_TOLERANCE  # same initial weights (ZeRO-3's zero.Init too) and the same training
    # The last checkpoint, exported without launching (scripts/export_checkpoint.py), is final/.
    assert_same_hf_folder(
        export_checkpoint(out / "checkpoints" / f"step_{STEPS}", tmp_path / "exported"), out / "final"
    )

    # Resume: a run that stopped after its step-6 checkpoint, its metrics logged on to step 8,
    # continues identically, and steps 7 and 8 are logged once (by the resumed run). On another
    # world size the global batch stays 8 (2 per device, accumulation 8 / (2 x processes)).
    processes = RESUME_PROCESSES.get(config, 2)
    stopped = tmp_path / "stopped"
    checkpoint = stopped / "checkpoints" / f"step_{SAVE_AT}"
    saved_files = sorted(
        p.relative_to(out / "checkpoints" / f"step_{SAVE_AT}")
        for p in (out / "checkpoints" / f"step_{SAVE_AT}").rglob("*")
    )
    result = stop_and_resume(
        out,
        stopped,
        processes,
        config_file,
        precision,
        lambda **resume: causal_lm_args(markov_data, stopped, **dict(args, **resume)),
    )
    assert_model_state_as_estimated(stopped, CONFIGS / config_file)
    assert f"resumed from {checkpoint}" in result.stdout + result.stderr
    universal = checkpoint / "universal"
    if processes != 2 and STRATEGIES[config][0] == "DEEPSPEED":  # converted once, beside the original
        assert (universal / "pytorch_model" / "zero" / "optimizer_state.pt").is_file()
    else:
        assert not universal.exists()
    assert (
        sorted(
            p.relative_to(checkpoint) for p in checkpoint.rglob("*") if universal not in p.parents and p != universal
        )
        == saved_files
    )
    rows = read_metrics(stopped)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    resumed = rows[SAVE_AT:]
    assert (stopped / "checkpoints" / f"step_{STEPS}").is_dir()
    resume_gap = max(abs(a - r["loss"]) for a, r in zip(mine[SAVE_AT:], resumed))
    lr_gap = max(abs(a["lr"] - r["lr"]) for a, r in zip(read_metrics(out)[0][SAVE_AT:], resumed))
    print(f"{config}: max resumed-loss gap {resume_gap:.2e} on {processes} processes, lr gap {lr_gap:.1e}")
    assert resume_gap < FP32_TOLERANCE and lr_gap < 1e-12
    assert max_weight_difference(stopped / "final", out / "final") < FP32_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(STRATEGIES, BF16_IN_MAKE_TEST))
@pytest.mark.bf16
def test_bf16_fine_tuning_of_a_bf16_checkpoint(config, markov_data, bf16_checkpoint, bf16_reference, tmp_path):
    out = tmp_path / "run"
    args = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS, save_steps=SAVE_AT)
    launch(config, "causal_lm.py", pretrained_args(markov_data, bf16_checkpoint, out, **args))
    record, reference_record = read_run(out), read_run(bf16_reference)
    assert_two_processes(record, config)
    for run in (record, reference_record):  # fp32 master weights from a bf16 file; bf16 compute
        assert (run["compute_dtype"], run["master_weights_dtype"], run["optimizer_states_dtype"]) == (
            "bfloat16",
            "float32",
            "float32",
        ), run
    if config.startswith("zero3"):  # two layers' worth of live parameters, from the checkpoint's config (hidden 64)
        assert record["zero3_max_live_parameters"] == 24 * 64 * 64
    if config in FSDP_FLAGS:  # the YAML's FSDP settings reach the run (never silently DDP)
        assert (
            record["fsdp_reshard_after_forward"],
            record["fsdp_offload_params"],
            record["fsdp_activation_checkpointing"],
        ) == FSDP_FLAGS[config]
        assert record["sync_each_micro_batch"] is True  # gradients stay sharded while accumulating

    # The memory account (common.training.memory): each rank's parameter bytes are its share of the
    # elements in the dtype it keeps them in (fp32 master weights; DeepSpeed's bf16 model copy)
    element_bytes = 2 if STRATEGIES[config][0] == "DEEPSPEED" else 4
    accounts = record["memory_per_rank"]
    assert len(accounts) == 2
    for account, elements in zip(accounts, record["local_parameter_elements"]):
        parameter_bytes = sum(account["bytes_by_category"]["parameters"].values())
        assert parameter_bytes == pytest.approx(elements * element_bytes, rel=0.1), account
        assert account["optimizer_states_mb"] > 0 and account["gradients_mb"] > 0, account
    assert_model_state_as_estimated(out, CONFIGS / config)

    mine, ref = losses(out), losses(bf16_reference)
    assert len(mine) == STEPS and all(math.isfinite(x) for x in mine) and mine[-1] < mine[0]
    loss_gap = max(abs(a - b) for a, b in zip(mine, ref))

    for run in (out, bf16_reference):
        assert optimizer_state_dtypes(run / "checkpoints" / f"step_{STEPS}") == {torch.float32}
        weights = load_weights(run / "final")
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}
        assert json.loads((run / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    weight_gap = max_weight_difference(out / "final", bf16_reference / "final")
    assert_same_hf_folder(
        export_checkpoint(out / "checkpoints" / f"step_{STEPS}", tmp_path / "exported"), out / "final"
    )
    print(
        f"{config}: bf16 max loss gap {loss_gap:.2e} (tolerance {BF16_LOSS_TOLERANCE}), exported bf16 weight gap "
        f"{weight_gap:.2e}; reduce dtype {record['gradient_reduce_dtype']}"
    )
    assert loss_gap < BF16_LOSS_TOLERANCE
    update_gap = relative_update_difference(out / "final", bf16_reference / "final", bf16_checkpoint)
    print(f"{config}: bf16 weight updates differ from the reference's by {update_gap:.3f} of their size")
    assert update_gap < BF16_UPDATE_TOLERANCE

    # Resumed from its step-6 checkpoint on another world size (bf16 reductions in another order)
    if config in BF16_RESUME_PROCESSES:
        stopped, processes = tmp_path / "stopped", BF16_RESUME_PROCESSES[config]
        stop_and_resume(
            out,
            stopped,
            processes,
            config,
            [],
            lambda **resume: pretrained_args(markov_data, bf16_checkpoint, stopped, **dict(args, **resume)),
        )
        resumed = read_metrics(stopped)[0][SAVE_AT:]
        resume_gap = max(abs(a - r["loss"]) for a, r in zip(mine[SAVE_AT:], resumed))
        print(f"{config}: bf16 resumed on {processes} process(es): max loss gap {resume_gap:.2e} to the run on 2")
        assert [r["step"] for r in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
        assert resume_gap < BF16_LOSS_TOLERANCE


def stop_and_resume(out, stopped, processes: int, config, launcher_args, recipe_args):
    """Resume the run's step-SAVE_AT checkpoint, with its metrics logged to step SAVE_AT + 2, on
    `processes`, the global batch kept at 8 (accumulation 8 / (2 x processes))."""
    return resume_elsewhere(
        out,
        stopped,
        SAVE_AT,
        processes,
        config,
        "causal_lm.py",
        recipe_args,
        8 // (2 * processes),
        launcher_args,
        logged_rows=SAVE_AT + 2,
    )


def assert_model_state_as_estimated(out, config_file):
    record = read_run(out)
    gaps = model_state_gaps(out, config_file)
    print(
        f"{config_file.name} on {record['participating_processes']}, {record['compute_dtype']}, accumulation "
        f"{record['args']['gradient_accumulation_steps']}: model state vs estimate, largest gap per category "
        + ", ".join(f"{k} {v:.4f}" for k, v in gaps.items())
    )
    assert max(gaps.values()) < MODEL_STATE_TOLERANCE, gaps


def relative_update_difference(final, reference_final, initial) -> float:
    """||(final - initial) - (reference - initial)|| / ||reference - initial||, over all tensors."""
    mine, reference, start = load_weights(final), load_weights(reference_final), load_weights(initial)
    assert mine.keys() == reference.keys() == start.keys()
    difference = sum(float((mine[k].float() - reference[k].float()).pow(2).sum()) for k in mine)
    update = sum(float((reference[k].float() - start[k].float()).pow(2).sum()) for k in mine)
    return math.sqrt(difference / update)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_zero3_checkpoint_of_another_sub_group_size_resumes_through_its_universal_conversion(markov_data, tmp_path):
    """ZeRO-3's flat optimizer partitions are cut into sub-groups of sub_group_size elements, so a
    checkpoint from a run with another size (e.g. one written before common.launch.accelerator set it)
    does not load as it is: it is converted, as for another world size, and continues exactly.
    The JSON leaves out stage3_gather_16bit_weights_on_model_save, as users' often do: the final
    export gathers the fp32 master weights itself and needs no 16-bit copy."""
    ds = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": 3, "sub_group_size": 1000},
    }
    writer = deepspeed_json_config(tmp_path, "zero3_small_groups", ds, zero3_init=True)
    out, stopped, steps = tmp_path / "run", tmp_path / "stopped", 8
    args = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps, save_steps=4)
    launch(writer, "causal_lm.py", causal_lm_args(markov_data, out, **args))
    saved = json.loads((out / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert read_run(out)["zero3_sub_group_size"] == saved["zero3_sub_group_size"] == 1000
    # its many small sub-groups export (DeepSpeed's zero_to_fp32) to the run's own final/
    assert_same_hf_folder(
        export_checkpoint(out / "checkpoints" / f"step_{steps}", tmp_path / "exported"), out / "final"
    )

    result = resume_elsewhere(
        out,
        stopped,
        4,
        2,
        "zero3.yaml",
        "causal_lm.py",
        lambda **resume: causal_lm_args(markov_data, stopped, **dict(args, **resume)),
        2,
        FP32,
        logged_rows=4,
    )
    assert "with ZeRO-3 sub_group_size 1000 (this run: 10000000)" in result.stdout + result.stderr
    # converted by rank 0 before the process group started (no collective waited on it)
    assert f"converting {stopped / 'checkpoints' / 'step_4'} for 2 processes" in result.stderr
    assert (
        stopped / "checkpoints" / "step_4" / "universal" / "pytorch_model" / "zero" / "optimizer_state.pt"
    ).is_file()
    assert read_run(stopped)["zero3_sub_group_size"] == 10_000_000
    gap = max(abs(a - b) for a, b in zip(losses(out)[4:], losses(stopped)[4:]))
    print(f"zero3, sub_group_size 1000 -> 1e7 on 2 processes: max resumed-loss gap {gap:.2e}")
    assert len(losses(stopped)) == steps and gap < FP32_TOLERANCE
