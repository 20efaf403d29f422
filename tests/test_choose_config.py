"""make choose-config: every config ranked by estimated memory and step time, the fastest that fits
written as an accelerate YAML that launches as it is; bad input refused in one line. (Its check
against measured runs on this host is make benchmark-choice, docs/choose-config.md.)"""

import json

import pytest
import yaml
from conftest import REPO, causal_lm_args, launch, load_script, read_run, run


choose_config = load_script("scripts/choose_config.py")

from common.planning import step_time  # noqa: E402


LLAMA3_8B = str(REPO / "recipes/configs/llama3_8b.json")
LLAMA3_70B = str(REPO / "recipes/configs/llama3_70b.json")


def choose(tmp_path, *argv) -> dict:
    return choose_config.main(
        [*map(str, argv), "--output", str(tmp_path / "chosen.yaml"), "--json", str(tmp_path / "table.json")]
    )


def test_llama3_8b_on_8_h100_gets_a_config_that_fits_and_its_yaml(tmp_path):
    result = choose(
        tmp_path, "--model", LLAMA3_8B, "--device", "h100", "--num_devices", 8, "--seq_len", 4096, "--global_batch", 64
    )
    assert result["model"]["parameters"] == 8_030_261_248  # Meta's published Llama-3-8B
    # the embeddings and the head sit outside the decoder layers: FSDP2's root unit
    assert result["model"]["root_parameters"] == 2 * 128256 * 4096 + 4096
    rows = {r["config"]: r for r in result["rows"]}
    chosen = [r for r in result["rows"] if r["verdict"] == "chosen"]
    assert len(chosen) == 1 and chosen[0] is result["rows"][0]
    limit = 80 * 0.9  # the preset's memory less the default headroom
    for row in result["rows"]:
        assert row["fits"] == (row["device_gb"] <= limit and row["host_gb_per_node"] <= 2048), row
        assert row["step_s"] >= chosen[0]["step_s"] or not row["fits"]
        assert row["micro_batch"] * row["accumulation"] == 64 // 8 * row["group"]  # a group trains one batch
    assert not rows["ddp.yaml"]["fits"]  # 16 bytes per parameter: 128 GB of model state per device
    assert rows["ddp.yaml"]["verdict"].startswith("does not fit: needs")
    written = (tmp_path / "chosen.yaml").read_text()
    config = yaml.safe_load(written)
    assert config["num_processes"] == 8 and config["num_machines"] == 1
    shipped = yaml.safe_load((REPO / "accelerate_configs" / chosen[0]["config"]).read_text())
    assert {k: v for k, v in config.items() if k not in ("num_processes", "fsdp_config")} == {
        k: v for k, v in shipped.items() if k not in ("num_processes", "fsdp_config")
    }
    assert (
        f"--per_device_train_batch_size {chosen[0]['micro_batch']} --gradient_accumulation_steps "
        f"{chosen[0]['accumulation']} --block_size 4096" in written.splitlines()[1]
    )


def test_llama3_70b_on_one_node_needs_offload_and_the_cpu_ram_for_it(tmp_path):
    result = choose(
        tmp_path,
        "--model",
        LLAMA3_70B,
        "--device",
        "h100",
        "--num_devices",
        8,
        "--seq_len",
        4096,
        "--global_batch",
        64,
    )
    fitting = {r["config"] for r in result["rows"] if r["fits"]}
    assert fitting and fitting <= {"zero3_offload.yaml", "fsdp_offload.yaml", "zero2_offload.yaml"}
    chosen = result["rows"][0]
    assert chosen["host_gb_per_node"] > 1000  # 70B's fp32 master copy and Adam moments: over 840 GB of CPU RAM
    with pytest.raises(SystemExit) as refused:  # the same on nodes with 512 GB of RAM: nothing fits
        choose(
            tmp_path / "small",
            "--model",
            LLAMA3_70B,
            "--device",
            "h100",
            "--num_devices",
            8,
            "--seq_len",
            4096,
            "--global_batch",
            64,
            "--host_memory_gb",
            512,
        )
    message = str(refused.value)
    assert message.startswith("error: no config fits") and "\n" not in message
    assert not (tmp_path / "small" / "chosen.yaml").exists()
    table = json.loads((tmp_path / "small" / "table.json").read_text())
    assert all("does not fit" in r["verdict"] for r in table["rows"])
    assert any("CPU RAM per node" in r["verdict"] for r in table["rows"])


def test_multi_node_choice_is_a_filled_multi_node_template(tmp_path):
    result = choose(
        tmp_path,
        "--model",
        LLAMA3_70B,
        "--device",
        "a100",
        "--num_devices",
        64,
        "--num_nodes",
        8,
        "--seq_len",
        2048,
        "--global_batch",
        64,
    )
    assert {r["config"] for r in result["rows"]} == set(step_time.MULTI_NODE)
    config = yaml.safe_load((tmp_path / "chosen.yaml").read_text())
    assert config["num_processes"] == 64 and config["num_machines"] == 8
    assert config["main_process_ip"].startswith("FILL")  # the template's field for the user's cluster


