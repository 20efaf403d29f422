"""scripts/check_config.py on the shipped configs and on broken copies of them."""

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import CONFIGS, REPO, load_script, run


TEMPLATES = {
    "multi_node_ddp.yaml",
    "multi_node_fsdp.yaml",
    "multi_node_hsdp.yaml",
    "multi_node_hsdp_tp.yaml",
    "multi_node_zero3.yaml",
}
SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml"))


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # deepspeed_config_file paths are relative to the launch directory


def check(config, *extra):
    """scripts/check_config.py's main(), in-process (the make target test runs it as a command)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = load_script("scripts/check_config.py").main(
            [str(config), "--recipe_config", str(REPO / "recipes/configs/causal_lm_demo.yaml"), *map(str, extra)]
        )
    return Result(code, out.getvalue(), err.getvalue())


def broken_copy(tmp_path, name, edit) -> Path:
    config = yaml.safe_load((CONFIGS / name).read_text())
    edit(config)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def moe_recipe(tmp_path) -> Path:
    """The causal_lm demo's recipe config on the tiny Qwen3-MoE (ep.yaml splits a MoE's experts only)."""
    recipe = yaml.safe_load((REPO / "recipes/configs/causal_lm_demo.yaml").read_text())
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump({**recipe, "model_config": str(REPO / "recipes/configs/tiny_qwen3_moe.json")}))
    return path


@pytest.mark.parametrize("name", [n for n in SHIPPED if n not in TEMPLATES])
def test_shipped_configs_pass(name, tmp_path):
    result = check(
        CONFIGS / name, *(["--recipe_config", moe_recipe(tmp_path)] if name in ("ep.yaml", "fsdp_ep.yaml") else [])
    )
    assert result.returncode == 0 and result.stdout.strip().endswith(": ok"), result.stdout + result.stderr


def test_expert_parallelism_of_a_dense_model_is_named():
    result = check(CONFIGS / "ep.yaml")  # the demo's tiny Llama
    assert result.returncode == 1 and "parallelism_config_ep_size 2: LlamaForCausalLM has no experts" in result.stdout


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_name_the_fields_to_fill(name):
    result = check(CONFIGS / name)
    assert result.returncode == 1 and "main_process_ip: still the template's FILL_ME" in result.stdout


def test_a_hybrid_shard_mesh_that_is_not_the_world_size_is_named(tmp_path):
    """16 processes as 2 nodes x 8 pass; the same mesh under 4 processes is refused with the fix."""
    filled = broken_copy(tmp_path, "multi_node_hsdp.yaml", lambda c: c.update(main_process_ip="10.0.0.1"))
    assert check(filled).returncode == 0
    result = check(filled, "--num_processes", 4)
    assert result.returncode == 1
    assert "dp_replicate_size 2 x dp_shard_size 8 = 16 processes but num_processes is 4" in result.stdout


def test_make_check_config_target():
    result = run(["make", "-s", "check-config", "CONFIG=accelerate_configs/zero3.yaml"])
    assert "accelerate_configs/zero3.yaml: ok" in result.stdout


@pytest.mark.parametrize("spelling", ["ARGS=--recipe_config {}", "RECIPE_CONFIG={}"])
def test_make_check_config_takes_the_recipe_config_both_ways(spelling, tmp_path):
    """Issue 54, item 13: `make check-config ARGS="--recipe_config X"` was silently ignored (the demo's recipe
    YAML checked instead, "ok"); now X is checked, and one that does not exist is one line, exit 2."""
    missing = tmp_path / "no_such_recipe.yaml"
    result = run(
        ["make", "-s", "check-config", "CONFIG=accelerate_configs/zero3.yaml", spelling.format(missing)], check=False
    )
    assert result.returncode != 0 and ": ok" not in result.stdout, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if not line.startswith("make")]
    assert errors == [
        f"error: --recipe_config {missing} does not exist; pass a recipe YAML such as "
        "recipes/configs/causal_lm_demo.yaml"
    ], result.stderr
    assert check(CONFIGS / "zero3.yaml", "--recipe_config", missing).returncode == 2


def _set(path: str, value):
    def edit(config):
        *parents, leaf = path.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return edit


@pytest.mark.parametrize(
    "name, edit, expected",
    [
        ("ddp.yaml", _set("num_gpus_total", 8), r"unknown keys \(\['num_gpus_total'\]\)"),
        (
            "fsdp.yaml",
            _set("fsdp_config.fsdp_reshard_after_forwrd", True),
            r"fsdp_config.fsdp_reshard_after_forwrd: unknown",
        ),
        (
            "fsdp.yaml",
            _set("fsdp_config.fsdp_transformer_layer_cls_to_wrap", "GPT2Block"),
            r"the model has no 'GPT2Block' layer",
        ),
        (
            "zero2.yaml",
            _set("deepspeed_config.offload_param_device", "cpu"),
            r"offload_param_device=cpu needs ZeRO stage 3 \(got 2\)",
        ),
        (
            "zero3.yaml",
            _set("deepspeed_config.gradient_clipping", 0.5),
            r"gradient_clipping=0.5 but the recipe's max_grad_norm=1.0",
        ),
        ("zero3.yaml", _set("deepspeed_config.zero_stagee", 3), r"deepspeed_config.zero_stagee: unknown"),
    ],
)
def test_broken_copies_are_reported(tmp_path, name, edit, expected):
    result = check(broken_copy(tmp_path, name, edit))
    assert result.returncode == 1
    assert re.search(expected, result.stdout + result.stderr), result.stdout + result.stderr
    assert len([l for l in result.stdout.splitlines() if l.strip()]) == 1  # one line per problem


def test_wrap_class_the_model_has_passes(tmp_path):
    path = broken_copy(
        tmp_path, "fsdp.yaml", _set("fsdp_config.fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer")
    )
    assert check(path).returncode == 0


def test_deepspeed_json_batch_sizes_must_agree(tmp_path):
    ds = json.loads((CONFIGS / "deepspeed/zero2_auto.json").read_text())
    ds.update(train_batch_size=64, train_micro_batch_size_per_gpu=8)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    path = broken_copy(
        tmp_path, "zero2_json.yaml", _set("deepspeed_config.deepspeed_config_file", str(tmp_path / "ds.json"))
    )
    out = check(path).stdout
    # The demo recipe: per_device_train_batch_size 8, accumulation 1, world size 2 -> 16.
    assert "train_batch_size=64 != micro 8 x accumulation 1 x world size 2 = 16" in out
    ds.update(train_batch_size=16)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    assert check(path).returncode == 0
    assert "= 32" in check(path, "--num_processes", "4").stdout  # a bigger world changes the expected size


@pytest.mark.parametrize(
    "name, edit, extra, expected",
    [
        (
            "tp.yaml",
            None,
            ["--num_processes", 4],
            r"parallelism_config: tp_size 2 = 2 processes but num_processes is 4",
        ),
        (
            "fsdp_tp.yaml",
            None,
            ["--num_processes", 8],
            r"parallelism_config: dp_shard_size 2 x tp_size 2 = 4 processes but num_processes is 8",
        ),
        (
            "tp.yaml",
            _set("parallelism_config.parallelism_config_cp_size", 2),
            [],
            r"parallelism_config_cp_size 2: context parallelism \(torch.s ring attention\) runs under FSDP2, not MULTI_GPU",
        ),
        (
            "tp.yaml",
            _set("distributed_type", "DEEPSPEED"),
            [],
            r"tensor parallelism runs under distributed_type MULTI_GPU \(tp.yaml\) or FSDP2 \(fsdp_tp.yaml\), not DEEPSPEED",
        ),
        (
            "fsdp_tp.yaml",
            _set("fsdp_config.fsdp_cpu_ram_efficient_loading", True),
            [],
            r"fsdp_cpu_ram_efficient_loading: true beside parallelism_config_tp_size",
        ),
    ],
)
def test_tensor_parallel_mesh_problems_are_named(tmp_path, name, edit, extra, expected):
    path = broken_copy(tmp_path, name, edit) if edit else CONFIGS / name
    result = check(path, *extra)
    assert result.returncode == 1 and re.search(expected, result.stdout), result.stdout + result.stderr


def test_a_model_tensor_parallelism_cannot_split_is_named(tmp_path):
    """Three heads do not divide by tp_size 2; GPT-2 has no plan in transformers."""
    llama = json.loads((REPO / "recipes/configs/tiny_llama.json").read_text())
    llama.update(hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}
    for name, model, expected in (
        ("three_heads", llama, "the model has 3 attention heads, which do not divide by it"),
        ("gpt2", gpt2, "GPT2LMHeadModel cannot be split for tensor parallelism"),
    ):
        (tmp_path / f"{name}.json").write_text(json.dumps(model))
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(yaml.safe_dump({"model_config": str(tmp_path / f"{name}.json")}))
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = load_script("scripts/check_config.py").main(
                [str(CONFIGS / "tp.yaml"), "--recipe_config", str(recipe)]
            )
        assert code == 1 and expected in out.getvalue(), out.getvalue()


def _fp8(**more):
    def edit(config):
        config["mixed_precision"] = "fp8"
        for path, value in more.items():
            _set(path.replace("__", "."), value)(config)

    return edit


@pytest.mark.parametrize(
    "name, edit, expected",
    [
        ("ddp.yaml", _fp8(), None),
        ("fsdp.yaml", _fp8(fsdp_config__fsdp_cpu_ram_efficient_loading=False), None),
        ("ddp.yaml", _fp8(fp8_config__backend="TE"), r"fp8_backend te: these recipes train fp8 through torchao"),
        ("fsdp.yaml", _fp8(), r"fp8 \(torchao\) under FSDP2 cannot load with fsdp_cpu_ram_efficient_loading: true"),
        ("tp.yaml", _fp8(), r"fp8 under tensor parallelism \(tp_size 2\) does not run with torchao"),
    ],
)
def test_fp8_configs_are_checked_as_a_run_checks_them(tmp_path, name, edit, expected):
    """mixed_precision: fp8 in the YAML: what the recipe would refuse at launch (common.training.speed.fp8_problem),
    named by check-config before it (torchao is in the test extras; this host has no GPU to judge)."""
    pytest.importorskip("torchao", reason="torchao is in the test extras: make install-test")
    result = check(broken_copy(tmp_path, name, edit))
    if expected is None:
        assert result.returncode == 0 and result.stdout.strip().endswith(": ok"), result.stdout + result.stderr
    else:
        assert result.returncode == 1 and re.search(expected, result.stdout), result.stdout + result.stderr
        assert len([line for line in result.stdout.splitlines() if line.strip()]) == 1
