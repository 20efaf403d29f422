"""Mixture-of-experts models (a tiny Qwen3-MoE: 8 fused experts, top-2, its router's load-balancing loss on) under
the data-parallel and tensor-parallel configs, launched on 2 processes over gloo, against one process.

The router's loss is taken per micro-batch on each rank, as transformers computes it in the model's forward, and the
optimizer sees its mean over the global batch's micro-batches (docs/strategies.md): so the reference is one process
with the same micro-batches (2 rows, accumulation 4) as 2 processes x 2 rows x accumulation 2 (tp.yaml's pair shares
one batch: 2 rows x accumulation 4; fsdp_tp.yaml's two pairs on 4 processes: 2 rows x accumulation 2). Two epochs of a corpus whose blocks the global batch does not divide. Each
config must match the reference's per-step loss, aux_loss and experts' load, its evaluation and its final weights
(fp32, FP32_TOLERANCE), and export a plain Hugging Face folder that loads in one process.

In process: the experts' load and aux_loss an ExpertWatch logs against a count taken from the routers themselves,
padding left out; DPO's loss takes the router loss its forward returns; the refusals (--output_router_logits on a
dense model, a pipeline with the router loss on)."""

import json
import re
import shlex

import pytest
import torch
from conftest import (
    FP32,
    REPO,
    LaunchedOnce,
    causal_lm_args,
    free_port,
    launch,
    launch_command,
    launch_one_process,
    max_weight_difference,
    model_state_gaps,
    read_metrics,
    read_run,
    resume_elsewhere,
    run,
    run_make_warm,
    tiered,
)
from test_strategies import FP32_TOLERANCE


MOE = REPO / "recipes/configs/tiny_qwen3_moe.json"
MIXTRAL = REPO / "recipes/configs/tiny_mixtral.json"  # a second MoE family (its own router and experts' classes)
# config -> (per-device batch, accumulation, processes): 2-row micro-batches, global batch 8, on every layout
LAYOUTS = {
    "ddp.yaml": (2, 2, 2),
    "fsdp.yaml": (2, 2, 2),
    "zero3.yaml": (2, 2, 2),
    "tp.yaml": (2, 4, 2),  # the pair holds one batch
    "zero2.yaml": (2, 2, 2),
    "fsdp_tp.yaml": (2, 2, 4),  # two tensor-parallel pairs, FSDP2 across them
    "zero3_ulysses.yaml": (2, 4, 2),  # each rank a slice of every row
    "fsdp_cp.yaml": (2, 4, 2),
    "ep.yaml": (2, 2, 2),  # each rank 4 of the 8 experts, FSDP2 for the rest
    "fsdp_ep.yaml": (1, 2, 4),  # each pair of ranks the 8 experts, 4 each, each expert sharded over the 2 pairs
}
# experts split over ep_size ranks, and (fsdp_ep.yaml) each sharded over the rest: read off the ranks' weights
SPLITS = {
    "ep.yaml": {"ep_size": 2, "experts_per_rank": 4},
    "fsdp_ep.yaml": {"ep_size": 2, "experts_per_rank": 4, "expert_shards": 2},
}
# each rank's router sees its slice of the rows, so the aux loss is the slices' (docs/strategies.md): near one
# process's, not equal (seen: aux loss within 0.26%, the loss within 2.7e-5, the experts' load within 1% once the
# weights have moved apart; at step 1, the same weights, the load is equal)
SLICED = {"zero3_ulysses.yaml", "fsdp_cp.yaml"}
SLICED_TOLERANCE = {
    "loss": 1e-4,
    "aux_loss": 1e-2,
    "expert_load_max_over_mean": 3e-2,
    "expert_load_min_over_mean": 3e-2,
}
IN_MAKE_TEST = ["tp.yaml", "ep.yaml"]  # the rest in make test-all
SAVED_AT = 3  # the ep.yaml run's and the reference's checkpoint, resumed under another config
FIGURES = ("loss", "aux_loss", "expert_load_max_over_mean", "expert_load_min_over_mean")


@pytest.fixture(scope="module")
def moe_data(tmp_path_factory):
    from common.data.synthetic import write_markov_corpus

    out = tmp_path_factory.mktemp("moe_data")
    write_markov_corpus(str(out), train_docs=60, validation_docs=20, seed=3)
    return out


def moe_args(data, out, **overrides):
    values = dict(model_config=MOE, max_steps=-1, num_train_epochs=2, per_device_train_batch_size=2)
    return causal_lm_args(data, out, **{**values, **overrides})