@pytest.mark.parametrize(
    "config, bus_bytes_per_psi",
    [  # k = 4 micro-batches, c = 2 (bf16)
        ("ddp.yaml", 2 * 4),  # fp32 gradients all-reduced once a step
        ("zero1.yaml", 2 + 2),  # a reduce-scatter at the boundary, the updated weights all-gathered
        ("zero2.yaml", 4 * 2 + 2),  # a reduce-scatter per micro-batch
        ("zero3.yaml", 4 * 3 * 2),  # forward and backward all-gathers and a reduce-scatter per micro-batch
        ("fsdp.yaml", 4 * 3 * 2),
        ("fsdp_shard_grad_op.yaml", 4 * 2 * 2),  # no re-gather for backward
    ],
)
def test_each_configs_traffic_is_its_collectives_bytes_at_the_link(tmp_path, config, bus_bytes_per_psi):
    result = choose(
        tmp_path,
        "--model",
        LLAMA3_8B,
        "--device",
        "h100",
        "--num_devices",
        8,
        "--seq_len",
        1024,
        "--global_batch",
        32,
        "--micro_batch",
        1,
        "--configs",
        config,
        "--link_gbps",
        100,
        "--device_memory_gb",
        1000,
    )
    row = result["rows"][0]
    ring = 7 / 8 * result["model"]["parameters"]
    assert row["comm_s"] == pytest.approx(bus_bytes_per_psi * ring / 100e9, rel=1e-9)
    assert row["step_s"] == pytest.approx(max(row["compute_s"], row["comm_s"]) + row["other_s"])


def test_long_sequences_choose_sequence_parallelism_and_its_split_reaches_the_yaml(tmp_path):
    """Llama-3-8B at 128k tokens on 8 H100s: whole rows' activations fit no device even checkpointed; rows split
    over sp_size devices (zero3_ulysses.yaml) do, and the YAML carries the split and the groups beside it. Rows
    split by ring attention (fsdp_cp.yaml) fit too, as fast (compute-bound), with more traffic: the ring passes the
    whole rows' keys and values, Ulysses' all-to-alls a slice's queries, keys, values and output."""
    result = choose(
        tmp_path,
        "--model",
        LLAMA3_8B,
        "--device",
        "h100",
        "--num_devices",
        8,
        "--seq_len",
        131072,
        "--global_batch",
        8,
    )
    chosen = result["rows"][0]
    assert chosen["config"] == "zero3_ulysses.yaml" and chosen["verdict"] == "chosen" and chosen["sp_size"] > 1
    ring = result["rows"][1]
    assert ring["config"] == "fsdp_cp.yaml" and "more" in ring["verdict"] and "communication" in ring["verdict"]
    assert not any(r["fits"] for r in result["rows"][2:])
    config = yaml.safe_load((tmp_path / "chosen.yaml").read_text())["parallelism_config"]
    assert config["parallelism_config_sp_size"] == chosen["sp_size"]
    assert config.get("parallelism_config_dp_shard_size", 1) * chosen["sp_size"] == 8


