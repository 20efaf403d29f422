"""Rows split across ranks from the config, launched for real over gloo: zero3_ulysses.yaml (2 processes, one
Ulysses group under ZeRO-3) and fsdp_cp.yaml (2 processes, one ring-attention group under FSDP2): each rank
trains on half of every row's tokens. Each test below runs under both unless it names one.

fp32 parity: the pair shares 4 x accumulation 2 per step (global batch 8, as the single-process reference's
1 x 8), from the same seeded model; it must reproduce the reference's per-step losses, evaluation and final
weights within FP32_TOLERANCE (Ulysses: each rank holding slices of 16 of the 32 tokens, recorded by the run;
the ring: the loss is the reference's only if each rank's share of the targets is), and the memory account's
model state as scripts/estimate_memory.py predicts it; on 4 processes, two such pairs (dp_shard_size 2) as
well. final/ loads with from_pretrained and gives the reference's logits. Resumed from its checkpoints it continues bit for bit under its own config, at
another split of the same global batch (8 x accumulation 1: under Ulysses the resume stops inside one rank's
batch), and under zero3.yaml / fsdp.yaml (the same checkpoint files, no split). bf16: fine-tuning a checkpoint
saved in bf16 stays within the bf16 tolerance of the single-process bf16 run and exports bf16. SFT on
variable-length chats: tests/test_numerics.py. What it cannot run is refused in one line.
"""

import json
import shutil

import pytest
import torch
from conftest import (
    CONFIGS,
    FP32,
    REPO,
    STEPS,
    LaunchedOnce,
    causal_lm_args,
    flags,
    launch,
    load_script,
    load_weights,
    losses,
    max_weight_difference,
    model_state_gaps,
    pretrained_args,
    read_metrics,
    read_run,
    tiered,
)
from test_strategies import BF16_LOSS_TOLERANCE, FP32_TOLERANCE, MODEL_STATE_TOLERANCE
from test_tensor_parallel import epochs_with_a_remainder_step_as_one_process, launch_refused

from common.launch.errors import UsageError
from common.launch.mesh import mesh_problems
from common.parallel.sequence_parallel import SplittableRows


CONFIG, RING = "zero3_ulysses.yaml", "fsdp_cp.yaml"
SPLITS = (CONFIG, RING)
UNSPLIT = {CONFIG: "zero3.yaml", RING: "fsdp.yaml"}  # the same checkpoint files, rows whole
RUN = dict(
    per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=STEPS, save_steps=3, save_total_limit=4
)


def assert_split(record, config, groups=1):
    assert record["world_size"] == record["participating_processes"] == 2 * groups
    if config == CONFIG:
        assert record["launched_strategy"] == "deepspeed" and record["zero_stage"] == 3
        assert record["device_mesh"] == {"sp": 2, "dp": groups}
        assert record["sequence_parallel"] == {"sp_size": 2, "slice_tokens": 16}  # each rank half of a 32-token row
    else:
        assert record["launched_strategy"] == "fsdp" and record["fsdp_version"] == 2
        assert record["device_mesh"] == ({"cp": 2} if groups == 1 else {"dp_shard": groups, "cp": 2})
        assert record["shared_batch_groups_checked"] == groups  # each ring's ranks were handed the same batch
    assert record["effective_batch_size"] == 8  # the group's batch counted once


@pytest.fixture(scope="module")
def trained_runs(markov_data, tmp_path_factory) -> LaunchedOnce:
    """Each config's fp32 run: global batch 8 as 4 x accumulation 2, checkpoints every 3 steps."""

    def trained_run(config):
        out = tmp_path_factory.mktemp(config.split(".")[0]) / "run"
        launch(config, "causal_lm.py", causal_lm_args(markov_data, out, **RUN), launcher_args=FP32)
        return out

    return LaunchedOnce(trained_run)


@pytest.fixture(params=SPLITS)
def trained(request, trained_runs):
    """(config, its fp32 run), the run launched once for every test that reads it, in whatever order they run
    (the resumes parametrize this fixture themselves)."""
    return request.param, trained_runs[request.param]