@pytest.fixture(scope="module")
def moe_references(moe_data, tmp_path_factory):
    """One process on micro-batches of `rows` rows, accumulation 8 / rows (global batch 8), two epochs, a checkpoint
    kept at step SAVED_AT: the router's loss is taken per micro-batch, so each layout has the reference of its rows."""

    def launch_reference(rows: int):
        out = tmp_path_factory.mktemp(f"moe_reference_{rows}") / "run"
        overrides = dict(per_device_train_batch_size=rows, gradient_accumulation_steps=8 // rows)
        args = moe_args(moe_data, out, save_steps=SAVED_AT, save_total_limit=100, **overrides)
        launch_one_process("causal_lm.py", args, launcher_args=FP32)
        return out

    return LaunchedOnce(launch_reference)


@pytest.fixture(scope="module")
def moe_reference(moe_references):
    """2-row micro-batches, accumulation 4."""
    return moe_references[2]


@pytest.fixture(scope="module")
def fsdp_ep_run(moe_data, tmp_path_factory):
    """fsdp_ep.yaml on its 4 processes x 1 row x accumulation 2, a checkpoint kept at step SAVED_AT."""
    out = tmp_path_factory.mktemp("fsdp_ep_run") / "run"
    args = moe_args(
        moe_data,
        out,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        save_steps=SAVED_AT,
        save_total_limit=100,
    )
    launch("fsdp_ep.yaml", "causal_lm.py", args, launcher_args=FP32)
    return out


@pytest.fixture(scope="module")
def ep_run(moe_data, tmp_path_factory):
    """ep.yaml as the README runs it (`make causal_lm CONFIG=accelerate_configs/ep.yaml ARGS=...`), on the reference's
    data and global batch (2 processes x 2 rows x accumulation 2), a checkpoint kept at step SAVED_AT."""
    out = tmp_path_factory.mktemp("ep_run") / "run"
    args = moe_args(moe_data, out, gradient_accumulation_steps=2, save_steps=SAVED_AT, save_total_limit=100)
    at = args.index("--config")
    del args[at : at + 2]  # the target passes the demo's recipe config itself
    launcher = f"--mixed_precision no --main_process_port {free_port()}"
    run_make_warm(
        [
            "make",
            "-s",
            "causal_lm",
            "CONFIG=accelerate_configs/ep.yaml",
            f"LAUNCH_ARGS={launcher}",
            f"ARGS={shlex.join(args)}",
        ]
    )
    return out


def relative_gap(mine: list, theirs: list) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mine, theirs, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(LAYOUTS, IN_MAKE_TEST))
def test_moe_with_its_router_loss_matches_one_process(config, moe_data, moe_references, tmp_path, request):
    from transformers import AutoModelForCausalLM

    batch, accumulation, processes = LAYOUTS[config]
    moe_reference = moe_references[batch]
    if config in ("ep.yaml", "fsdp_ep.yaml"):
        out = request.getfixturevalue(config.replace(".yaml", "_run"))
    else:
        out = tmp_path / "run"
        args = moe_args(moe_data, out, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation)
        launch(config, "causal_lm.py", args, launcher_args=FP32)
    record, reference = read_run(out), read_run(moe_reference)
    assert record["world_size"] == processes and record["participating_processes"] == processes
    assert record["effective_batch_size"] == reference["effective_batch_size"] == 8
    assert record["train_blocks"] % 8, "an epoch with a remainder"
    split = SPLITS.get(config, {})
    assert record["experts"] == {
        "num_experts": 8,
        "experts_per_token": 2,
        "router_aux_loss": True,
        "router_aux_loss_coef": 0.02,
        **split,
    }
    rows, reference_rows = read_metrics(out)[0], read_metrics(moe_reference)[0]
    assert len(rows) == len(reference_rows) == 2 * (record["train_blocks"] // 8)
    gaps = {name: relative_gap([r[name] for r in rows], [r[name] for r in reference_rows]) for name in FIGURES}
    weights = max_weight_difference(out / "final", moe_reference / "final")
    print(f"{config}: relative gaps {gaps}, final weights {weights:.2e} (fp32, 2 epochs, accumulation)")
    if config in SPLITS:  # each rank's tokens to the other rank's experts of its pair: half its (token, expert) pairs
        tokens = batch * 32 * accumulation  # a rank's tokens per step
        formula = 4 * 2 * tokens * 2 * (1 / 2) * 64 * 4 / 2**20  # crossings, layers, tokens, k, off-rank, h, fp32
        sent = sorted(r["all_to_all_mb"] for r in rows)
        assert abs(sent[len(sent) // 2] - formula) < 0.25 * formula, (sent, formula)
    if config in SLICED:
        assert all(gap < SLICED_TOLERANCE[name] for name, gap in gaps.items()), gaps
        assert all(rows[0][name] == reference_rows[0][name] for name in FIGURES[2:])
        return
    assert all(gap < FP32_TOLERANCE for gap in gaps.values()), gaps
    assert weights < FP32_TOLERANCE
    assert all(r["aux_loss"] > 1.0 and r["expert_load_max_over_mean"] > 1.0 for r in rows)  # top-2 of 8: aux ~2
    eval_gap = abs(read_metrics(out)[1][-1]["eval_loss"] - read_metrics(moe_reference)[1][-1]["eval_loss"])
    assert eval_gap < FP32_TOLERANCE
    model = AutoModelForCausalLM.from_pretrained(out / "final")  # a plain folder, in one process
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.output_router_logits


RESUMES = {  # (saved by, resumed under): processes, accumulation, rows a micro-batch (the reference's)
    ("ep", "single.yaml"): (1, 4, 2),
    ("ep", "fsdp.yaml"): (2, 2, 2),
    ("reference", "ep.yaml"): (2, 2, 2),
    ("fsdp_ep", "ep.yaml"): (2, 4, 1),  # each expert's shards over 2 pairs gathered into whole experts
    ("reference", "fsdp_ep.yaml"): (4, 2, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("saved_by,config", tiered(RESUMES, [("ep", "single.yaml")]))
def test_an_expert_parallel_checkpoint_resumes_under_another_config_and_back(
    saved_by, config, moe_data, moe_references, tmp_path, request
):
    """The ep.yaml run's checkpoint (each rank its experts, DCP) goes on in one process and under fsdp.yaml, the
    fsdp_ep.yaml run's (each rank a shard of its experts) under ep.yaml, and one process's checkpoint under ep.yaml and
    fsdp_ep.yaml, to the reference's losses and final weights (fp32)."""
    processes, accumulation, rows = RESUMES[(saved_by, config)]
    reference = moe_references[rows]
    saved = reference if saved_by == "reference" else request.getfixturevalue(f"{saved_by}_run")
    stopped = tmp_path / "stopped"
    resume_elsewhere(
        saved,
        stopped,
        SAVED_AT,
        processes,
        config,
        "causal_lm.py",
        lambda **overrides: moe_args(moe_data, stopped, per_device_train_batch_size=rows, **overrides),
        accumulation,
        launcher_args=FP32,
        logged_rows=SAVED_AT,
    )
    rows, reference_rows = read_metrics(stopped)[0], read_metrics(reference)[0]
    assert [r["step"] for r in rows] == [r["step"] for r in reference_rows]
    gap = relative_gap([r["loss"] for r in rows[SAVED_AT:]], [r["loss"] for r in reference_rows[SAVED_AT:]])
    weights = max_weight_difference(stopped / "final", reference / "final")
    print(f"{saved_by} -> {config}: losses after step {SAVED_AT} within {gap:.1e}, final weights {weights:.1e}")
    assert gap < FP32_TOLERANCE and weights < FP32_TOLERANCE


@pytest.mark.slow
@pytest.mark.exhaustive
def test_fsdp_ep_holds_a_quarter_of_the_experts_state_per_rank_as_estimated_at_100m(moe_data, tmp_path):
    """fsdp_ep.yaml as it ships (4 processes, ep 2 x 2 shards, bf16) on a 118M-parameter Qwen3-MoE (its experts 96% of
    it): each rank's parameters, gradients and Adam states, counted by the run's memory account, within 15% of `make
    estimate-memory`'s (1/4 of the experts' and of the dense weights' per rank), for two steps."""
    config = json.loads(MOE.read_text())
    config.update(hidden_size=512, moe_intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8, head_dim=64)
    config.update(num_key_value_heads=4, intermediate_size=2048)
    (tmp_path / "moe.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    args = moe_args(moe_data, out, model_config=tmp_path / "moe.json", max_steps=2, per_device_train_batch_size=1)
    launch("fsdp_ep.yaml", "causal_lm.py", [*args, "--per_device_eval_batch_size", "1", "--max_eval_samples", "4"])
    record = read_run(out)
    assert record["participating_processes"] == 4 and record["total_parameters"] > 100e6
    assert record["experts"]["ep_size"] == 2 and record["experts"]["expert_shards"] == 2
    gaps = model_state_gaps(out, REPO / "accelerate_configs/fsdp_ep.yaml")
    states = [account["model_state_mb"] for account in record["memory_per_rank"]]
    print(f"fsdp_ep.yaml at {record['total_parameters'] / 1e6:.0f}M: model state per rank {states} MB, gaps {gaps}")
    assert all(gap < 0.15 for gap in gaps.values()), gaps


@pytest.mark.slow
@pytest.mark.exhaustive
def test_fsdp_ep_shards_each_expert_by_rows_where_a_rank_has_fewer_experts_than_shards(moe_data, tmp_path):
    """2 experts (1 per token) under fsdp_ep.yaml: each pair of ranks splits them one a rank, fewer than the 2 shards,
    so each expert is sharded along its rows (FSDP2 would pad a whole expert): the same losses and final weights as
    one process (fp32, 1-row micro-batches, accumulation, two epochs)."""
    config = json.loads(MOE.read_text()) | {"num_experts": 2, "num_experts_per_tok": 1}
    (tmp_path / "moe.json").write_text(json.dumps(config))
    runs = {}
    for name, accumulation in (("single.yaml", 8), ("fsdp_ep.yaml", 2)):
        out = runs[name] = tmp_path / name
        overrides = dict(model_config=tmp_path / "moe.json", per_device_train_batch_size=1)
        launch(
            name,
            "causal_lm.py",
            moe_args(moe_data, out, gradient_accumulation_steps=accumulation, **overrides),
            launcher_args=FP32,
        )
    record = read_run(runs["fsdp_ep.yaml"])
    assert record["participating_processes"] == 4 and record["experts"]["experts_per_rank"] == 1
    rows, reference = (read_metrics(runs[name])[0] for name in ("fsdp_ep.yaml", "single.yaml"))
    gaps = {name: relative_gap([r[name] for r in rows], [r[name] for r in reference]) for name in FIGURES}
    weights = max_weight_difference(runs["fsdp_ep.yaml"] / "final", runs["single.yaml"] / "final")
    print(f"fsdp_ep.yaml, 1 expert a rank over 2 shards: gaps {gaps}, final weights {weights:.1e}")
    assert all(gap < FP32_TOLERANCE for gap in gaps.values()) and weights < FP32_TOLERANCE, (gaps, weights)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("config", ["ep.yaml", "fsdp_ep.yaml"])
def test_a_moe_loaded_in_bf16_trains_on_fp32_master_experts(config, moe_data, tmp_path):
    """A bf16 checkpoint loaded with --torch_dtype bfloat16 under bf16 mixed precision: accelerate upcasts the weights
    to fp32 masters in place, which left a split expert's rows in bf16 and stopped the first optimizer step with a raw
    dtype error; the experts are made fp32 before they are split, and the run trains and exports."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MOE, vocab_size=64)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    out = tmp_path / "run"
    bf16 = dict(model_config="", model_name_or_path=tmp_path / "bf16", torch_dtype="bfloat16", max_steps=2)
    launch(config, "causal_lm.py", moe_args(moe_data, out, **bf16))  # the configs' bf16 (fp32 on a CPU without it)
    record = read_run(out)
    assert record["participating_processes"] == (4 if config == "fsdp_ep.yaml" else 2)
    assert len(read_metrics(out)[0]) == 2 and (out / "final/model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_second_moe_family_under_ep_matches_one_process(moe_data, tmp_path):
    """Mixtral (its own router and experts' classes) under ep.yaml against one process: losses, aux_loss, load."""
    runs = {}
    for config, processes, accumulation in (("single.yaml", 1, 4), ("ep.yaml", 2, 2)):
        out = runs[config] = tmp_path / config
        args = moe_args(moe_data, out, model_config=MIXTRAL, gradient_accumulation_steps=accumulation)
        launch(config, "causal_lm.py", args, num_processes=processes, launcher_args=FP32)
    assert read_run(runs["ep.yaml"])["experts"]["experts_per_rank"] == 4
    rows, reference_rows = (read_metrics(runs[config])[0] for config in ("ep.yaml", "single.yaml"))
    gaps = {name: relative_gap([r[name] for r in rows], [r[name] for r in reference_rows]) for name in FIGURES}
    assert all(gap < FP32_TOLERANCE for gap in gaps.values()), gaps
    assert max_weight_difference(runs["ep.yaml"] / "final", runs["single.yaml"] / "final") < FP32_TOLERANCE


def test_expert_parallelism_refuses_what_it_cannot_split_in_one_line():
    """A dense model, experts the ranks do not divide, a mesh ep.yaml's rules refuse: one line each, before a run
    builds anything (common.launch.mesh) or once the model is built (common.parallel.expert_parallel)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.launch.mesh import mesh_problems
    from common.parallel.expert_parallel import model_problems

    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_qwen3.json"))
        mixtral = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MIXTRAL))
    assert model_problems(dense, 2)[0].startswith("ep_size 2: Qwen3ForCausalLM has no experts to split")
    assert "the model's 8 experts per layer do not divide over 3 ranks" in model_problems(tiny_moe(), 3)[0]
    assert model_problems(tiny_moe(), 4) == model_problems(mixtral, 2) == []
    ep = {"dp_shard": 2, "ep": 2}
    assert mesh_problems(ep, 2, "FSDP", True, False) == []
    assert "expert parallelism runs under FSDP2" in mesh_problems({"ep": 2}, 2, "MULTI_GPU", False, False)[0]
    assert mesh_problems({"dp_shard": 4, "ep": 2}, 4, "FSDP", True, False) == []  # fsdp_ep.yaml's 2 x 2
    for sizes, world in (({"dp_shard": 6, "ep": 4}, 6), ({"dp_shard": 2, "ep": 4}, 2)):
        assert f"ep_size 4 with {world} processes" in mesh_problems(sizes, world, "FSDP", True, False)[0]
    assert "beside tp_size 2" in mesh_problems({"dp_shard": 1, "tp": 2, "ep": 2}, 2, "FSDP", True, False)[0]
    assert "fsdp_cpu_ram_efficient_loading: true" in mesh_problems(ep, 2, "FSDP", True, True)[0]


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize(
    "model, launcher, expected",
    [
        (None, [], "LlamaForCausalLM has no experts to split"),
        (MOE, ["--fsdp_offload_params", "true"], "fsdp_offload_params: true beside parallelism_config_ep_size"),
    ],
)
def test_a_dense_model_or_offloading_under_ep_is_one_line(model, launcher, expected, moe_data, tmp_path):
    out = tmp_path / "run"
    args = causal_lm_args(moe_data, out, **({"model_config": model} if model else {}))
    result = run(launch_command("ep.yaml", "causal_lm.py", args, [*FP32, *launcher]), check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(set(errors)) == 1, result.stderr[-3000:]
    assert expected in errors[0]
    assert not re.search(r'File "[^"]*/(recipes|common)/', result.stderr), result.stderr[-3000:]  # torchrun's own only


def tiny_moe(**overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(MOE, vocab_size=50, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for router in (m for m in model.modules() if type(m).__name__.endswith("TopKRouter")):
        torch.nn.init.normal_(router.weight, std=0.5)  # routes apart from the start
    return model


def test_expert_load_and_aux_loss_are_the_routers_own():
    """The watch's counts against the routers' own choices (their top-k indices, read by a hook on each router),
    with a padded row's padding left out; aux_loss the model's; evaluation and no-grad forwards left out."""
    from common.training.experts import ExpertWatch

    model = tiny_moe()
    chosen = []
    for router in (m for m in model.modules() if type(m).__name__.endswith("TopKRouter")):
        router.register_forward_hook(lambda module, args, output: chosen.append(output[2]))
    watch = ExpertWatch(model)
    ids = torch.randint(0, 50, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0  # a padded row
    model.train()
    output = model(input_ids=ids, attention_mask=mask)
    assert output.loss is None and output.aux_loss.requires_grad
    flat = mask.reshape(-1).bool()
    by_hand = torch.stack([torch.bincount(c[flat].reshape(-1), minlength=8).double() for c in chosen])
    assert len(chosen) == 2 and torch.equal(watch.load, by_hand)
    assert watch.pending_loss().item() == pytest.approx(0.02 * output.aux_loss.item())  # a loss without labels
    model.eval()
    model(input_ids=ids, attention_mask=mask)
    model.train()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert torch.equal(watch.load, by_hand) and watch.aux[1] == 1  # neither counted

    class OneRank:
        num_processes = 1
        device = torch.device("cpu")

        @staticmethod
        def reduce(tensor, reduction):
            return tensor

    figures = watch.figures(OneRank())
    ratio = by_hand / by_hand.mean(dim=1, keepdim=True)
    assert figures["aux_loss"] == pytest.approx(output.aux_loss.item())
    assert figures["expert_load_max_over_mean"] == pytest.approx(ratio.max().item())
    assert figures["expert_load_min_over_mean"] == pytest.approx(ratio.min().item())
    assert watch.load is None and watch.aux is None  # a fresh window
    labelled = model(input_ids=ids, attention_mask=mask, labels=ids)
    assert watch.pending_loss() == 0.0  # the model's own loss holds it
    unweighted = labelled.loss - 0.02 * labelled.aux_loss
    assert (
        abs(
            unweighted.item()
            - torch.nn.functional.cross_entropy(labelled.logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1)).item()
        )
        < 1e-5
    )


def test_a_moe_generates_from_a_padded_batch_without_its_router_loss():
    """Greedy answers and rollouts generate under `unrouted`: the router loss is not taken at each decoding step (with
    a left-padded batch transformers' takes it over a mask of another shape), and the config is as it was after."""
    from common.training.experts import unrouted

    model = tiny_moe().eval()
    ids = torch.randint(3, 50, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :3] = 0  # left padding, as generation pads
    with unrouted(model):
        assert not model.config.output_router_logits
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 9) and model.config.output_router_logits


def test_router_loss_option_and_refusals(tmp_path):
    from transformers import AutoConfig

    from common.launch.errors import UsageError
    from common.launch.mesh import PipelineSettings
    from common.options.arguments import ModelArguments
    from common.parallel import pipeline
    from common.training import experts

    moe, dense = AutoConfig.from_pretrained(MOE), AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_qwen3.json")
    off = ModelArguments(model_config=str(MOE), tokenizer_name_or_path="x", output_router_logits=False)
    assert experts.config_overrides(off, moe) == {"output_router_logits": False}
    assert experts.config_overrides(ModelArguments(model_config=str(MOE), tokenizer_name_or_path="x"), moe) == {}
    on = ModelArguments(**{**off.__dict__, "output_router_logits": True})
    with pytest.raises(UsageError, match="classifiers .* compute no router loss"):
        experts.config_overrides(on, moe, causal_lm=False)
    with pytest.raises(UsageError, match="--output_router_logits true: qwen3 is a dense model"):
        experts.config_overrides(ModelArguments(**{**off.__dict__, "output_router_logits": True}), dense)
    settings = PipelineSettings(size=2, schedule="1F1B")
    problems = pipeline.model_problems(tiny_moe(), settings)
    assert problems and "router load-balancing loss (output_router_logits)" in problems[0]
    assert not pipeline.model_problems(tiny_moe(output_router_logits=False), settings)
    assert experts.watch(tiny_moe(output_router_logits=False)) is None
    assert json.dumps(experts.describe(tiny_moe()))


@pytest.mark.slow
def test_dpo_adds_the_router_loss_its_forward_returns(tmp_path):
    """DPO's loss is built from the logits, so the MoE's router loss is added by the recipe (Run.router_loss): at
    step 1 the policy is its reference, each pair's DPO loss is ln 2, and the loss logged is ln 2 plus the router
    loss's weight times aux_loss (both means over the step's micro-batches)."""
    import math

    from test_dpo import dpo_args

    from common.data.synthetic import write_preference_data

    write_preference_data(str(tmp_path / "pairs"), train=24, validation=8)
    out = tmp_path / "run"
    settings = dict(model_config=MOE, max_steps=2, num_train_epochs=1, save_steps=0, per_device_train_batch_size=2)
    launch_one_process("dpo.py", dpo_args(tmp_path / "pairs", out, **settings), FP32)
    first = read_metrics(out)[0][0]
    assert read_run(out)["experts"]["router_aux_loss"] and first["aux_loss"] > 1.0
    assert first["loss"] == pytest.approx(math.log(2) + 0.02 * first["aux_loss"], abs=1e-6)


@pytest.mark.slow
def test_grpo_adds_the_router_loss_its_forward_returns(tmp_path):
    """GRPO's loss too: with one reward for every completion each advantage is 0, so the policy loss is 0 and the
    loss logged is the router loss's weight times aux_loss (the rollouts' no-grad forwards not counted)."""
    from test_grpo import grpo_args

    from common.data.synthetic import write_prompt_data

    write_prompt_data(str(tmp_path / "prompts"), train=8, validation=4)
    (tmp_path / "constant.py").write_text(
        "def constant(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    out = tmp_path / "run"
    settings = dict(
        model_config=MOE, reward_funcs=f"{tmp_path}/constant.py:constant", max_steps=1, num_iterations=1, save_steps=0
    )
    launch_one_process("grpo.py", grpo_args(tmp_path / "prompts", out, **settings), FP32)
    first = next(row for row in read_metrics(out)[0] if "loss" in row)
    assert first["aux_loss"] > 1.0 and first["loss"] == pytest.approx(0.02 * first["aux_loss"], abs=1e-6)


def test_lora_on_a_moe_says_what_it_adapts(capsys):
    """Named projections adapt the attention alone; peft's all-linear reaches the experts' stacked tensors and the
    routers too: the line says which, from the adapted modules themselves."""
    from common.models.lora import LoraArguments, apply_lora

    apply_lora(tiny_moe(), LoraArguments(use_peft=True, lora_target_modules=["q_proj", "v_proj"]))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("adapters on q_proj, v_proj; the experts' weights frozen, the routers frozen"), line
    model = apply_lora(tiny_moe(), LoraArguments(use_peft=True, lora_target_modules=["all-linear"]))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "adapters on experts, gate, k_proj" in line and "experts' weights adapted too" in line, line
    assert "routers adapted" in line
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(".mlp.experts." in name for name in trained) and any(".mlp.gate." in name for name in trained)


def test_flops_count_the_experts_a_token_reaches():
    """MFU's FLOPs per token: the routed experts' weights by top-k of E (2 of 8), as a token multiplies them."""
    from common.training.flops import ModelFlops

    model = tiny_moe()
    config = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    reached = (
        config.num_hidden_layers * config.num_experts_per_tok * 3 * config.hidden_size * config.moe_intermediate_size
    )
    assert ModelFlops(model).dense_per_token == 6 * (linear + reached)


@pytest.mark.parametrize(
    "family,changes",
    [
        ("tiny_qwen3_moe.json", {}),
        ("tiny_qwen3_moe.json", {"num_experts_per_tok": 4}),
        ("tiny_qwen3_moe.json", {"hidden_size": 128, "head_dim": 32, "moe_intermediate_size": 64}),
        ("tiny_mixtral.json", {}),
    ],
)
def test_the_estimate_counts_a_moe_layers_activations_and_the_flops_of_the_experts_a_token_reaches(
    family, changes, tmp_path
):
    """make estimate-memory and make choose-config on a MoE: the matmul weights a token multiplies count the routed
    experts by top-k of E (as the train lines' FLOPs), and what a MoE layer's MLP keeps for backward
    (common.planning.memory.moe_layer_bytes) is within 5% of what one layer's sparse block saves, measured with
    saved-tensor hooks (each storage once, parameters left out) on 1024 tokens in fp32: Qwen3-MoE at top-2 and top-4, wider, and
    Mixtral (whose intermediate_size is the experts' width). Before, the estimate took the dense MLP's width for
    every layer and left the experts out of the FLOPs (Mixtral's activations at 0.57 of a whole run's measured)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.planning.memory import moe_layer_bytes, read_model

    settings = {**json.loads((REPO / "recipes/configs" / family).read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(settings))
    model = read_model(str(tmp_path), vocab_size=100)
    config = AutoConfig.from_pretrained(tmp_path, vocab_size=100)
    built = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in built.modules() if isinstance(m, torch.nn.Linear))
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    reached = config.num_hidden_layers * config.num_experts_per_tok * 3 * config.hidden_size * width
    assert model["matmul_parameters"] == linear + reached and model["moe_layers"] == config.num_hidden_layers

    # each storage once; the weights are parameters, not activations
    stored, seen = [0], {(p.untyped_storage().data_ptr(), p.dtype) for p in built.parameters()}

    def keep(tensor):
        if (tensor.untyped_storage().data_ptr(), tensor.dtype) not in seen:
            seen.add((tensor.untyped_storage().data_ptr(), tensor.dtype))
            stored[0] += tensor.untyped_storage().nbytes()
        return tensor

    hidden = torch.randn(4, 256, config.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        built.model.layers[0].mlp(hidden)
    estimated = 1024 * moe_layer_bytes(model, 4)
    print(f"{family} {changes}: a MoE layer keeps {stored[0]} bytes for 1024 tokens, estimated {estimated:.0f}")
    assert estimated == pytest.approx(stored[0], rel=0.05)


@pytest.mark.parametrize("tied", [True, False])
def test_an_upcycled_model_computes_the_dense_models_logits_at_step_0(tied):
    """Sparse upcycling (common/models/upcycle.py, `make real-moe`'s): each expert a copy of the layer's MLP, the
    routers new, so the Mixtral model's logits are the dense Llama's whatever it routes (grouped-query attention,
    tied or untied head); its experts then train apart. Refused in one line: a Llama with biases, top-1 routing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.launch.errors import UsageError
    from common.models.upcycle import upcycle

    config = AutoConfig.from_pretrained(
        REPO / "recipes/configs/tiny_llama.json", vocab_size=50, num_key_value_heads=2, tie_word_embeddings=tied
    )
    torch.manual_seed(1)
    dense = AutoModelForCausalLM.from_config(config).eval()
    moe = upcycle(dense, num_experts=4, experts_per_token=2).eval()
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.tie_word_embeddings == tied
    ids = torch.randint(0, 50, (3, 12))
    with torch.no_grad():
        gap = (dense(input_ids=ids).logits - moe(input_ids=ids).logits).abs().max().item()
        chosen = {tuple(r.tolist()) for r in moe.model.layers[0].mlp.gate(torch.randn(40, 64))[2]}
    assert gap < 1e-5 and len(chosen) > 1, (gap, chosen)  # the same function, routed more than one way
    experts = moe.model.layers[1].mlp.experts
    assert torch.equal(experts.down_proj[3], dense.model.layers[1].mlp.down_proj.weight)
    moe.train()
    moe(input_ids=ids, labels=ids).loss.backward()
    grads = experts.down_proj.grad
    assert not torch.equal(grads[0], grads[1]) or not torch.equal(grads[2], grads[3])  # the experts move apart
    with pytest.raises(UsageError, match="biases"):
        upcycle(AutoModelForCausalLM.from_config(config.__class__(**{**config.to_dict(), "mlp_bias": True})), 4, 2)
    with pytest.raises(UsageError, match="route each token to 2 or more experts"):
        upcycle(dense, 4, 1)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_make_demo_moe_chat_upcycles_the_real_model_and_teaches_it_with_its_experts_split(tmp_path):
    """`make real-moe`: SmolLM2-135M-Instruct upcycled into a Mixtral of 4 experts (2 per token), its step-0 logits the
    dense model's (seen: max gap 8.0e-5 with logits up to 40.2); `make demo-moe-chat` cut to 8 steps as make test's
    demo-chat is: the arithmetic task under ep.yaml (2 experts per rank) takes exact match from ~0 to >= 0.25 as the
    dense model's run does (seen: 0.000 -> 0.344 on 32 questions in fp32, the dense model 0.31), and the export
    answers through its template. Make test-all only: ~11 minutes on a 2-core host without bf16 instructions."""
    result = run(
        [
            "make",
            "demo-moe-chat",
            f"LAUNCH_ARGS=--main_process_port {free_port()}",
            f"MOE_MODEL={tmp_path / 'moe'}",
            f"MOE_CHAT_OUT={tmp_path / 'chat'}",
            "ARGS=--max_steps 8 --max_generation_samples 32 --max_eval_samples 32",
        ],
        timeout=3600,
    )
    gap = re.search(r"max gap ([\d.e+-]+) \(logits up to ([\d.]+)\)", result.stdout)
    assert gap and float(gap[1]) < 1e-3 * float(gap[2]), result.stdout[-2000:]
    match = re.search(r"exact match ([\d.]+) untrained -> ([\d.]+) on (\d+) questions", result.stdout)
    assert match and float(match[1]) <= 0.05 and float(match[2]) >= 0.25 and int(match[3]) == 32, result.stdout[-2000:]
    record = read_run(tmp_path / "chat")
    assert record["participating_processes"] == 2
    assert record["experts"]["ep_size"] == 2 and record["experts"]["experts_per_rank"] == 2
    gaps = model_state_gaps(tmp_path / "chat", REPO / "accelerate_configs/ep.yaml")  # 373M parameters
    print(f"ep.yaml at 373M parameters: the estimate's model state against the run's account: {gaps}")
    assert all(gap < 0.15 for gap in gaps.values()), gaps  # seen: 0 (each category to the 0.1 MB)
    assert "Q: what is 7 plus 8 ?\nA: " in result.stdout, result.stdout[-500:]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_make_benchmark_moe_writes_its_page(tmp_path):
    """`make benchmark-moe` cut to 2 processes and 3 steps: a row per config, the same model trained (the losses
    within bf16's noise), half of ddp's model state per rank under fsdp and ep, and ep's all-to-all megabytes near
    the formula's for even routing (seen: 4.01 against 4.00)."""
    page = tmp_path / "moe.md"
    run(["make", "-s", "benchmark-moe", f"ARGS=--processes 2 --steps 3 --docs {page}"], timeout=1800)
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in page.read_text().splitlines()]
    rows = [row for row in rows if row and row[0].startswith("`")]
    assert [row[0] for row in rows] == ["`ddp.yaml`", "`fsdp.yaml`", "`ep.yaml`"]
    losses = [float(row[9]) for row in rows]
    assert max(losses) - min(losses) < 2e-2 * losses[0], losses
    assert [float(row[6]) for row in rows[1:]] == [0.5, 0.5]
    measured, formula = float(rows[2][7]), float(rows[2][8])
    assert abs(measured - formula) < 0.25 * formula, (measured, formula)


def test_split_experts_compute_in_autocasts_dtype_and_train_their_fp32_weights():
    """ep.yaml leaves the experts out of FSDP2, whose mixed precision would hand them bf16 copies: under autocast their
    forward gets those copies here (transformers' grouped matmul, which autocast does not cover, computes in the
    weights' dtype), the gradients reaching the fp32 weights; outside autocast, their own."""
    from common.parallel.expert_parallel import compute_in_autocast_dtype

    experts = tiny_moe().model.layers[0].mlp.experts
    seen, inner = [], experts.forward
    experts.forward = lambda *args: (seen.append(experts.gate_up_proj.dtype), inner(*args))[1]
    compute_in_autocast_dtype(experts)
    hidden, index, weights = torch.randn(5, 64), torch.randint(0, 8, (5, 2)), torch.full((5, 2), 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        experts(hidden, index, weights).float().sum().backward()
    experts(hidden, index, weights)
    assert seen == [torch.bfloat16, torch.float32] and experts.gate_up_proj.dtype == torch.float32
    assert experts.gate_up_proj.grad.dtype == torch.float32 and experts.gate_up_proj.grad.abs().sum() > 0