def test_sequence_parallel_traffic_is_zero3s_per_micro_step_and_the_all_to_alls(tmp_path):
    """A group reads its sp ranks' batches in turn (sp x accumulation micro-steps, each gathering ZeRO-3's
    weights twice and reducing once), and each layer exchanges its slice's q, k, v and output forward and
    backward, each (sp - 1) / sp of it."""
    result = choose(
        tmp_path,
        "--model",
        LLAMA3_8B,
        "--device",
        "h100",
        "--num_devices",
        8,
        "--seq_len",
        1024,
        "--global_batch",
        32,
        "--micro_batch",
        1,
        "--configs",
        "zero3_ulysses.yaml",
        "--link_gbps",
        100,
        "--device_memory_gb",
        1000,
        "--activation_checkpointing",
        "off",
    )
    row, model = result["rows"][0], result["model"]
    sp, micro_steps = row["sp_size"], 4 * row["sp_size"]
    zero3 = micro_steps * 3 * 2 * 7 / 8 * model["parameters"]
    width = 2 * 4096 + 2 * 1024  # Llama-3-8B: 32 query heads, 8 key/value heads of 128
    exchange = micro_steps * 2 * 32 * (1024 // sp) * width * 2 * (sp - 1) / sp
    assert sp > 1 and row["comm_s"] == pytest.approx((zero3 + exchange) / 100e9, rel=1e-9)


def test_ring_attention_traffic_is_fsdp2s_per_micro_step_and_the_rings_and_its_split_reaches_the_yaml(tmp_path):
    """fsdp_cp.yaml at every cp_size that divides the devices: a ring reads a batch cp times its per-device one
    (cp x accumulation micro-steps, each FSDP2's gathers and reduction), and each layer passes the whole rows'
    keys and values round the ring forward, again backward with their gradients, each (cp - 1) / cp of it."""
    options = [
        "--model",
        LLAMA3_8B,
        "--device",
        "h100",
        "--num_devices",
        8,
        "--seq_len",
        1024,
        "--global_batch",
        32,
        "--micro_batch",
        1,
        "--link_gbps",
        100,
        "--device_memory_gb",
        1000,
        "--activation_checkpointing",
        "off",
    ]
    fsdp = choose(tmp_path / "fsdp", *options, "--configs", "fsdp.yaml")["rows"][0]
    result = choose(tmp_path / "ring", *options, "--configs", "fsdp_cp.yaml")
    row = result["rows"][0]
    cp, per_micro_step = row["sp_size"], fsdp["comm_s"] * 100e9 / 4  # fsdp.yaml: 1 x accumulation 4
    ring = 4 * cp * 3 * 32 * 1024 * 2 * 1024 * 2 * (cp - 1) / cp  # 8 key/value heads of 128
    assert cp > 1 and row["comm_s"] * 100e9 == pytest.approx(per_micro_step * 4 * cp + ring, rel=1e-9)
    config = yaml.safe_load((tmp_path / "ring" / "chosen.yaml").read_text())["parallelism_config"]
    assert config["parallelism_config_cp_size"] == cp and "parallelism_config_sp_size" not in config
    assert config.get("parallelism_config_dp_shard_size", 1) * cp == 8


def test_checkpointing_precision_and_hsdp_sizes_reach_the_yaml_and_the_command(tmp_path):
    fsdp = choose(
        tmp_path / "fsdp",
        "--model",
        LLAMA3_8B,
        "--device",
        "h100",
        "--num_devices",
        8,
        "--global_batch",
        64,
        "--configs",
        "fsdp.yaml",
        "--activation_checkpointing",
        "on",
        "--mixed_precision",
        "no",
    )
    written = (tmp_path / "fsdp" / "chosen.yaml").read_text()
    config = yaml.safe_load(written)
    assert config["fsdp_config"]["fsdp_activation_checkpointing"] is True and config["mixed_precision"] == "no"
    assert "--gradient_checkpointing" not in written.splitlines()[1]  # FSDP's own checkpointing, from the YAML
    bf16 = choose(
        tmp_path / "bf16",
        "--model",
        LLAMA3_8B,
        "--device",
        "h100",
        "--num_devices",
        8,
        "--global_batch",
        64,
        "--configs",
        "fsdp.yaml",
        "--activation_checkpointing",
        "on",
    )
    assert fsdp["rows"][0]["compute_s"] == pytest.approx(bf16["rows"][0]["compute_s"] * 989.4 / 66.9)  # fp32 peak
    choose(
        tmp_path / "zero3",
        "--model",
        LLAMA3_8B,
        "--device",
        "h100",
        "--num_devices",
        8,
        "--global_batch",
        64,
        "--configs",
        "zero3.yaml",
        "--activation_checkpointing",
        "on",
    )
    assert "--gradient_checkpointing true" in (tmp_path / "zero3" / "chosen.yaml").read_text().splitlines()[1]
    choose(
        tmp_path / "hsdp",
        "--model",
        LLAMA3_8B,
        "--device",
        "h100",
        "--num_devices",
        32,
        "--num_nodes",
        4,
        "--global_batch",
        64,
        "--configs",
        "multi_node_hsdp.yaml",
    )
    written = (tmp_path / "hsdp" / "chosen.yaml").read_text()
    assert yaml.safe_load(written)["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 4,
        "parallelism_config_dp_shard_size": 8,
    }
    assert "--machine_rank NODE_RANK --main_process_ip NODE0_ADDRESS" in written.splitlines()[1]


def test_one_cpu_device_is_ranked_without_a_link(tmp_path):
    result = choose(
        tmp_path,
        "--model",
        str(REPO / "recipes/configs/tiny_llama.json"),
        "--device",
        "cpu",
        "--num_devices",
        1,
        "--seq_len",
        32,
        "--global_batch",
        4,
    )
    assert {r["config"] for r in result["rows"]} == set(step_time.ONE_DEVICE)
    assert result["rows"][0]["verdict"] == "chosen" and all(r["comm_s"] == 0 for r in result["rows"])


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--num_devices", 6, "--num_nodes", 4], "is not a multiple of --num_nodes"),
        (["--num_devices", 8, "--global_batch", 12], "does not divide over 8 devices"),
        (["--num_devices", 8, "--global_batch", 0], "pass at least 1 sequence"),
        (["--num_devices", 8, "--micro_batch", 3], "does not divide the per-device batch 8"),
        (["--num_devices", 8, "--doctor_report", "no_such_report.json"], "is not make doctor's report"),
        (["--num_devices", 2, "--device", "cpu"], "pass --doctor_report"),
        (["--num_devices", 8, "--configs", "multi_node_ddp.yaml"], "not among the configs for 8 device(s)"),
        (["--num_devices", 8, "--model", "no/such/model"], "gives no model config"),
        (["--num_devices", 8, "--recipe", "dpo", "--configs", "pp.yaml"], "recipes/dpo.py scores whole rows"),
        (["--num_devices", 2, "--configs", "dp_pp.yaml"], "it needs 4 or more devices"),
        (["--num_devices", 2, "--configs", "fsdp_tp.yaml"], "it needs 4 or more devices a node"),
        (["--num_devices", 16, "--num_nodes", 2, "--configs", "tp.yaml"], "ranked on one node only"),
        (["--num_devices", 16, "--num_nodes", 2, "--configs", "fsdp_cp.yaml"], "ranked on one node only"),
        (["--num_devices", 8, "--recipe", "dpo", "--configs", "zero3_ulysses.yaml"], "dpo.py does not run under"),
    ],
)
def test_bad_input_is_refused_in_one_line(tmp_path, argv, says):
    values = {"--model": LLAMA3_8B, "--device": "h100", "--global_batch": 64}
    given = dict(zip(argv[::2], argv[1::2]))
    with pytest.raises(SystemExit) as refused:
        choose(tmp_path, *[str(x) for pair in {**values, **given}.items() for x in pair])
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "chosen.yaml").exists()


def test_an_existing_output_is_kept(tmp_path):
    mine = tmp_path / "chosen.yaml"
    mine.write_text("my own config\n")
    with pytest.raises(SystemExit) as refused:
        choose(tmp_path, "--model", LLAMA3_8B, "--device", "h100", "--num_devices", 8, "--global_batch", 64)
    assert "exists; pass another --output or --overwrite" in str(refused.value)
    assert mine.read_text() == "my own config\n"


