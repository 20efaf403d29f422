"""Parse a recipe YAML (`--config`) and command-line overrides into the recipe's argument dataclasses.

Precedence: dataclass defaults < recipe YAML < `--key value` on the command line. Every
problem (unknown key, wrong type, missing file, options that clash) is a `UsageError` with a
one-line message; `parse_args` prints it and exits with status 2 (`common.launch.errors`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import yaml
from transformers import HfArgumentParser

from common.launch.errors import UsageError, exit_with_error
from common.launch.internals import parser_actions, parser_option_strings
from common.options.arguments import DataArguments, TrainingArguments
from common.options.ranges import check_ranges
from common.options.trl_keys import TRL_ELSEWHERE


# Trainer's options that these recipes take elsewhere: where each is set here
_PRECISION = (
    "mixed precision comes from the accelerate config, its mixed_precision (or accelerate launch "
    "--mixed_precision bf16)"
)
_STRATEGY = "the strategy comes from the accelerate config: accelerate launch --config_file accelerate_configs/X.yaml"
_EVALUATION = "evaluation runs every --eval_steps N (0: at the end only)"
ELSEWHERE = {
    **TRL_ELSEWHERE,  # TRL's config keys (common.options.trl_keys); the lines below answer the same keys first
    "bf16": _PRECISION,
    "fp16": _PRECISION,
    "deepspeed": _STRATEGY,
    "fsdp": _STRATEGY,
    "fsdp_config": _STRATEGY,
    "eval_strategy": _EVALUATION,
    "evaluation_strategy": _EVALUATION,
    "save_strategy": "checkpoints are written every --save_steps N (0: none)",
    "logging_strategy": "metrics are logged every --logging_steps N",
    "local_rank": "accelerate launch gives each process its rank",
    # the alignment-handbook's and TRL's keys, where these recipes take them otherwise
    "do_eval": _EVALUATION,
    "model_revision": "download that revision to a folder (hf download NAME --revision REV --local-dir DIR) "
    "and pass --model_name_or_path DIR",
    "dataset_num_proc": "--preprocessing_num_workers N",
    "dataset_text_field": "--text_column NAME",
    "max_seq_length": "--block_size N (longer examples follow --overlong)",
    "max_length": "--block_size N (longer examples follow --overlong)",
    "gradient_checkpointing_kwargs": "--gradient_checkpointing (always non-reentrant here)",
    "log_level": "the main process logs progress, the others errors; TRANSFORMERS_VERBOSITY and "
    "DATASETS_VERBOSITY set the libraries' levels",
    "remove_unused_columns": "each recipe keeps only the columns it reads (its --help names them)",
    **dict.fromkeys(
        ("push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo"),
        "the recipes do not upload: hf upload REPO OUTPUT_DIR/final uploads the exported "
        "folder (its README.md is the model card)",
    ),
}


def _where_instead(keys) -> str:
    """For unknown keys that are Trainer options: where each is set here."""
    grouped = {}  # one instruction, the keys it answers
    for key in dict.fromkeys(keys):
        if key in ELSEWHERE:
            grouped.setdefault(ELSEWHERE[key], []).append(f"--{key}")
    said = [f"{', '.join(names)}: {where}" for where, names in grouped.items()]
    return f". {'; '.join(said)}" if said else ""


def _unknown_keys(config: dict, parser: argparse.ArgumentParser) -> list[str]:
    """The recipe YAML's keys that no option of the recipe takes."""
    actions = parser_actions(parser)
    return [key for key in config if key not in actions or key in ("help", "config")]


