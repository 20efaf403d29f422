"""The memory account each run writes (common/training/memory.py) against scripts/estimate_memory.py,
at 101M parameters, bf16 as the configs ship (make test's runs in fp32 on a CPU without bf16 instructions, as a
user's run there trains: PRECISIONS below), accumulation 2: every CPU-runnable config but
zero2_json on 2 processes (single.yaml on 1), and on 4 one config of each framework's sharding
(fsdp, zero2) and zero3 with activation checkpointing: the other sharded configs divide their
shards by the number of processes through the same estimate. (The whole matrix, every config
on 2 and on 4, is `make benchmark`'s table, written to docs/benchmark.md; tests/test_strategies.py
checks the model-state categories of every config's runs on 1, 2 and 4 processes at the tiny
size. In make test-all, pp.yaml and dp_pp.yaml per stage: each rank against make estimate-memory's row for it.)"""

import json
import subprocess
import sys

import pytest
from conftest import (
    CONFIGS,
    FP32,
    HOST_BF16,
    MAKE_TEST_PRECISION,
    REPO,
    LaunchedOnce,
    bf16_or_host_precision,
    causal_lm_args,
    drop_weights,
    estimate_for_run,
    launch,
    load_script,
    read_run,
    tiered,
)


# memory accounts in bf16, as the configs train (emulated on a CPU without bf16 instructions)
pytestmark = pytest.mark.bf16


MODEL = REPO / "recipes/configs/llama_100m.json"
# glibc keeps freed heap for reuse, so a CPU process's resident set also holds what
# earlier steps freed; a fixed mmap threshold returns it, and RSS is then the live memory
# the account and the estimate describe (it halves CPU throughput: the recipes leave it).
LIVE_RSS = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# every process of a launch reports the modules it imports (python -X importtime's lines, on stderr)
IMPORT_TIMES = {"PYTHONPROFILEIMPORTTIME": "1"}
SEQ_LEN = 16


# run -> (config, processes, activation checkpointing)
# zero2_json.yaml is zero2.yaml as a DeepSpeed JSON: the same account (make benchmark's tables), and its
# categories are checked at the tiny size in tests/test_strategies.py.
ON_2 = [
    "ddp.yaml",
    "fsdp.yaml",
    "fsdp_shard_grad_op.yaml",
    "fsdp_offload.yaml",
    "zero1.yaml",
    "zero2.yaml",
    "zero2_offload.yaml",
    "zero3.yaml",
    "zero3_offload.yaml",
]
# Not again on 4: ddp (every rank holds everything, on any number), fsdp_shard_grad_op (its gradient and optimizer
# shards divide as fsdp's do), fsdp_offload (fsdp's shards; the checkpointing its YAML asks for, zero3 on 4 has),
# zero1, zero2_offload (one DeepSpeed optimizer serves ZeRO-1 and 2, offloaded or not: the same division on 2
# and on 4 in make benchmark's tables) and zero3_offload (zero3's partitions, offloaded to the memory they are in).
ON_4 = ["fsdp.yaml", "zero2.yaml"]
# make test: DDP, FSDP2 and ZeRO-3 on 2 (and their ratios); make test-all: every run
IN_MAKE_TEST = ["ddp.yaml", "fsdp.yaml", "zero3.yaml"]
# make test's runs in conftest's MAKE_TEST_PRECISION (fp32 on a CPU without bf16 instructions: emulated bf16 took
# 18 s a step at 101M on a 2-core AVX2 host, two thirds of each run; those runs are make test-all's there)
PRECISIONS = ["bf16"] if HOST_BF16 else ["bf16", "fp32"]


def tiered_precisions(names) -> list:
    """(name, precision) parameters: make test's names in its precision, the rest make test-all's."""
    make_test = [(name, MAKE_TEST_PRECISION) for name in IN_MAKE_TEST]
    return tiered([(name, precision) for precision in PRECISIONS for name in names], make_test)


def run_key(name: str, precision: str):
    """The `measured` key of run `name` in `precision`: its RUNS name in bf16, (config, processes) in fp32."""
    return name if precision == "bf16" else RUNS[name][:2]


RUNS = {
    "single.yaml": ("single.yaml", 1, False),
    **{config: (config, 2, False) for config in ON_2},
    **{f"{config} on 4": (config, 4, False) for config in ON_4},
    "zero3.yaml on 4, checkpointing": ("zero3.yaml", 4, True),
}