@pytest.mark.slow
def test_the_chosen_yaml_launches_as_written_on_this_host(markov_data, tmp_path):
    """make choose-config on this host (its compute and memory measured), then the YAML it wrote launched
    with the arguments it printed: the run takes part on every process it was chosen for."""
    chosen = tmp_path / "chosen.yaml"
    result = run(
        [
            "make",
            "-s",
            "choose-config",
            "MODEL=recipes/configs/tiny_llama.json",
            f"ARGS=--num_devices 2 --global_batch 8 --seq_len 32 --link_gbps 1 --output {chosen} "
            f"--json {tmp_path / 'table.json'}",
        ]
    )
    table = json.loads((tmp_path / "table.json").read_text())
    row = table["rows"][0]
    assert row["verdict"] == "chosen" and f"wrote {chosen}" in result.stdout
    assert f"--per_device_train_batch_size {row['micro_batch']}" in result.stdout.splitlines()[-1]
    record = launch_as_printed(chosen, row["micro_batch"], row["accumulation"], markov_data, tmp_path / "run")
    assert record["participating_processes"] == 2 and record["effective_batch_size"] == 8
    kind = yaml.safe_load((REPO / "accelerate_configs" / row["config"]).read_text())["distributed_type"]
    assert record["distributed_type"] == {"NO": "MULTI_CPU", "MULTI_GPU": "MULTI_CPU"}.get(kind, kind)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_make_benchmark_choice_writes_the_comparison(tmp_path):
    page = tmp_path / "choice.md"
    result = run(
        [
            "make",
            "-s",
            "benchmark-choice",
            f"ARGS=--model_config recipes/configs/tiny_llama.json --steps 3 "
            f"--configs ddp.yaml zero3.yaml --docs {page}",
        ]
    )
    caps = [line for line in result.stdout.splitlines() if line.startswith("cap ")]
    assert len(caps) == 2  # a cap just above each measured peak
    written = page.read_text()
    for heading in (
        "| config | measured s/step | estimated s/step |",
        "## Published setups",
        "Llama-3-70B",
        "What its authors used",
    ):
        assert heading in written


TINY_LLAMA = str(REPO / "recipes/configs/tiny_llama.json")
# this host's figures given, not measured (seconds saved; the batch arithmetic does not depend on them)
ON_THIS_HOST = ["--device", "cpu", "--peak_tflops", 0.1, "--memory_gbps", 10, "--link_gbps", 1, "--seq_len", 32]


def printed_command(tmp_path, capsys, *argv) -> tuple[dict, dict, dict]:
    """choose-config for 2 processes here; the launch arguments it printed, and the YAML it wrote."""
    result = choose(tmp_path, "--model", TINY_LLAMA, "--num_devices", 2, *ON_THIS_HOST, *argv)
    words = capsys.readouterr().out.splitlines()[-1].split()
    arguments = {word: value for word, value in zip(words, words[1:]) if word.startswith("--")}
    return result, arguments, yaml.safe_load((tmp_path / "chosen.yaml").read_text())


def effective_batch(arguments: dict, config: dict) -> int:
    """What run.json's effective_batch_size says for this command: the recipe's own rule (common.outputs.run_info,
    through common.launch.mesh.data_parallel_size) over the written YAML's processes and mesh."""
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig

    from common.launch.mesh import data_parallel_size

    sizes = {
        key.removeprefix("parallelism_config_"): value
        for key, value in (config.get("parallelism_config") or {}).items()
        if key.endswith("_size")
    }
    # pp_size is common.parallel.pipeline's, not accelerate's (common.launch.mesh.pipeline_shards asks the
    # PipelineAccelerator a run builds)
    pipeline = sizes.pop("pp_size", 1)
    mesh = SimpleNamespace(num_processes=config["num_processes"], parallelism_config=ParallelismConfig(**sizes))
    per_device = int(arguments["--per_device_train_batch_size"])
    return per_device * int(arguments["--gradient_accumulation_steps"]) * data_parallel_size(mesh) // pipeline


def test_every_config_it_can_choose_here_trains_the_asked_global_batch(tmp_path, capsys):
    """Under sequence or context parallelism a group of sp (cp) ranks trains on one batch: processes / sp different
    batches per micro-step. The printed per-device batch x accumulation x that must be the asked global batch, and
    the step's compute the tokens each rank then trains on: the same for every config (global batch x sequence over
    the devices), whatever the split."""
    shipped = step_time.SINGLE_NODE + step_time.SEQUENCE_PARALLEL + ["tp.yaml", "pp.yaml"]
    computes = {}  # by activation checkpointing, which a config may turn on itself
    for name in shipped:
        result, arguments, config = printed_command(
            tmp_path / name, capsys, "--global_batch", 4, "--configs", name, "--activation_checkpointing", "off"
        )
        assert effective_batch(arguments, config) == 4, (name, arguments, config.get("parallelism_config"))
        row = result["rows"][0]
        if row["pp_size"] == 1:  # a pipeline's rank computes its stages' share, stretched by the bubble
            computes.setdefault(row["activation_checkpointing"], set()).add(round(row["compute_s"], 12))
    assert all(len(seconds) == 1 for seconds in computes.values()), computes


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_chosen_context_parallel_command_trains_the_asked_global_batch(markov_data, tmp_path, capsys):
    """fsdp_cp.yaml chosen for a global batch of 4 on 2 processes, then launched as printed: run.json's effective batch
    is the asked one (before: 2, the per-device batch of a ring that trains one batch on both ranks)."""
    result, arguments, _ = printed_command(tmp_path, capsys, "--global_batch", 4, "--configs", "fsdp_cp.yaml")
    row = result["rows"][0]
    assert row["sp_size"] == 2
    record = launch_as_printed(
        tmp_path / "chosen.yaml",
        arguments["--per_device_train_batch_size"],
        arguments["--gradient_accumulation_steps"],
        markov_data,
        tmp_path / "run",
    )
    assert record["participating_processes"] == 2 and record["effective_batch_size"] == 4


def launch_as_printed(config, per_device: int, accumulation: int, markov_data, out) -> dict:
    """The written YAML launched with the printed batch arguments (a tiny model, 2 steps): its run.json."""
    arguments = dict(block_size=32, max_steps=2)
    arguments.update(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation)
    launch(str(config), "causal_lm.py", causal_lm_args(markov_data, out, **arguments))
    return read_run(out)