@pytest.mark.slow
def test_sequence_parallel_matches_single_process(trained, reference):
    CONFIG, trained = trained
    record = read_run(trained)
    assert_split(record, CONFIG)
    assert record["compute_dtype"] == "float32"
    gaps = model_state_gaps(trained, CONFIGS / CONFIG)
    print(
        f"{CONFIG}: model state vs estimate, largest gap per category "
        + ", ".join(f"{k} {v:.4f}" for k, v in gaps.items())
    )
    assert max(gaps.values()) < MODEL_STATE_TOLERANCE, gaps

    mine, ref = losses(trained), losses(reference)
    loss_gap = max(abs(a - b) / b for a, b in zip(mine, ref))
    weight_gap = max_weight_difference(trained / "final", reference / "final")
    evaluation, ref_evaluation = read_metrics(trained)[1][-1], read_metrics(reference)[1][-1]
    print(
        f"{CONFIG}: max relative loss gap {loss_gap:.2e}, max final-weight gap {weight_gap:.2e}, eval loss "
        f"{evaluation['eval_loss']:.6f} vs {ref_evaluation['eval_loss']:.6f} (fp32, accumulation 2)"
    )
    assert len(mine) == STEPS and loss_gap < FP32_TOLERANCE and weight_gap < FP32_TOLERANCE
    assert mine != ref  # two processes, not a copy of the reference
    assert evaluation["eval_tokens"] == ref_evaluation["eval_tokens"]  # every evaluation example once, whole
    assert abs(evaluation["eval_loss"] - ref_evaluation["eval_loss"]) < FP32_TOLERANCE


@pytest.mark.slow
def test_sequence_parallel_exports_the_single_process_model(trained, reference):
    from transformers import AutoModelForCausalLM

    CONFIG, trained = trained
    config = json.loads((trained / "final" / "config.json").read_text())
    assert "ulysses" not in json.dumps(config).lower()  # DeepSpeed's attention wrapper stays out of the export
    vocab = config["vocab_size"]
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = [
        AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        for folder in (trained / "final", reference / "final")
    ]
    gap = (logits[0] - logits[1]).abs().max().item()
    print(f"{CONFIG}: final/ loaded with from_pretrained, logits gap to the single-process model {gap:.2e}")
    assert gap < 1e-4


# (config or None for the run's own, per-device batch, accumulation, step resumed from)
RESUMES = [(None, 4, 2, 6), (None, 8, 1, 3), ("unsplit", 2, 2, 6)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "trained, config, batch, accumulation, step",
    tiered(
        [(split, *resume) for split in SPLITS for resume in RESUMES],
        # make test: Ulysses bit for bit under its own layout, the ring under fsdp.yaml; make test-all: each way
        [(CONFIG, *RESUMES[0]), (RING, *RESUMES[2])],
    ),
    ids=[f"{split}-{name}" for split in SPLITS for name in ("same layout", "8x1 inside a batch", "unsplit")],
    indirect=["trained"],
)
def test_sequence_parallel_checkpoint_resumes(trained, markov_data, tmp_path, config, batch, accumulation, step):
    """From step 6 under its own layout: bit for bit. From step 3 at 8 x accumulation 1: under Ulysses the
    adapter's first micro-batch after the resume is the second slice pair of a rank's batch (3 of them done: one
    whole batch skipped, then one slice pair read and passed over). Under zero3.yaml / fsdp.yaml: the same
    partitions, rows whole."""
    CONFIG, trained = trained
    config = UNSPLIT[CONFIG] if config == "unsplit" else config or CONFIG
    out = tmp_path / "run"
    shutil.copytree(trained / "checkpoints" / f"step_{step}", tmp_path / "step")
    args = causal_lm_args(
        markov_data,
        out,
        **{
            **RUN,
            "per_device_train_batch_size": batch,
            "save_steps": 0,
            "gradient_accumulation_steps": accumulation,
            "resume_from_checkpoint": tmp_path / "step",
        },
    )
    launch(config, "causal_lm.py", args, launcher_args=FP32)
    assert read_run(out)["participating_processes"] == 2
    resumed, uninterrupted = losses(out), losses(trained)[step:]
    gap = max(abs(a - b) / b for a, b in zip(resumed, uninterrupted))
    weight_gap = max_weight_difference(out / "final", trained / "final")
    print(
        f"{CONFIG} step {step} resumed under {config} {batch}x{accumulation}: relative loss gap {gap:.2e}, "
        f"weight gap {weight_gap:.2e}"
    )
    assert len(resumed) == STEPS - step
    if (config, batch) == (CONFIG, RUN["per_device_train_batch_size"]):
        assert resumed == uninterrupted and weight_gap == 0.0
    assert gap < FP32_TOLERANCE and weight_gap < FP32_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(SPLITS, [RING]))