def _unknown_arguments(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The command line's `--options` that the recipe does not take, each with the values that follow it
    (what argparse would leave over once it had parsed, and type-checked, the rest)."""
    known = parser_option_strings(parser)
    unknown, following_unknown = [], False
    for token in argv:
        if token == "--":
            break
        if token.startswith("--"):
            following_unknown = token.split("=", 1)[0] not in known
        if following_unknown:
            unknown.append(token)
    return unknown


def _refuse_unknown(source: str | None, keys: list[str], arguments: list[str]) -> None:
    """Every unknown YAML key and command-line argument in one message, before any value is checked,
    so that a file or command from elsewhere is fixed in one go."""
    if not keys and not arguments:
        return
    flags = [token[2:].split("=")[0].replace("-", "_") for token in arguments if token.startswith("--")]
    said = []
    if keys:
        said.append(f"{source}: unknown key{'s' if len(keys) > 1 else ''} {', '.join(map(repr, keys))}")
    if arguments:
        said.append(f"unknown argument(s) {' '.join(arguments)}")
    what = "the keys" if not arguments else "them"
    raise UsageError(f"{'; '.join(said)}; run the recipe with --help to list {what}{_where_instead(keys + flags)}")


def _yaml_to_argv(config: dict) -> list[str]:
    """Turn recipe-YAML keys (all known: `_unknown_keys`) into command-line tokens, so argparse checks their types."""
    argv = []
    for key, value in config.items():
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        argv += [f"--{key}"] + [json.dumps(v) if isinstance(v, (dict, bool)) else str(v) for v in values]
    return argv


class _RaisingParser(HfArgumentParser):
    def __init__(self, dataclass_types):
        super().__init__(dataclass_types, allow_abbrev=False)  # --learning_rat is an error, not --learning_rate

    def error(self, message):  # argparse prints usage and exits; we want one line
        raise UsageError(message)


def parse_args(dataclass_types, argv: list[str] | None = None):
    """Parse `--config recipe.yaml` plus command-line overrides into dataclass instances.

    Prints a one-line error and exits with status 2 on bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _parse(dataclass_types, argv)
    except UsageError as error:
        exit_with_error(error)


def _parse(dataclass_types, argv):
    parser = _RaisingParser(dataclass_types)
    parser.add_argument("--config", help="Recipe YAML; command-line flags override its values.")
    config_path = _find_config(argv)
    yaml_argv: list[str] = []
    if config_path is not None:
        if not os.path.isfile(config_path):
            raise UsageError(
                f"--config: {config_path} does not exist; pass a recipe YAML such as recipes/configs/*.yaml"
            )
        with open(config_path) as handle:
            try:
                config = yaml.safe_load(handle) or {}
            except yaml.YAMLError as error:
                raise UsageError(f"{config_path}: not valid YAML ({str(error).splitlines()[0]})")
        if not isinstance(config, dict):
            raise UsageError(f"{config_path}: expected a mapping of key: value")
    else:
        config = {}
    _refuse_unknown(config_path, _unknown_keys(config, parser), _unknown_arguments(argv, parser))
    if config:
        yaml_argv = _yaml_to_argv(config)
        try:  # type-check the YAML on its own, so an error names the file
            parser.parse_known_args(yaml_argv)
        except UsageError as error:
            raise UsageError(f"{config_path}: {error}")
    *parsed, remaining = parser.parse_args_into_dataclasses(
        args=yaml_argv + argv, return_remaining_strings=True, look_for_args_file=False
    )
    if remaining:
        keys = [token[2:].split("=")[0].replace("-", "_") for token in remaining if token.startswith("--")]
        raise UsageError(
            f"unknown argument(s) {' '.join(remaining)}; run the recipe with --help to list them{_where_instead(keys)}"
        )
    for arguments in parsed[: len(dataclass_types)]:  # a recipe's own dataclass too, whose __post_init__ may not
        check_ranges(arguments)
    _check_together(parsed)
    return tuple(parsed[: len(dataclass_types)])  # parsed[-1] is the namespace holding --config


def _check_together(parsed) -> None:
    """Arguments that are fine alone but not together."""
    data = next((p for p in parsed if isinstance(p, DataArguments)), None)
    training = next((p for p in parsed if isinstance(p, TrainingArguments)), None)
    own_batch = next((p for p in parsed if hasattr(p, "no_auto_batch_size")), None)
    if training is not None and training.auto_find_batch_size and own_batch is not None:
        raise UsageError(
            f"--auto_find_batch_size is not available here: {own_batch.no_auto_batch_size}; set "
            "--per_device_train_batch_size (scripts/estimate_memory.py predicts what fits)"
        )
    if data is not None and training is not None and getattr(data, "streaming", False):
        if any(getattr(p, "reads_data_in_memory", False) for p in parsed):
            raise UsageError(
                "--streaming is for the packed-text recipes (causal_lm.py); this recipe reads "
                "its data in memory: drop --streaming"
            )
        if training.max_steps <= 0:
            raise UsageError("--streaming needs --max_steps: a stream has no length to count epochs by")
        if training.auto_find_batch_size:
            raise UsageError(
                "--streaming cannot be used with --auto_find_batch_size; set --per_device_train_batch_size"
            )


def _find_config(argv: list[str]) -> str | None:
    for index, token in enumerate(argv):
        if token == "--config":
            if index + 1 >= len(argv):
                raise UsageError("--config needs a path to a recipe YAML")
            return argv[index + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def to_dict(*instances) -> dict:
    merged = {}
    for instance in instances:
        merged.update(dataclasses.asdict(instance))
    return merged
