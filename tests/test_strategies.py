"""Every shipped accelerate config that runs on CPU, launched for real on 2 processes.

Each strategy starts from the same saved initial model and data order as a
single-process reference run with the same global batch, and must reproduce its
per-step losses and final weights, shard what it claims to shard, export a
loadable model, and resume to the same losses.
"""

import shutil

import pytest

from conftest import STEPS, SAVE_AT, launch, losses, max_weight_difference, pretrained_args, read_metrics, read_run

# config -> (distributed type, parameters sharded?, loss tolerance, weight tolerance), all fp32.
STRATEGIES = {
    "ddp.yaml": ("MULTI_CPU", False, 1e-5, 1e-5),
    "fsdp.yaml": ("FSDP", True, 1e-5, 1e-5),
    "fsdp_shard_grad_op.yaml": ("FSDP", True, 1e-5, 1e-5),
    "fsdp_offload.yaml": ("FSDP", True, 1e-5, 1e-5),
    "zero1.yaml": ("DEEPSPEED", False, 1e-5, 1e-5),
    "zero2.yaml": ("DEEPSPEED", False, 1e-5, 1e-5),
    "zero2_offload.yaml": ("DEEPSPEED", False, 1e-5, 1e-5),
    "zero2_json.yaml": ("DEEPSPEED", False, 1e-5, 1e-5),
    "zero3.yaml": ("DEEPSPEED", True, 1e-5, 1e-5),
    "zero3_offload.yaml": ("DEEPSPEED", True, 1e-5, 1e-5),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(STRATEGIES))
def test_strategy_matches_single_process(config, markov_data, initial_model, reference, tmp_path):
    distributed_type, sharded, loss_tol, weight_tol = STRATEGIES[config]
    out = tmp_path / "run"
    launch(config, "causal_lm.py", pretrained_args(markov_data, initial_model, out,
                                                   per_device_train_batch_size=4, max_steps=STEPS, save_steps=SAVE_AT))
    record = read_run(out)
    assert record["distributed_type"] == distributed_type
    assert record["world_size"] == 2 and record["participating_processes"] == 2

    total, local = record["total_parameters"], record["local_parameter_elements"]
    print(f"{config}: local parameter elements per rank {local} of {total}")
    if sharded:  # each rank stores about half (FSDP and ZeRO-3 pad shards a little)
        assert all(0.45 * total <= n <= 0.55 * total for n in local), (local, total)
        assert sum(local) >= total
    else:
        assert local == [total, total]

    mine, ref = losses(out), losses(reference)
    loss_gap = max(abs(a - b) for a, b in zip(mine, ref))
    weight_gap = max_weight_difference(out / "final", reference / "final")
    print(f"{config}: max loss gap {loss_gap:.2e}, max final-weight gap {weight_gap:.2e}")
    assert len(mine) == STEPS and loss_gap < loss_tol
    assert weight_gap < weight_tol  # the export holds the full, trained weights

    # Resume: a run that stopped right after its step-6 checkpoint continues identically.
    stopped = tmp_path / "stopped"
    shutil.copytree(out / "checkpoints" / f"step_{SAVE_AT}", stopped / "checkpoints" / f"step_{SAVE_AT}")
    launch(config, "causal_lm.py", pretrained_args(markov_data, initial_model, stopped, per_device_train_batch_size=4,
                                                   max_steps=STEPS, save_steps=SAVE_AT, resume_from_checkpoint="latest"))
    resumed = read_metrics(stopped)[0]
    assert [r["step"] for r in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
    resume_gap = max(abs(a - r["loss"]) for a, r in zip(mine[SAVE_AT:], resumed))
    print(f"{config}: max resumed-loss gap {resume_gap:.2e}")
    assert resume_gap < loss_tol
    assert max_weight_difference(stopped / "final", out / "final") < weight_tol


@pytest.mark.slow
def test_fsdp_is_never_silently_ddp(markov_data, initial_model, tmp_path):
    """The FSDP plugin settings from the YAML reach the run: reshard and offload flags differ per file."""
    seen = {}
    for config in ("fsdp.yaml", "fsdp_shard_grad_op.yaml", "fsdp_offload.yaml"):
        out = tmp_path / config
        launch(config, "causal_lm.py", pretrained_args(markov_data, initial_model, out, max_steps=1))
        record = read_run(out)
        seen[config] = (record["fsdp_reshard_after_forward"], record["fsdp_offload_params"],
                        record["fsdp_activation_checkpointing"])
    assert seen == {"fsdp.yaml": ("True", False, False), "fsdp_shard_grad_op.yaml": ("False", False, False),
                    "fsdp_offload.yaml": ("True", True, True)}