@pytest.fixture(scope="session")
def measured(markov_data, tmp_path_factory) -> LaunchedOnce:
    """Runs on a 101M-parameter Llama, by their name in RUNS (bf16) or as (config, processes) in fp32."""

    def launch_run(name):
        """Two steps of 2 micro-batches of 1 x 16 tokens (the account is taken at the first optimizer step, the
        whole run's peak over both and the export: ZeRO-3's gathering settles from the second step on; short
        blocks, because on a CPU without bf16 instructions the emulated bf16 runs at about 1 GFLOP/s); in fp32
        launched with --mixed_precision no."""
        fp32 = isinstance(name, tuple)
        config, processes, checkpointing = (*name, False) if fp32 else RUNS[name]
        out = tmp_path_factory.mktemp(config.split(".")[0] + ("_fp32" if fp32 else "")) / "run"
        result = launch(
            config,
            "causal_lm.py",
            causal_lm_args(
                markov_data,
                out,
                model_config=MODEL,
                block_size=SEQ_LEN,
                per_device_train_batch_size=1,
                per_device_eval_batch_size=1,
                gradient_accumulation_steps=2,
                max_steps=2,
                max_eval_samples=2,
                gradient_checkpointing=str(checkpointing).lower(),
            ),
            num_processes=processes,
            env={**LIVE_RSS, **IMPORT_TIMES},
            launcher_args=FP32 if fp32 else [],
            real=True,  # a memory account: a forked rank's resident set holds its server's pages
        )
        imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if "import time:" in line}
        (out / "imported.json").write_text(json.dumps(sorted(imported)))
        drop_weights(out)  # the tests read run.json and final/config.json
        return out

    return LaunchedOnce(launch_run)


def worst(measured, name, key) -> float:
    """The largest of a run's per-rank account `key`."""
    return max(account[key] for account in read_run(measured[name])["memory_per_rank"])


def first_step_peak(measured, name) -> float:
    return max(a["phases"]["first_step"]["peak_rss_mb"] for a in read_run(measured[name])["memory_per_rank"])


def whole_run(measured, name) -> float:
    return max(rank["peak_rss_mb"] for rank in read_run(measured[name])["peak_memory_whole_run"])


@pytest.mark.slow
@pytest.mark.parametrize("name,precision", tiered_precisions(RUNS))
def test_estimate_matches_the_measured_account(name, precision, measured):
    run = measured[run_key(name, precision)]
    record = read_run(run)
    config, processes, _ = RUNS[name]
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[precision]
    assert record["participating_processes"] == processes and record["compute_dtype"] == dtype
    assert len(record["memory_per_rank"]) == processes
    assert record["total_parameters"] >= 100_000_000
    predicted = estimate_for_run(run, CONFIGS / config)
    whole_run = record["peak_memory_whole_run"]  # each rank's high-water mark, export included
    assert len(whole_run) == processes
    for rank, account in enumerate(record["memory_per_rank"]):
        assert whole_run[rank]["peak_rss_mb"] >= account["phases"]["first_step"]["peak_rss_mb"]
        state, peak = account["model_state_mb"], account["phases"]["first_step"]["peak_rss_mb"]
        print(
            f"{name} rank {rank}: model state {state:.0f} MB (estimated {predicted['model_state'] / 2**20:.0f}), "
            f"peak RSS {peak:.0f} MB (estimated {predicted['peak_mb']:.0f}); {account['bytes_by_category']}"
        )
        assert state == pytest.approx(predicted["model_state"] / 2**20, rel=0.05)
        assert peak == pytest.approx(predicted["peak_mb"], rel=0.15)
        for category in ("parameters", "master_weights", "gradients", "optimizer_states"):
            assert account[f"{category}_mb"] == pytest.approx(predicted[category] / 2**20, rel=0.05, abs=1), category
    if predicted["loading_peak"]:  # FSDP2: rank 0 holds the whole model while it broadcasts it into the shards
        loading = record["memory_per_rank"][0]["phases"]["prepared"]["peak_rss_mb"]
        expected = predicted["loading_peak"] / 2**20 + predicted["process_baseline_mb"]
        print(f"{name} rank 0 at prepare: peak RSS {loading:.0f} MB (estimated {expected:.0f})")
        assert loading == pytest.approx(expected, rel=0.15)


