"""Shared test helpers: demo data, real `accelerate launch` runs, and their outputs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIGS = REPO / "accelerate_configs"
RECIPES = REPO / "recipes"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command: list[str], cwd=REPO, env: dict | None = None, check=True, timeout=900):
    result = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, **OFFLINE_ENV, **(env or {})}, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {' '.join(map(str, command))}\n"
                             f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-8000:]}")
    return result


def launch(config: str, recipe: str, args: list, num_processes: int | None = None, cwd=REPO,
           env: dict | None = None, check=True, launcher_args: list | None = None):
    """`accelerate launch --config_file accelerate_configs/<config> <recipe> <args>` as a user types it."""
    command = [BIN / "accelerate", "launch", "--config_file", CONFIGS / config,
               "--main_process_port", str(free_port())]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    command += list(launcher_args or [])
    recipe_path = recipe if os.path.isabs(str(recipe)) else RECIPES / recipe
    return run(command + [recipe_path] + list(args), cwd=cwd, env=env, check=check)


def read_run(output_dir) -> dict:
    return json.loads((Path(output_dir) / "run.json").read_text())


def read_metrics(output_dir) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def losses(output_dir) -> list[float]:
    return [row["loss"] for row in read_metrics(output_dir)[0]]


@pytest.fixture(scope="session")
def markov_data(tmp_path_factory) -> Path:
    from common.synthetic import write_markov_corpus

    out = tmp_path_factory.mktemp("markov")
    write_markov_corpus(str(out), train_docs=3000, validation_docs=203, seed=0)
    return out


def causal_lm_args(data: Path, output_dir: Path, **overrides) -> list[str]:
    """Small, fast causal_lm arguments on the generated corpus (fp32, logs every step)."""
    values = {"config": REPO / "recipes/configs/causal_lm_demo.yaml",
              "tokenizer_name_or_path": data / "tokenizer", "train_file": data / "train.jsonl",
              "validation_file": data / "validation.jsonl", "model_config": REPO / "recipes/configs/tiny_llama.json",
              "output_dir": output_dir, "block_size": 32, "max_steps": 12, "logging_steps": 1,
              "eval_steps": 0, "save_steps": 0, "per_device_train_batch_size": 4,
              "per_device_eval_batch_size": 8, "warmup_steps": 2, "report_to": "none"}
    values.update(overrides)
    return [token for key, value in values.items() for token in (f"--{key}", str(value))]