def llama3_8b_on_8_h100(tmp_path, *argv) -> dict:
    return choose(
        tmp_path,
        "--model",
        LLAMA3_8B,
        "--device",
        "h100",
        "--num_devices",
        8,
        "--seq_len",
        4096,
        "--global_batch",
        64,
        *argv,
    )


def test_the_cpu_ram_it_assumes_is_printed_and_ties_go_to_less_of_it(tmp_path, capsys):
    """Llama-3-8B on 8 H100s: zero2.yaml (every rank builds the fp32 model in CPU RAM: 257 GB per node) and zero3.yaml
    (built partitioned: none) step alike; the choice is the one that needs less CPU RAM, and the RAM assumed is said."""
    result = llama3_8b_on_8_h100(tmp_path)
    header = capsys.readouterr().out.splitlines()[0]
    assert "CPU RAM 2048 GB per node (the h100 preset's; pass --host_memory_gb for yours)" in header
    chosen = result["rows"][0]
    ties = [r for r in result["rows"] if r["fits"] and r["step_s"] <= chosen["step_s"] * (1 + step_time.TIE)]
    assert chosen["host_gb_per_node"] == min(r["host_gb_per_node"] for r in ties)
    rows = {r["config"]: r for r in result["rows"]}
    assert rows["zero2.yaml"] in ties and rows["zero2.yaml"]["host_gb_per_node"] > 250
    assert "more CPU RAM" in rows["zero2.yaml"]["verdict"]


def test_lora_and_dpos_reference_model_reach_the_estimate_and_the_command(tmp_path, capsys):
    """--use_peft: only the adapters have gradients and AdamW moments (under DDP with accumulation, 16 bytes a
    parameter less); --recipe dpo: the frozen reference copy (4 bytes a parameter under DDP), two rows a pair and the
    reference's forward; the command names the recipe and --use_peft."""
    ddp = [
        "--configs",
        "ddp.yaml",
        "--micro_batch",
        1,
        "--activation_checkpointing",
        "off",
        "--device_memory_gb",
        1000,
    ]
    full = llama3_8b_on_8_h100(tmp_path / "full", *ddp)["rows"][0]
    assert "recipes/causal_lm.py" in capsys.readouterr().out.splitlines()[-1]
    lora = llama3_8b_on_8_h100(tmp_path / "lora", *ddp, "--use_peft")
    row, psi = lora["rows"][0], lora["model"]["parameters"]
    # gradients, AdamW's moments, and the no_sync micro-batches' gradients from the second step on
    assert full["device_gb"] - row["device_gb"] == pytest.approx(16 * psi / 1e9, rel=0.01)
    assert row["compute_s"] < full["compute_s"]  # the frozen weights' own gradients are not computed
    dpo = llama3_8b_on_8_h100(tmp_path / "dpo", *ddp, "--recipe", "dpo")["rows"][0]
    assert "recipes/dpo.py" in capsys.readouterr().out.splitlines()[-1]
    assert dpo["device_gb"] - full["device_gb"] > 4 * psi / 1e9  # the copy, and twice the rows' activations
    assert dpo["compute_s"] > 2 * full["compute_s"]  # two rows a pair, and the reference's forward
    llama3_8b_on_8_h100(tmp_path / "dpo_lora", "--configs", "zero3.yaml", "--recipe", "dpo", "--use_peft")
    command = capsys.readouterr().out.splitlines()[-1]
    assert "recipes/dpo.py" in command and "--use_peft true" in command


def llama3_8b_on_2_h200(tmp_path, *argv, global_batch: int = 16) -> dict:
    """Llama-3-8B on 2 H200s: 16 bytes a parameter (128 GB) do not fit one device; half of them per stage do."""
    return choose(
        tmp_path,
        "--model",
        LLAMA3_8B,
        "--device",
        "h200",
        "--num_devices",
        2,
        "--seq_len",
        4096,
        "--global_batch",
        global_batch,
        *argv,
    )


def test_a_model_that_fits_no_device_is_pipelined_over_slow_links_and_the_yaml_carries_the_pipeline(tmp_path):
    """Over a 1 GB/s link, ZeRO's and FSDP's per-step gathers and reductions of 8B parameters cost seconds each, while
    a pipeline passes a micro-batch's hidden state between its 2 stages: pp.yaml is chosen, its written YAML keeps
    pp_size 2 with the chosen schedule and the command the micro-batches (the accumulation). Over NVLink's 360 GB/s
    the same job goes to a data-parallel config, which has no bubble."""
    slow = llama3_8b_on_2_h200(tmp_path / "slow", "--link_gbps", 1, global_batch=8)
    rows = {r["config"]: r for r in slow["rows"]}
    chosen = slow["rows"][0]
    assert not rows["ddp.yaml"]["fits"] and rows["ddp.yaml"]["device_gb"] > 141
    assert chosen["config"] == "pp.yaml" and chosen["verdict"] == "chosen" and chosen["pp_size"] == 2
    assert chosen["device_gb"] < 0.9 * 141 and chosen["bubble"] > 0
    written = (tmp_path / "slow" / "chosen.yaml").read_text()
    block = yaml.safe_load(written)["parallelism_config"]
    assert block == {"parallelism_config_pp_size": 2, "parallelism_config_pp_schedule": chosen["schedule"]}
    assert f"--gradient_accumulation_steps {chosen['accumulation']} " in written.splitlines()[1]
    assert "--packing" not in written.splitlines()[1]
    # sft.py packs by default, which a pipeline refuses: its command says --packing false
    sft = llama3_8b_on_2_h200(tmp_path / "sft", "--link_gbps", 1, "--recipe", "sft", global_batch=8)
    assert sft["rows"][0]["config"] == "pp.yaml"
    assert " --packing false " in (tmp_path / "sft" / "chosen.yaml").read_text().splitlines()[1]
    fast = llama3_8b_on_2_h200(tmp_path / "fast", "--link_gbps", 360, global_batch=8)
    assert fast["rows"][0]["pp_size"] == 1 and fast["rows"][0]["step_s"] < chosen["step_s"]