@pytest.mark.slow
def test_deepspeed_is_imported_only_by_deepspeeds_configs(measured):
    """A process of a run outside DeepSpeed's configs never imports deepspeed (~0.5 s of its start, and its resident
    memory, which the estimate's process baseline leaves out there): accelerate's unwrap, in prepare and after, would
    import it to test for its engine (common.launch.internals.engine_tests_without_importing_deepspeed). A ZeRO-3 run
    imports it, which shows the launches' import lists hold what the processes import."""
    imported = {
        name: set(json.loads((measured[run_key(name, MAKE_TEST_PRECISION)] / "imported.json").read_text()))
        for name in IN_MAKE_TEST
    }
    assert "deepspeed" in imported["zero3.yaml"] and "transformers" in imported["ddp.yaml"]
    assert not {"deepspeed", "deepspeed.ops"} & (imported["ddp.yaml"] | imported["fsdp.yaml"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", bf16_or_host_precision())
def test_sharded_strategies_hold_less_than_ddp(precision, measured):
    ddp, fsdp, zero3 = (run_key(name, precision) for name in ("ddp.yaml", "fsdp.yaml", "zero3.yaml"))
    ddp_state, ddp_peak = worst(measured, ddp, "model_state_mb"), first_step_peak(measured, ddp)
    for config in (fsdp, zero3):
        print(
            f"{config} ({precision}): model state {worst(measured, config, 'model_state_mb') / ddp_state:.2f}x DDP's, "
            f"peak RSS {first_step_peak(measured, config) / ddp_peak:.2f}x, over the whole run "
            f"{whole_run(measured, config) / whole_run(measured, ddp):.2f}x ({whole_run(measured, config):.0f} MB)"
        )
        assert worst(measured, config, "model_state_mb") <= 0.65 * ddp_state
    # ZeRO-3 keeps a bf16 model and gradient partition beside its fp32 master weights, and makes the fp32
    # gradients one optimizer sub-group at a time (common.launch.accelerator's sub_group_size); fused AdamW adds
    # no temporaries in the step. Over the whole run ZeRO-3 keeps two layers gathered at most
    # (common.launch.accelerator's stage3_max_live_parameters and _reuse_distance), and the export streams one tensor
    # at a time. On 2 processes a sharded rank holds half of DDP's model state plus the ~465 MB every process has
    # (0.62x-0.63x DDP's whole run, seen, DDP's gradients being views into its buckets); on 4 the shards halve again (a
    # DDP rank holds the same on any number of processes; zero3 on 4 also checkpoints activations, a few MB at these 16
    # tokens).
    # In fp32 (no autocast copies beside DDP's weights, nor ZeRO-3's bf16 partitions) the same ~465 MB per process
    # weighs more against DDP's smaller peak: about 0.72x, seen (the fp32 comment below).
    for config in (fsdp, zero3):
        assert whole_run(measured, config) <= {"bf16": 0.65, "fp32": 0.75}[precision] * whole_run(measured, ddp)
    export = read_run(measured[zero3])["final_export"]
    assert export["rss_peak_mb"] - export["rss_before_mb"] < 100  # the model in fp32 is 386 MB
    # Buckets sized to the model (h*h elements), not DeepSpeed's fixed 500M (1 GB in bf16)
    assert worst(measured, zero3, "communication_buffers_mb") < 10
    # FSDP: rank 1 builds its model on the meta device; rank 0's weights are broadcast into the shards
    phases = read_run(measured[fsdp])["memory_per_rank"][1]["phases"]
    assert phases["model_built"]["rss_mb"] - phases["started"]["rss_mb"] < 100  # a whole model is 386 MB


@pytest.mark.slow
@pytest.mark.exhaustive
def test_sharded_strategies_on_4_hold_less_still(measured):
    """On 4 the shards halve again (a DDP rank holds the same on any number of processes); zero3 on 4 also
    checkpoints activations, each layer keeping its input only (the micro-batch is the same as on 2)."""
    for config in ("fsdp.yaml on 4", "zero3.yaml on 4, checkpointing"):
        print(
            f"{config}: peak RSS {first_step_peak(measured, config) / first_step_peak(measured, 'ddp.yaml'):.2f}x DDP's, over the whole run "
            f"{whole_run(measured, config) / whole_run(measured, 'ddp.yaml'):.2f}x ({whole_run(measured, config):.0f} MB)"
        )
        assert first_step_peak(measured, config) <= 0.6 * first_step_peak(measured, "ddp.yaml")
        assert whole_run(measured, config) <= 0.6 * whole_run(measured, "ddp.yaml")
    checkpointed = worst(measured, "zero3.yaml on 4, checkpointing", "activations_mb")
    print(
        f"activations per micro-batch: {worst(measured, 'zero3.yaml', 'activations_mb')} MB, {checkpointed} MB checkpointed"
    )
    assert checkpointed < 0.2 * worst(measured, "zero3.yaml", "activations_mb")


# fp32 (launched with --mixed_precision no). On 2, a sharded rank holds half of DDP's 16 bytes per parameter, plus
# the process's own ~465 MB that every config has, plus about two layers in flight (FSDP2's gathered layer, its
# gradients and the next one prefetched; ZeRO-3's live parameters): about 0.72x DDP's peak in fp32, seen, since DDP's
# gradients are views into its buckets (common.launch.accelerator); on 4, their share halves again.


def fp32_record(measured, config, processes) -> dict:
    record = read_run(measured[(config, processes)])
    assert (record["participating_processes"], record["compute_dtype"]) == (processes, "float32")
    assert record["total_parameters"] >= 100_000_000
    return record


@pytest.mark.slow
@pytest.mark.exhaustive
def test_ddp_holds_its_gradients_once_and_zero3_keeps_no_second_fp32_copy(measured):
    # DDP: the gradients are the all-reduce buckets, held once (common.launch.accelerator's gradient_as_bucket_view)
    for account in fp32_record(measured, "ddp.yaml", 2)["memory_per_rank"]:
        assert account["communication_buffers_mb"] == 0
        assert account["gradients_mb"] == pytest.approx(account["parameters_mb"], rel=0.01)
    # ZeRO-3 updates an fp32 model's own partitions: no second fp32 copy
    # (common.launch.internals.share_zero3_fp32_partitions)
    for account in fp32_record(measured, "zero3.yaml", 2)["memory_per_rank"]:
        assert account["master_weights_mb"] == 0
        assert account["parameters_mb"] == pytest.approx(account["gradients_mb"], rel=0.01)
        assert account["optimizer_states_mb"] == pytest.approx(2 * account["parameters_mb"], rel=0.01)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_sharded_strategies_hold_less_than_ddp_in_fp32_on_4(measured):
    fp32_record(measured, "ddp.yaml", 2)  # each run's processes, precision and size checked
    ddp = whole_run(measured, ("ddp.yaml", 2))
    for config in ("fsdp.yaml", "zero3.yaml"):
        fp32_record(measured, config, 4)
        sharded = whole_run(measured, (config, 4))
        print(f"fp32 {config} on 4: whole run {sharded:.0f} MB, {sharded / ddp:.3f}x DDP's")
        assert sharded <= 0.6 * ddp
    for account in fp32_record(measured, "zero3.yaml", 4)["memory_per_rank"]:  # no second fp32 copy on 4 either
        assert account["master_weights_mb"] == 0
        assert account["parameters_mb"] == pytest.approx(account["gradients_mb"], rel=0.01)
        assert account["optimizer_states_mb"] == pytest.approx(2 * account["parameters_mb"], rel=0.01)


def test_estimate_memory_refuses_a_missing_config(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "scripts/estimate_memory.py",
            "--model",
            "recipes/configs/tiny_llama.json",
            "--config",
            str(tmp_path / "none.yaml"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: --config {tmp_path / 'none.yaml'} is not a file")


def saved_by_one_layer(config, regime: str, tokens: int = 96) -> int:
    """Bytes the first decoder layer's forward saves for backward (one row of `tokens`), counted once per storage:
    the weights and autocast's cached copies of them left out (the estimate counts those apart)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if regime == "bf16":  # FSDP2's mixed precision and DeepSpeed hand the layers bf16 weights
        model = model.to(torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    saved, inside = {}, [False]
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def keep(tensor):
        storage = tensor.untyped_storage()
        cast_weight = regime == "autocast" and tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in shapes
        if inside[0] and storage.data_ptr() not in weights and not cast_weight:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime != "fp32"),
        torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor),
    ):
        model(input_ids=ids, labels=ids)
    return sum(saved.values())


@pytest.mark.parametrize("regime", ["fp32", "autocast", "bf16"])
def test_the_estimate_counts_what_a_decoder_layer_saves_in_each_precision_regime(regime, tmp_path):
    """A decoder layer's saved tensors per token against activation_bytes, for Llama with grouped-query attention,
    Qwen3 (its per-head q/k norms, queries wider than the hidden size) and Qwen3-MoE (its experts' grouped matmul,
    which autocast leaves in fp32): in fp32; fp32 weights under bf16 autocast
    (ddp, tp: each RMSNorm keeps its fp32 input and output, each projection its own bf16 cast of the normed input);
    bf16 weights (FSDP2's mixed precision, DeepSpeed). Within 3% (the rotary cos/sin, shared by every layer, are
    not a layer's; the estimate leaves them out). Before: 1.29 to 1.93x the estimate under autocast (the MoE 1.93)."""
    from transformers import AutoConfig

    from common.planning.memory import activation_bytes, read_model

    c, w = {"fp32": (4, 4), "autocast": (2, 4), "bf16": (2, 2)}[regime]
    llama = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=2)
    qwen3 = dict(llama, head_dim=96, layer_types=["full_attention"])  # queries 8 x 96 wide, keys and values 2 x 96
    moe = dict(llama, head_dim=64, moe_intermediate_size=256)  # Qwen3-MoE: 8 experts, 2 a token
    configs = REPO / "recipes/configs"
    for name, shape in ((MODEL, llama), (configs / "tiny_qwen3.json", qwen3), (configs / "tiny_qwen3_moe.json", moe)):
        config = AutoConfig.from_pretrained(name, num_hidden_layers=1, vocab_size=512, **shape)
        config.save_pretrained(tmp_path / config.model_type)
        model = read_model(str(tmp_path / config.model_type))
        estimated = activation_bytes(model, 1, 96, c, False, head=False, weight_bytes=w)
        measured = saved_by_one_layer(config, regime)
        saves, estimate = measured / 96, estimated / 96
        print(f"{config.model_type} {regime}: a layer saves {saves:.0f} B a token, estimated {estimate:.0f}")
        assert measured == pytest.approx(estimated, rel=0.03)


def test_estimate_memory_prints_each_category(capsys):
    result = load_script("scripts/estimate_memory.py").main(
        [
            "--model",
            str(REPO / "recipes/configs/tiny_llama.json"),
            "--config",
            str(REPO / "accelerate_configs/zero3.yaml"),
            "--vocab_size",
            "100",
            "--seq_len",
            "32",
            "--json",
            "/dev/null",
        ]
    )
    printed = capsys.readouterr().out
    for key in ("parameters", "master_weights", "gradients", "optimizer_states", "activations", "peak"):
        assert key in printed
    psi = result["model"]["parameters"]
    assert result["strategy"] == {
        "strategy": "deepspeed",
        "zero_stage": 3,
        "offload": False,
        "offload_params": False,
        "replicas": 1,
        "tp_size": 1,
        "num_processes": 2,
        "sp_size": 1,
        "cp_size": 1,
        "ep_size": 1,
        "mixed_precision": "bf16",
        "fsdp_reshard_after_forward": True,
        "activation_checkpointing": False,
        "fsdp_cpu_ram_efficient_loading": False,
        "zero3_sub_group_size": 10_000_000,
    }  # common.launch.accelerator's, the YAML naming none
    assert result["parameters"] == psi  # bf16 partition: 2 bytes x psi / 2 ranks
    # 16 psi / 2: bf16 partition and gradients, fp32 master weights, Adam (the fp32 gradients are transient)
    assert result["model_state"] == pytest.approx(8 * psi, abs=4)
    assert result["step_transient"] == 6 * psi / 2  # all in one sub-group at this size: bf16 flatten + fp32
    json.dumps(result)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_sequence_parallelism_splits_each_ranks_activations(markov_data, tmp_path):
    """At 101M, bf16, rows of 512 tokens, 1 x accumulation 2: under zero3_ulysses.yaml and fsdp_cp.yaml each
    rank saves for backward the activations of its 256 tokens, about half of what zero3.yaml's ranks save for
    whole rows, as scripts/estimate_memory.py predicts; the model state is ZeRO-3's (FSDP2's) over both ranks."""
    seq_len, measured = 512, {}
    for config in ("zero3.yaml", "zero3_ulysses.yaml", "fsdp_cp.yaml"):
        out = tmp_path / config.removesuffix(".yaml")
        launch(
            config,
            "causal_lm.py",
            causal_lm_args(
                markov_data,
                out,
                model_config=MODEL,
                block_size=seq_len,
                per_device_train_batch_size=1,
                per_device_eval_batch_size=1,
                gradient_accumulation_steps=2,
                max_steps=1,
            ),
            real=True,  # a memory account
        )
        drop_weights(out)
        record = read_run(out)
        assert record["participating_processes"] == 2 and record["total_parameters"] >= 100_000_000
        predicted = estimate_for_run(out, CONFIGS / config)
        for rank, account in enumerate(record["memory_per_rank"]):
            print(
                f"{config} rank {rank}: activations {account['activations_mb']:.0f} MB (estimated "
                f"{predicted['activations'] / 2**20:.0f}), model state {account['model_state_mb']:.0f} MB "
                f"(estimated {predicted['model_state'] / 2**20:.0f})"
            )
            assert account["activations_mb"] == pytest.approx(predicted["activations"] / 2**20, rel=0.15)
            assert account["model_state_mb"] == pytest.approx(predicted["model_state"] / 2**20, rel=0.05)
        measured[config] = max(account["activations_mb"] for account in record["memory_per_rank"])
    for config in ("zero3_ulysses.yaml", "fsdp_cp.yaml"):
        ratio = measured[config] / measured["zero3.yaml"]
        print(f"activations per rank, {config} / zero3.yaml: {ratio:.2f}")
        assert 0.4 < ratio < 0.6


@pytest.mark.slow
def test_make_estimate_memory():
    from conftest import run

    result = run(
        [
            "make",
            "-s",
            "estimate-memory",
            "MODEL=recipes/configs/tiny_llama.json",
            "CONFIG=accelerate_configs/fsdp.yaml",
            "ARGS=--seq_len 32 --vocab_size 100",
        ]
    )
    assert "fsdp.yaml on 2 process(es), bf16, batch 1 x 32 tokens" in result.stdout
    assert "optimizer_states" in result.stdout and "peak" in result.stdout


def test_the_account_counts_torchao_float8_weights_by_the_tensor_they_wrap():
    """Under mixed_precision fp8 with FSDP2 accelerate swaps in torchao's Float8Linear with weights wrapped for
    the float8 all-gather, a subclass with no storage of its own (reading it raised on an H100 at the first
    forward): the account counts the weight it wraps, once, as parameters, and its gradient and Adam's moments. torchao's float8 matmuls run
    on this CPU under bf16 autocast, so this is the real forward, backward and step."""
    float8 = pytest.importorskip("torchao.float8", reason="torchao is in the test extras: make install-test")
    import torch

    from common.training.memory import MemoryAccount

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(3)])
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    assert all(type(p).__name__ == "WeightWithDynamicFloat8CastTensor" for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    account = MemoryAccount(model, optimizer, torch.device("cpu"))
    inputs = torch.randn(32, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(inputs).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    report = account.report
    weights = 3 * 128 * 128 * 4  # fp32 weights under bf16 autocast, as accelerate keeps them
    assert report["bytes_by_category"]["parameters"] == {"float32": weights}
    assert report["bytes_by_category"]["gradients"] == {"float32": weights}
    # Adam's two moments, and its fp32 step counter per weight
    assert report["bytes_by_category"]["optimizer_states"] == {"float32": 2 * weights + 3 * 4}
    # saved for backward: each layer's input cast to float8 (1 byte an element) and scales, at least
    assert account.activation_bytes >= 3 * 32 * 128


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_pipeline_rank_at_118m_reads_its_stages_in_about_its_share_of_a_whole_loads_memory(tmp_path):
    """make benchmark-stage-loading (llama_100m.json with an 8192 vocabulary, a bf16 folder loaded in fp32) at 2 and
    4 stages: each rank read its stages alone, holds what make estimate-memory's loading_peak says, and its
    resident set rose by at most 1/p of the whole load's rise plus 10% of it."""
    from conftest import run

    results, page = tmp_path / "results.json", tmp_path / "page.md"  # the page: not make's docs/ one
    run(["make", "-s", "benchmark-stage-loading", f"ARGS=--json {results} --docs {page}"])
    rows = json.loads(results.read_text())
    whole = rows[0]
    assert whole["stages"] == 0 and whole["held"] >= 4 * 100_000_000
    assert [(row["stages"], row["rank"]) for row in rows[1:]] == [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    for row in rows:
        print(
            f"{row['stages']} stages, rank {row['rank']}: rise {row['rise'] / 2**20:.0f} MB of {whole['rise'] / 2**20:.0f}"
        )
        assert row["held"] == row["estimated"]
        if row["stages"]:
            assert row["stages_only"] and row["rise"] <= whole["rise"] * (1 / row["stages"] + 0.1), row
    assert sum(row["held"] for row in rows if row["stages"] == 4) == whole["held"]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_each_pipeline_stage_at_101m_holds_what_make_estimate_memory_says(tmp_path):
    """make benchmark-pipeline-memory at 101M parameters, bf16, 1F1B, 2 micro-batches of 1 x 64 tokens per step, 2
    steps: pp.yaml on 2 processes and dp_pp.yaml on 4 (2 pipelines of 2 stages), each rank's model state within 5%
    and its peak resident set through the last step (glibc returning freed blocks) within 15% of make
    estimate-memory's row for its stage; the page has a row for each rank."""
    from conftest import run

    results, page = tmp_path / "results.json", tmp_path / "page.md"  # the page: not make's docs/ one
    runs = "--runs pp.yaml:1F1B dp_pp.yaml:1F1B --block_size 64 --accumulation 2 --steps 2"
    run(["make", "-s", "benchmark-pipeline-memory", f"ARGS={runs} --json {results} --docs {page}"])
    measured = json.loads(results.read_text())
    assert [result["processes"] for result in measured] == [2, 4]
    for result in measured:
        assert result["parameters"] >= 100_000_000 and result["compute_dtype"] == "bfloat16" and result["steps"] == 2
        assert [rank["rank"] for rank in result["ranks"]] == list(range(result["processes"]))
        for rank in result["ranks"]:
            print(
                f"{result['run']} rank {rank['rank']} (stages {rank['stage_indices']}): model state "
                f"{rank['model_state_mb']:.0f} MB (estimated {rank['estimated_model_state_mb']:.0f}), peak "
                f"{rank['peak_mb']:.0f} MB (estimated {rank['estimated_peak_mb']:.0f}), by the first step "
                f"{rank['first_step_peak_mb']:.0f}"
            )
            assert rank["model_state_mb"] == pytest.approx(rank["estimated_model_state_mb"], rel=0.05)
            assert rank["peak_mb"] == pytest.approx(rank["estimated_peak_mb"], rel=0.15)
    assert len([line for line in page.read_text().splitlines() if line.startswith("| `")]) == 6


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_last_stage_of_a_large_vocabulary_holds_what_make_estimate_memory_says(real_model, tmp_path):
    """SmolLM2-135M (a vocabulary of 49,152, its head tied to its embeddings) under pp.yaml, bf16, 1F1B, 4
    micro-batches of 1 x 512 tokens: the last stage's rank also holds the logits of each micro-batch in flight (to
    its backward) and the loss's fp32 copies. Each rank within 15% of its stage's row (model state within 5%), and the last stage's
    rank above the first's by the estimated difference within 25% (the logits' share: without it the rows differ by a
    third as much)."""
    from conftest import run

    results, page = tmp_path / "results.json", tmp_path / "page.md"  # the page: not make's docs/ one
    args = f"--model_name_or_path {real_model} --runs pp.yaml:1F1B --block_size 512 --accumulation 4 --steps 2"
    run(["make", "-s", "benchmark-pipeline-memory", f"ARGS={args} --json {results} --docs {page}"])
    (result,) = json.loads(results.read_text())
    assert result["processes"] == 2 and result["parameters"] == 134_515_008 and result["compute_dtype"] == "bfloat16"
    first, last = result["ranks"]
    for rank in (first, last):
        print(
            f"SmolLM2 rank {rank['rank']}: model state {rank['model_state_mb']:.0f} MB (estimated "
            f"{rank['estimated_model_state_mb']:.0f}), peak {rank['peak_mb']:.0f} MB (estimated "
            f"{rank['estimated_peak_mb']:.0f})"
        )
        assert rank["model_state_mb"] == pytest.approx(rank["estimated_model_state_mb"], rel=0.05)
        assert rank["peak_mb"] == pytest.approx(rank["estimated_peak_mb"], rel=0.15)
    measured, estimated = last["peak_mb"] - first["peak_mb"], last["estimated_peak_mb"] - first["estimated_peak_mb"]
    print(f"the last stage's rank above the first's: {measured:.0f} MB (estimated {estimated:.0f})")
    assert measured == pytest.approx(estimated, rel=0.25)