@pytest.mark.bf16
def test_sequence_parallel_bf16_fine_tuning(markov_data, bf16_checkpoint, bf16_reference, tmp_path, config):
    CONFIG, out = config, tmp_path / "run"
    launch(CONFIG, "causal_lm.py", pretrained_args(markov_data, bf16_checkpoint, out, **{**RUN, "save_steps": STEPS}))
    record = read_run(out)
    assert_split(record, CONFIG)
    assert record["compute_dtype"] == "bfloat16" and record["master_weights_dtype"] == "float32"
    gap = max(abs(a - b) for a, b in zip(losses(out), losses(bf16_reference)))
    print(f"{CONFIG} bf16: max loss gap to one process in bf16 {gap:.2e}")
    assert len(losses(out)) == STEPS and gap < BF16_LOSS_TOLERANCE
    assert {t.dtype for t in load_weights(out / "final").values()} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(SPLITS, []))
def test_what_sequence_parallelism_cannot_run_is_one_line(markov_data, arithmetic_data, tmp_path, config):
    CONFIG, base = config, causal_lm_args(markov_data, tmp_path / "run", max_steps=1)
    if CONFIG == "zero3_ulysses.yaml":  # ring attention splits the sequence, not the heads
        three_heads = json.loads((REPO / "recipes/configs/tiny_llama.json").read_text())
        three_heads.update(hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
        (tmp_path / "three_heads.json").write_text(json.dumps(three_heads))
        line = launch_refused(CONFIG, base + flags(model_config=tmp_path / "three_heads.json"))
        assert "sp_size 2: the model has 3 attention heads, which do not divide by it" in line
    line = launch_refused(CONFIG, base + flags(attn_implementation="eager"))
    assert "--attn_implementation eager under sequence/context parallelism, which runs sdpa" in line
    sft = flags(
        config=REPO / "recipes/configs/sft_demo.yaml",
        tokenizer_name_or_path=arithmetic_data / "tokenizer",
        train_file=arithmetic_data / "train.jsonl",
        validation_file=arithmetic_data / "validation.jsonl",
        output_dir=tmp_path / "sft",
        max_steps=1,
        packing="true",
    )
    assert "--packing under sequence/context parallelism" in launch_refused(CONFIG, sft, recipe="sft.py")
    dpo = flags(
        config=REPO / "recipes/configs/dpo_demo.yaml",
        output_dir=tmp_path / "dpo",
        max_steps=1,
        tokenizer_name_or_path=markov_data / "tokenizer",
        train_file=markov_data / "train.jsonl",
        validation_file=markov_data / "validation.jsonl",
    )  # refused before the data is read
    assert "while this recipe scores each answer's log-probability" in launch_refused(CONFIG, dpo, recipe="dpo.py")
    assert not list(tmp_path.glob("*/final"))


def test_sequence_parallelism_runs_under_deepspeed_only():
    problems = mesh_problems({"sp": 2}, 2, "FSDP", True, False)
    assert problems and "sequence parallelism (Ulysses) runs under DeepSpeed, not FSDP" in problems[0]
    assert mesh_problems({"sp": 2}, 2, "DEEPSPEED", False, False) == []
    assert mesh_problems({"sp": 2, "dp_shard": 2}, 4, "DEEPSPEED", False, False) == []  # 2 groups of 2
    assert "= 2 processes but num_processes is 4" in mesh_problems({"sp": 2}, 4, "DEEPSPEED", False, False)[0]
    assert (
        "with ZeRO stage 2: the recipes' sequence parallelism is proven under ZeRO-3 only"
        in mesh_problems({"sp": 2}, 2, "DEEPSPEED", False, False, zero_stage=2)[0]
    )


def test_context_parallelism_runs_under_fsdp2_only():
    assert mesh_problems({"cp": 2}, 2, "FSDP", True, True) == []
    assert mesh_problems({"cp": 2, "dp_shard": 2}, 4, "FSDP", True, True) == []  # 2 rings of 2
    for kind, fsdp2 in (("DEEPSPEED", False), ("MULTI_GPU", False), ("FSDP", False)):
        problems = mesh_problems({"cp": 2}, 2, kind, fsdp2, False)
        assert problems and f"context parallelism (torch's ring attention) runs under FSDP2, not {kind}" in problems[0]
    assert "beside parallelism_config_tp_size" in mesh_problems({"cp": 2, "tp": 2}, 4, "FSDP", True, False)[0]
    assert (
        "fsdp_cp.yaml: dp_shard_size = num_processes / cp_size" in mesh_problems({"cp": 2}, 4, "FSDP", True, False)[0]
    )


def test_check_config_names_what_the_recipe_yaml_asks_that_sequence_parallelism_cannot_run():
    check_config = load_script("scripts/check_config.py")
    problems = check_config.check_mesh(
        {"parallelism_config_sp_size": 2},
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}},
        {},
        {"packing": True},
        2,
    )
    assert problems == [
        "--packing under sequence/context parallelism: packed rows need attention kept within each example, "
        "which the exchange does not keep; pass --packing false"
    ]
    assert (
        check_config.check_mesh(
            {"parallelism_config_sp_size": 2}, {"distributed_type": "DEEPSPEED"}, {}, {"packing": False}, 2
        )
        == []
    )
    for recipe, scores in (
        ("dpo_demo", "each answer's log-probability"),
        ("sequence_classification_demo", "one class per example"),
    ):
        problems = check_config.check(str(CONFIGS / RING), str(REPO / f"recipes/configs/{recipe}.yaml"))
        assert len(problems) == 1 and f"while this recipe scores {scores}: use zero3.yaml or fsdp.yaml" in problems[0]
    assert check_config.check(str(CONFIGS / RING), str(REPO / "recipes/configs/lora_demo.yaml")) == []
    assert (
        "zero3_ulysses.yaml: dp_shard_size = num_processes / sp_size"
        in mesh_problems({"sp": 2}, 4, "DEEPSPEED", False, False, zero_stage=3)[0]
    )