def test_the_bubble_shrinks_with_more_micro_batches_in_the_printed_step_time(tmp_path, capsys):
    """pp.yaml at micro-batch 8 (2 micro-batches a step) and 1 (16), checkpointed both: the printed bubble is the
    schedule's (p - 1) / (v m + p - 1), and the step's compute is the same work stretched by it: m micro-batches take
    v m + p - 1 slots of a stage's work on a micro-batch."""
    steps = {}
    for micro in (8, 1):
        asked = ["--configs", "pp.yaml", "--micro_batch", micro, "--activation_checkpointing", "on"]
        asked += ["--device_memory_gb", 1000]  # (8 x 4096-token micro-batches' logits held to the window's end)
        row = llama3_8b_on_2_h200(tmp_path / str(micro), *asked)["rows"][0]
        printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("pp.yaml"))
        v, m = (2 if row["schedule"] == "Interleaved1F1B" else 1), 16 // micro
        assert row["accumulation"] == m and row["bubble"] == pytest.approx(1 / (v * m + 1))
        assert f"{1 / (v * m + 1):.2f} {row['step_s']:7.3g}" in printed
        steps[m] = row
    work = {m: row["compute_s"] * (1 - row["bubble"]) for m, row in steps.items()}
    assert work[2] == pytest.approx(work[16], rel=1e-9)  # the same tokens through the same stages
    assert steps[16]["bubble"] < steps[2]["bubble"] and steps[16]["compute_s"] < steps[2]["compute_s"]


def test_jobs_a_pipeline_cannot_run_get_no_pipeline_and_say_why(tmp_path, capsys):
    """DPO scores whole rows and LoRA's adapters are not split into stages (common.parallel.pipeline); a pipeline needs
    a stage of at least one layer each (tiny_llama: 2 layers, so not 4 stages on 4 devices, nor interleaved 1F1B's 2
    stages a rank on 2); a model that is not a Llama has no stages. Their rows are left out and the reason printed."""
    for extra, why in (
        (["--recipe", "dpo"], "recipes/dpo.py scores whole rows"),
        (["--use_peft"], "LoRA's frozen base and adapters are not split"),
    ):
        result = llama3_8b_on_2_h200(tmp_path / extra[0], *extra)
        assert not any(r["pp_size"] > 1 for r in result["rows"])
        assert why in result["not_ranked"]["pp.yaml"]
        assert f"not ranked: pp.yaml: {result['not_ranked']['pp.yaml']}" in capsys.readouterr().out
    four = choose(tmp_path / "tiny", "--model", TINY_LLAMA, "--num_devices", 4, *ON_THIS_HOST, "--global_batch", 8)
    assert (
        "pp.yaml" in four["not_ranked"]
        and "every stage before the last needs at least one" in four["not_ranked"]["pp.yaml"]
    )
    pipelines = [r for r in four["rows"] if r["pp_size"] > 1]
    assert [(r["config"], r["pp_size"], r["schedule"]) for r in pipelines] == [("dp_pp.yaml", 2, "1F1B")]
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256}))
    other = choose(tmp_path / "gpt2", "--model", gpt2, "--num_devices", 2, *ON_THIS_HOST, "--global_batch", 4)
    assert "is not one" in other["not_ranked"]["pp.yaml"] and not any(r["pp_size"] > 1 for r in other["rows"])


def test_tensor_parallel_traffic_is_fsdps_over_the_shards_and_the_groups_per_layer_all_reduces(tmp_path):
    """fsdp_tp.yaml on 8 devices at each tp_size that divides them (2, 4): FSDP2's gathers and reduction of a TP
    rank's share of the parameters over the 8 / tp shards, overlapped with compute; and inside each group, per
    micro-batch, 2 all-reduces of each layer's activations forward, 5 backward (the colwise q, k, v, gate and up
    inputs' gradients), the embeddings' and the head's, and the logits gathered, which the layers wait for: added to
    the step even where compute hides FSDP2's traffic (a 1 TB/s link here). tp.yaml (one group of 8): the group's
    collectives alone."""
    bandwidth = 1000e9
    options = [
        "--link_gbps",
        1000,
        "--device_memory_gb",
        1000,
        "--activation_checkpointing",
        "off",
        "--micro_batch",
        1,
    ]
    options += ["--model", LLAMA3_8B, "--device", "h100", "--num_devices", 8, "--seq_len", 1024, "--global_batch", 32]
    result = choose(tmp_path / "fsdp_tp", *options, "--configs", "fsdp_tp.yaml")
    row, model = result["rows"][0], result["model"]
    tp, tokens, h, layers = row["tp_size"], 1024, 4096, 32
    k = 32 * tp // 8  # a group of tp ranks trains one batch
    assert tp in (2, 4) and row["accumulation"] == k
    share = model["parameters"] - model["tp_split_parameters"] * (tp - 1) / tp
    shards = 8 // tp
    fsdp = k * 3 * 2 * share * (shards - 1) / shards  # two gathers and a reduce-scatter a micro-batch, bf16
    group = k * ((7 * layers + 2) * 2 * tokens * h * 2 * (tp - 1) / tp + tokens * 128256 * 2 * (tp - 1) / tp)
    assert row["comm_s"] * bandwidth == pytest.approx(fsdp + group, rel=1e-6)
    assert row["compute_s"] > fsdp / bandwidth  # FSDP2's traffic hidden, the group's not
    assert row["step_s"] == pytest.approx(row["compute_s"] + group / bandwidth + row["other_s"], rel=1e-9)
    whole = choose(tmp_path / "tp", *options, "--configs", "tp.yaml")["rows"][0]
    k = 32  # one group of 8: the whole global batch
    group = k * ((7 * layers + 2) * 2 * tokens * h * 2 * 7 / 8 + tokens * 128256 * 2 * 7 / 8)
    assert whole["tp_size"] == 8 and whole["comm_s"] * bandwidth == pytest.approx(group, rel=1e-6)


def test_tensor_parallelism_is_not_ranked_with_lora(tmp_path):
    result = llama3_8b_on_8_h100(tmp_path, "--use_peft")
    assert not any(r["tp_size"] > 1 for r in result["rows"])
    assert set(result["not_ranked"]) >= {"tp.yaml", "fsdp_tp.yaml"} and "--use_peft" in result["not_ranked"]["tp.yaml"]
    with pytest.raises(SystemExit) as refused:
        llama3_8b_on_8_h100(tmp_path / "asked", "--use_peft", "--configs", "tp.yaml")
    assert "LoRA's adapters" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_chosen_pipeline_command_trains_the_asked_global_batch(markov_data, tmp_path, capsys):
    """pp.yaml chosen for a global batch of 4 on 2 processes (tiny_llama's 2 layers: 2 stages under 1F1B), then
    launched as printed: both ranks take part and run.json's effective batch is the asked one (the pipeline's 2 ranks
    read one batch: 1 x 4 micro-batches)."""
    result, arguments, config = printed_command(tmp_path, capsys, "--global_batch", 4, "--configs", "pp.yaml")
    row = result["rows"][0]
    assert (row["pp_size"], row["schedule"], row["accumulation"]) == (2, "1F1B", 4 // row["micro_batch"])
    assert config["parallelism_config"]["parallelism_config_pp_schedule"] == "1F1B"
    record = launch_as_printed(
        tmp_path / "chosen.yaml",
        arguments["--per_device_train_batch_size"],
        arguments["--gradient_accumulation_steps"],
        markov_data,
        tmp_path / "run",
    )
    assert record["participating_processes"] == 2 and record["effective_batch_size"] == 4


def test_grpo_and_the_reward_model_are_chosen_for_with_the_rollouts_copy_and_kv_cache(tmp_path, capsys):
    """--recipe grpo: the rollout's whole-weights copy where the config shards them (cΨ under ZeRO-3, none under
    ZeRO-2), its KV cache and logits (make estimate-memory --grpo_generations's sums), its decoding in the step time
    and the copy's gather in the traffic; no pipelines (whole rows scored), split rows ranked; a global batch whose
    per-device completions are not whole groups of G not ranked, with why; the command carries G. --recipe
    reward_model: whole rows too."""
    zero = ["--configs", "zero2.yaml", "zero3.yaml", "--micro_batch", 1, "--activation_checkpointing", "off"]
    causal = {r["config"]: r for r in llama3_8b_on_8_h100(tmp_path / "causal", *zero, "--seq_len", 1024)["rows"]}
    result = llama3_8b_on_8_h100(tmp_path / "grpo", *zero, "--seq_len", 1024, "--recipe", "grpo")
    grpo, psi = {r["config"]: r for r in result["rows"]}, result["model"]["parameters"]
    command = capsys.readouterr().out.splitlines()[-1]
    assert "recipes/grpo.py" in command and "--num_generations 8 --max_completion_length 256" in command, command
    model = result["model"]
    copy = 2 * psi / 1e9  # bf16, whole, beside ZeRO-3's shards; ZeRO-2 samples from its own whole weights
    assert grpo["zero3.yaml"]["device_gb"] - causal["zero3.yaml"]["device_gb"] >= 0.99 * copy
    assert grpo["zero2.yaml"]["device_gb"] - causal["zero2.yaml"]["device_gb"] < copy / 2
    # the KV cache of a rank's rollout, sampled in one call, and each decoding step's last logits (training's
    # activations are not alive then): with 256 completions a device they outgrow the activations of a micro-batch
    many = llama3_8b_on_8_h100(
        tmp_path / "many", *zero, "--seq_len", 1024, "--recipe", "grpo", "--num_generations", 64, "--global_batch",
        2048, "--device_memory_gb", 1000,
    )  # fmt: skip
    kv = 256 * (1024 * 2 * model["layers"] * model["kv_hidden_size"] * 2 + 32 * model["vocab_size"]) / 1e9
    many_zero2 = next(r for r in many["rows"] if r["config"] == "zero2.yaml")
    assert many_zero2["device_gb"] - causal["zero2.yaml"]["device_gb"] > kv / 2
    for name in ("zero2.yaml", "zero3.yaml"):
        assert grpo[name]["compute_s"] > causal[name]["compute_s"]  # the decoding
    assert grpo["zero3.yaml"]["comm_s"] > causal["zero3.yaml"]["comm_s"]  # the copy's gather
    assert grpo["zero2.yaml"]["comm_s"] == pytest.approx(causal["zero2.yaml"]["comm_s"])  # whole weights already
    every = llama3_8b_on_8_h100(tmp_path / "every", "--recipe", "grpo", "--seq_len", 1024)
    assert {"pp.yaml", "dp_pp.yaml"} <= set(every["not_ranked"])  # split rows ranked: grpo.py scores their slices
    assert {"zero3_ulysses.yaml", "fsdp_cp.yaml"} <= {r["config"] for r in every["rows"]}
    assert "scores whole rows" in every["not_ranked"]["pp.yaml"]
    odd = llama3_8b_on_8_h100(tmp_path / "odd", "--recipe", "grpo", "--global_batch", 32, "--seq_len", 1024)
    assert "not whole groups of --num_generations 8" in odd["not_ranked"]["zero3.yaml"], odd["not_ranked"]
    reward = llama3_8b_on_8_h100(tmp_path / "reward", "--recipe", "reward_model", "--seq_len", 1024)
    assert "recipes/reward_model.py scores whole rows" in reward["not_ranked"]["pp.yaml"]
    assert not any(r["config"] in ("zero3_ulysses.yaml", "fsdp_cp.yaml") for r in reward["rows"])
    pairs = llama3_8b_on_8_h100(tmp_path / "pairs", *zero, "--seq_len", 1024, "--recipe", "reward_model")["rows"]
    pairs = {r["config"]: r for r in pairs}  # a pair is two rows, chosen and rejected: twice a sequence's work
    assert pairs["zero3.yaml"]["compute_s"] == pytest.approx(2 * causal["zero3.yaml"]["compute_s"], rel=0.01)
    assert pairs["zero3.yaml"]["device_gb"] > causal["zero3.yaml"]["device_gb"]
    for bad in (["--seq_len", 256], ["--seq_len", 1024, "--num_generations", 1]):  # no room for a prompt; G < 2
        with pytest.raises(SystemExit, match=r"error: --num_generations .* GRPO needs 2 or more completions"):
            llama3_8b_on_8_h100(tmp_path / "bad", "--recipe", "grpo", *bad)


# Qwen3-30B-A3B's shape (its published config.json's sizes): 128 experts of width 768, 8 a token, 48 layers
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}