def test_a_slice_is_counted_with_the_flops_of_attending_to_the_whole_row():
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.training.flops import ModelFlops

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    whole, sliced = ModelFlops(model), ModelFlops(model, shards=2)
    half_row = {"input_ids": torch.zeros(3, 16, dtype=torch.long)}
    assert sliced.per_batch(half_row) == 3 * 16 * whole.per_token(32) > whole.per_batch(half_row)
    assert 2 * sliced.per_batch(half_row) == whole.per_batch({"input_ids": torch.zeros(3, 32, dtype=torch.long)})


def test_rows_are_padded_at_the_end_to_a_multiple_of_the_split():
    rows = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]),
        "labels": torch.tensor([[-100, 6, 7, 8, 9], [-100, 6, 7, -100, -100]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    }
    batch = SplittableRows(lambda examples: dict(rows), 4)(None)
    assert "attention_mask" not in batch and batch["input_ids"].shape == (2, 8)
    assert batch["labels"][:, 5:].eq(-100).all() and batch["labels"][:, :5].equal(rows["labels"])
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    left = {**rows, "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])}
    with pytest.raises(UsageError, match="padding at the end of each row"):
        SplittableRows(lambda examples: dict(left), 2)(None)
    ring = SplittableRows(lambda examples: dict(rows), 4, shifted=True)(None)  # fsdp_cp.yaml: 2 x cp_size
    assert "shift_labels" not in batch and ring["shift_labels"].tolist() == [  # targets shifted on the whole row
        [6, 7, 8, 9, -100, -100, -100, -100],
        [6, 7, -100, -100, -100, -100, -100, -100],
    ]


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(SPLITS, [CONFIG]))
@pytest.mark.exhaustive
def test_lora_under_sequence_parallelism_trains_the_single_process_adapter(markov_data, tmp_path, config):
    """--use_peft: the frozen base's slices and the adapters' gradients reduced as the full model's are."""
    CONFIG, runs = config, {"single.yaml": (8, 1), config: (4, 2)}
    for config, (batch, accumulation) in runs.items():
        launch(
            config,
            "causal_lm.py",
            causal_lm_args(
                markov_data,
                tmp_path / config,
                per_device_train_batch_size=batch,
                gradient_accumulation_steps=accumulation,
                max_steps=8,
                use_peft="true",
                learning_rate=1e-2,
            ),
            launcher_args=FP32,
        )
    assert read_run(tmp_path / CONFIG).get("sequence_parallel", {"slice_tokens": 16})["slice_tokens"] == 16
    mine, ref = losses(tmp_path / CONFIG), losses(tmp_path / "single.yaml")
    loss_gap = max(abs(a - b) / b for a, b in zip(mine, ref))
    adapter_gap = max_weight_difference(tmp_path / CONFIG / "final", tmp_path / "single.yaml" / "final")
    print(f"LoRA under {CONFIG}: relative loss gap {loss_gap:.2e}, adapter weight gap {adapter_gap:.2e}")
    assert len(mine) == 8 and mine[-1] < mine[0] and loss_gap < FP32_TOLERANCE
    assert adapter_gap < 2e-5  # Adam's division by a second moment near 0 (seen: 6.4e-6)


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(SPLITS, [RING]))
@pytest.mark.exhaustive
def test_epochs_with_a_remainder_under_sequence_parallelism_step_as_one_process(tmp_path, config):
    """3 epochs whose batches leave a remainder of the accumulation window: the pair reads each of its
    batches twice (one slice each time), so an epoch holds the single process's steps; losses and schedule
    (to 0 on the last step) are one process's, and resumed one step past the first epoch boundary it
    continues bit for bit."""
    epochs_with_a_remainder_step_as_one_process(config, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(SPLITS, []))