def test_a_mixture_of_experts_ranks_ep_yaml_with_its_all_to_all_and_the_yaml_carries_the_split(tmp_path):
    """Qwen3-30B-A3B's shape on 8 H100s: ep.yaml is ranked (and chosen: its experts, 95% of the weights, are never
    gathered, where zero3's and fsdp's gathers cost several times its all-to-alls); its traffic is FSDP2's over the
    dense weights only plus the all-to-all of each (token, chosen expert) pair's row, out and back, forward and
    backward, the activation checkpointing's forward once more, 7/8 of it off-rank; the YAML splits the experts over
    the 8 devices. A dense model, LoRA and a device count the experts do not divide: not ranked, each with why."""
    import json

    (tmp_path / "moe").mkdir()
    (tmp_path / "moe/config.json").write_text(json.dumps(QWEN3_30B_A3B))
    job = ["--device", "h100", "--num_devices", 8, "--seq_len", 4096, "--global_batch", 64, "--micro_batch", 1]
    result = choose(tmp_path, "--model", tmp_path / "moe", *job, "--link_gbps", 100)
    rows, model = {r["config"]: r for r in result["rows"]}, result["model"]
    assert model["moe_layers"] == 48 and model["expert_parameters"] == 48 * 128 * 3 * 2048 * 768
    ep, fsdp = rows["ep.yaml"], rows["fsdp.yaml"]
    assert result["rows"][0]["config"] == "ep.yaml" and ep["comm_s"] < fsdp["comm_s"] / 2
    dense = model["parameters"] - model["expert_parameters"]
    k, passes = ep["accumulation"], 6 if ep["activation_checkpointing"] else 4
    gathers = k * 2 * 2 * dense * 7 / 8 + k * 2 * dense * 7 / 8  # bf16 all-gathers forward and backward, the reduce
    exchange = k * passes * 48 * 4096 * 8 * 2048 * 2 * 7 / 8
    assert ep["comm_s"] == pytest.approx((gathers + exchange) / 100e9, rel=1e-6)
    text = (tmp_path / "chosen.yaml").read_text()
    assert "parallelism_config_ep_size: 8" in text and "parallelism_config_dp_shard_size: 8" in text
    assert "num_processes: 8" in text
    # fsdp_ep.yaml at its fastest ep_size below 8: the all-to-alls within groups of ep, and each group's 1/ep of the
    # experts gathered (forward, backward) and reduce-scattered over the 8 / ep groups beside the dense weights
    two_d = rows["fsdp_ep.yaml"]
    e, groups = two_d["ep_size"], 8 // two_d["ep_size"]
    assert e in (2, 4) and two_d["step_s"] > ep["step_s"]  # on one node the gathers cost more than they save
    k, passes = two_d["accumulation"], 6 if two_d["activation_checkpointing"] else 4
    shards = k * 3 * 2 * model["expert_parameters"] / e * (groups - 1) / groups
    exchange = k * passes * 48 * 4096 * 8 * 2048 * 2 * (e - 1) / e
    assert two_d["comm_s"] == pytest.approx((gathers / ep["accumulation"] * k + shards + exchange) / 100e9, rel=1e-6)
    (tmp_path / "2d").mkdir()
    choose(tmp_path / "2d", "--model", tmp_path / "moe", *job, "--link_gbps", 100, "--configs", "fsdp_ep.yaml")
    text = (tmp_path / "2d/chosen.yaml").read_text()
    assert f"parallelism_config_ep_size: {e}" in text and "parallelism_config_dp_shard_size: 8" in text
    for index, (argv, why) in enumerate(
        (
            (["--model", LLAMA3_8B, *job], "LlamaForCausalLM has no experts to split"),
            (["--model", tmp_path / "moe", *job, "--use_peft"], "--use_peft: LoRA's adapters on the experts"),
            (["--model", tmp_path / "moe", *job[:3], 6, *job[4:7], 48, *job[8:]], "128 experts per layer do not"),
        )
    ):
        (tmp_path / str(index)).mkdir()
        result = choose(tmp_path / str(index), *argv)
        assert why in result["not_ranked"]["ep.yaml"]
        ranked = {r["config"]: r for r in result["rows"]}
        if index == 2:  # 6 devices: fsdp_ep.yaml splits the experts over pairs (3 does not divide 128)
            assert ranked["fsdp_ep.yaml"]["ep_size"] == 2
        else:
            assert why in result["not_ranked"]["fsdp_ep.yaml"]