def test_two_sequence_parallel_groups_on_four_processes_match_single_process(markov_data, reference, tmp_path, config):
    """--num_processes 4 with parallelism_config_dp_shard_size 2: two Ulysses pairs (or rings), each splitting its
    rows of 2 x accumulation 2 (global batch 8 again), ZeRO-3 (FSDP2) over all four ranks."""
    CONFIG, out = config, tmp_path / "run"
    launch(
        CONFIG,
        "causal_lm.py",
        causal_lm_args(
            markov_data, out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS
        ),
        launcher_args=FP32 + ["--num_processes", "4", "--parallelism_config_dp_shard_size", "2"],
    )
    assert_split(read_run(out), CONFIG, groups=2)
    mine, ref = losses(out), losses(reference)
    loss_gap = max(abs(a - b) / b for a, b in zip(mine, ref))
    weight_gap = max_weight_difference(out / "final", reference / "final")
    print(f"{CONFIG} on 4 (2 groups of 2): relative loss gap {loss_gap:.2e}, final-weight gap {weight_gap:.2e}")
    assert len(mine) == STEPS and loss_gap < FP32_TOLERANCE and weight_gap < FP32_TOLERANCE
    assert read_metrics(out)[1][-1]["eval_tokens"] == read_metrics(reference)[1][-1]["eval_tokens"]
