"""Check an accelerate config before launch: one line per thing that would break.

    make check-config CONFIG=accelerate_configs/zero3.yaml
    python scripts/check_config.py accelerate_configs/fsdp.yaml --recipe_config recipes/configs/causal_lm_demo.yaml

Loads the YAML with accelerate's own loader, then checks what accelerate does
not: keys inside fsdp_config/deepspeed_config that `accelerate launch` does not
know, FSDP wrap class names the recipe's model does not have, DeepSpeed batch
sizes and clipping that disagree with the recipe's arguments, and offload asked
of a ZeRO stage that cannot do it. Exit status 1 if anything is wrong; 2, with one
`error:` line, if a file it was given does not exist.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml


REPO = Path(__file__).resolve().parent.parent
ZERO_STAGES = (0, 1, 2, 3)


def launch_keys() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    from common.launch.internals import parser_actions

    return set(parser_actions(launch_command_parser()))


def recipe_values(recipe_config: str | None) -> dict:
    """The recipe YAML's values over TrainingArguments' defaults."""
    import dataclasses

    from common.options.arguments import TrainingArguments

    values = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    if recipe_config:
        with open(recipe_config) as handle:
            values.update(yaml.safe_load(handle) or {})
    return values


def model_class_names(recipe: dict) -> set[str] | None:
    """Module class names of the recipe's model, built on the meta device (no weights)."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    source = recipe.get("model_config") or recipe.get("model_name_or_path")
    if not source:
        return None
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        return None  # not reachable from here (e.g. a Hub name offline): skip the check
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = AutoModel.from_config(config)
    return {type(module).__name__ for module in model.modules()}


def check(config_path: str, recipe_config: str | None = None, num_processes: int | None = None) -> list[str]:
    from accelerate.commands.config.config_args import load_config_from_file

    problems: list[str] = []
    try:
        load_config_from_file(config_path)
    except (ValueError, TypeError, FileNotFoundError) as error:
        return [str(error).splitlines()[0]]
    with open(config_path) as handle:
        raw = yaml.safe_load(handle)
    for key, value in raw.items():
        if isinstance(value, str) and value.startswith("FILL_ME"):
            problems.append(f"{key}: still the template's {value}; set it, or pass --{key} to accelerate launch")
    known = launch_keys()
    recipe = recipe_values(recipe_config)
    world = num_processes or raw.get("num_processes", 1)

    fsdp = raw.get("fsdp_config") or {}
    for key in fsdp:
        if key not in known:
            problems.append(
                f"fsdp_config.{key}: unknown to accelerate launch (known: fsdp_* keys of `accelerate launch --help`)"
            )
    wrap = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if raw.get("distributed_type") == "FSDP" and wrap:
        names = model_class_names(recipe)
        for name in [wrap] if isinstance(wrap, str) else wrap:
            for single in str(name).split(","):
                if names is not None and single.strip() not in names:
                    problems.append(
                        f"fsdp_transformer_layer_cls_to_wrap: the model has no {single.strip()!r} "
                        "layer; name one of its decoder/encoder layer classes or remove the key"
                    )

    mesh = raw.get("parallelism_config") or {}
    if mesh:
        problems += check_mesh(mesh, raw, fsdp, recipe, world, recipe_keys(recipe_config))

    if str(raw.get("mixed_precision")).lower() == "fp8":
        problems += check_fp8(raw, fsdp, mesh)

    deepspeed = raw.get("deepspeed_config") or {}
    for key in deepspeed:
        if key not in known:
            problems.append(f"deepspeed_config.{key}: unknown to accelerate launch")
    if raw.get("distributed_type") == "DEEPSPEED":
        problems += check_deepspeed(deepspeed, raw, recipe, world, config_path)
    return problems


def recipe_keys(recipe_config: str | None) -> set[str]:
    if not recipe_config:
        return set()
    with open(recipe_config) as handle:
        return set(yaml.safe_load(handle) or {})


def whole_row_recipe(keys: set[str]) -> str | None:
    """What the recipe whose YAML sets `keys` scores, where its loss needs whole rows (dpo.py,
    sequence_classification.py: arguments classes with `scores_whole_rows`, and not `scores_split_rows` as grpo.py's),
    told by the arguments only it has."""
    import dataclasses
    import importlib.util

    classes = []
    for path in sorted((REPO / "recipes").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        classes += [
            value
            for name, value in vars(module).items()
            if name.endswith("Arguments") and dataclasses.is_dataclass(value) and value.__module__ == module.__name__
        ]
    fields = {cls: {field.name for field in dataclasses.fields(cls)} for cls in classes}
    # keys no recipe that splits rows has (dpo.py, grpo.py, distill.py and reward_model.py share some: beta,
    # loss_type, ...); the whole-row recipe whose arguments the YAML sets most of, and on a tie (a YAML setting
    # only `beta`) the one whose own arguments it covers the largest share of
    splitting = set().union(*(names for cls, names in fields.items() if not getattr(cls, "scores_whole_rows", None)))
    matches = [
        (
            len(keys & (names - splitting)),
            len(keys & (names - splitting)) / len(names - splitting),
            cls,
        )
        for cls, names in fields.items()
        if getattr(cls, "scores_whole_rows", None) and keys & (names - splitting)
    ]
    if not matches:
        return None
    recipe = max(matches, key=lambda match: match[:2])[2]
    return None if getattr(recipe, "scores_split_rows", False) else recipe.scores_whole_rows  # grpo.py splits its own


def check_mesh(mesh: dict, raw: dict, fsdp: dict, recipe: dict, world: int, keys: set[str] = frozenset()) -> list[str]:
    """parallelism_config: its sizes against the world size and what each dimension needs (common.launch.mesh's rules,
    which a launched run applies too), and whether the recipe's model can be split by tensor parallelism; `keys`:
    those the recipe YAML sets (which recipe it is)."""
    from common.launch.mesh import DIMENSIONS, mesh_problems

    sizes = {name: int(mesh.get(f"parallelism_config_{name}_size", 1)) for name in DIMENSIONS}
    fsdp2 = raw.get("distributed_type") == "FSDP" and str(fsdp.get("fsdp_version")) == "2"
    efficient = str(fsdp.get("fsdp_cpu_ram_efficient_loading", False)).lower() == "true"
    stage = (raw.get("deepspeed_config") or {}).get("zero_stage")
    problems = mesh_problems(
        sizes, world, str(raw.get("distributed_type")), fsdp2, efficient, int(stage) if stage is not None else None
    )
    if sizes["tp"] > 1:
        problems += tensor_parallel_model_problems(recipe, sizes["tp"])
    if sizes["ep"] > 1 and not problems:
        problems += expert_parallel_model_problems(recipe, sizes["ep"])
    if sizes["pp"] > 1:
        problems += pipeline_problems(mesh, recipe, keys)
    if sizes["sp"] > 1 or sizes["cp"] > 1:
        from common.parallel.sequence_parallel import recipe_problems, whole_rows_problem

        scores = whole_row_recipe(keys)
        problems += recipe_problems(recipe) + ([whole_rows_problem(scores)] if scores else [])
    return problems


def check_fp8(raw: dict, fsdp: dict, mesh: dict) -> list[str]:
    """mixed_precision: fp8 against what a launched run refuses (common.training.speed.fp8_problem: the backend,
    torchao on this host, DeepSpeed, tensor parallelism, FSDP2's efficient loading; the GPU where this host has
    one)."""
    from common.training.speed import fp8_host, fp8_problem

    strategy = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp"}.get(str(raw.get("distributed_type")), "ddp")
    problem = fp8_problem(
        *fp8_host(),
        str((raw.get("fp8_config") or {}).get("backend", "")),
        strategy,
        str(fsdp.get("fsdp_cpu_ram_efficient_loading", False)).lower() == "true",
        int(mesh.get("parallelism_config_tp_size", 1)),
    )
    return [problem] if problem else []


def recipe_model_on_meta(recipe: dict):
    """The recipe's causal LM built on the meta device (no weights), or None where its config is not reachable from
    here (e.g. a Hub name offline: the checks that need it are skipped)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = recipe.get("model_config") or recipe.get("model_name_or_path")
    try:
        config = AutoConfig.from_pretrained(source) if source else None
    except (OSError, ValueError):
        return None
    if config is None:
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def tensor_parallel_model_problems(recipe: dict, tp: int) -> list[str]:
    """The recipe's model has a tensor-parallel plan and heads that divide by tp."""
    from common.parallel.tensor_parallel import model_problems

    model = recipe_model_on_meta(recipe)
    return [] if model is None else [f"parallelism_config_{problem}" for problem in model_problems(model, tp)]


def expert_parallel_model_problems(recipe: dict, ep: int) -> list[str]:
    """The recipe's model has experts, a plan to split them by, and a number of them ep divides."""
    from common.parallel.expert_parallel import model_problems

    model = recipe_model_on_meta(recipe)
    return [] if model is None else [f"parallelism_config_{problem}" for problem in model_problems(model, ep)]


def pipeline_problems(mesh: dict, recipe: dict, keys: set[str]) -> list[str]:
    """parallelism_config_pp_*: the schedule, the recipe (common.parallel.pipeline.check_arguments, from its YAML) and
    its model (built on the meta device: a Llama with enough layers for the stages, its head not tied)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.launch.errors import UsageError
    from common.launch.mesh import pipeline_settings_in, pipeline_settings_problems
    from common.parallel import pipeline

    problems = pipeline_settings_problems(mesh)
    if problems:
        return problems
    settings = pipeline_settings_in(mesh)
    scores = whole_row_recipe(keys)
    try:  # the recipe's YAML as its arguments (the whole-row recipe told by its keys)
        pipeline.check_arguments((type("Recipe", (), {**recipe, "scores_whole_rows": scores})(),))
    except UsageError as error:
        problems.append(str(error))
    source = recipe.get("model_config") or recipe.get("model_name_or_path")
    try:
        config = AutoConfig.from_pretrained(source) if source else None
    except (OSError, ValueError):
        config = None  # not reachable from here (e.g. a Hub name offline): skip the check
    if config is not None:
        with torch.device("meta"):
            problems += pipeline.model_problems(AutoModelForCausalLM.from_config(config), settings)
    return problems


def check_deepspeed(deepspeed: dict, raw: dict, recipe: dict, world: int, config_path: str) -> list[str]:
    problems = []
    micro = recipe["per_device_train_batch_size"]
    accumulation = recipe["gradient_accumulation_steps"]
    clipping = recipe["max_grad_norm"]
    if "deepspeed_config_file" in deepspeed:
        path = deepspeed["deepspeed_config_file"]
        if not os.path.isfile(path):
            return [f"deepspeed_config_file: {path} does not exist (paths are relative to where you launch)"]
        with open(path) as handle:
            try:
                ds = json.load(handle)
            except json.JSONDecodeError as error:
                return [f"{path}: not valid JSON ({error})"]
        if "mixed_precision" in raw:
            problems.append(
                "mixed_precision: set it in the DeepSpeed JSON (bf16/fp16 blocks), not beside "
                "deepspeed_config_file; accelerate refuses both"
            )
        zero = ds.get("zero_optimization", {})
        stage = zero.get("stage", 0)
        offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none")
        offload_param = zero.get("offload_param", {}).get("device", "none")
        values = {
            k: ds.get(k, "auto")
            for k in (
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "train_batch_size",
                "gradient_clipping",
            )
        }
        if values["train_micro_batch_size_per_gpu"] not in ("auto", micro):
            problems.append(
                f"{path}: train_micro_batch_size_per_gpu={values['train_micro_batch_size_per_gpu']} but the "
                f'recipe\'s per_device_train_batch_size={micro}; use "auto"'
            )
        if values["gradient_accumulation_steps"] not in ("auto", accumulation):
            problems.append(
                f"{path}: gradient_accumulation_steps={values['gradient_accumulation_steps']} but the "
                f'recipe\'s is {accumulation}; use "auto"'
            )
        expected = micro * accumulation * world
        if values["train_batch_size"] not in ("auto", expected):
            problems.append(
                f"{path}: train_batch_size={values['train_batch_size']} != micro {micro} x accumulation "
                f'{accumulation} x world size {world} = {expected}; use "auto"'
            )
        if values["gradient_clipping"] not in ("auto", clipping):
            problems.append(
                f"{path}: gradient_clipping={values['gradient_clipping']} but the recipe's "
                f'max_grad_norm={clipping}; make them equal or use "auto"'
            )
    else:
        stage = deepspeed.get("zero_stage", 0)
        offload_optimizer = deepspeed.get("offload_optimizer_device", "none")
        offload_param = deepspeed.get("offload_param_device", "none")
        if "gradient_clipping" in deepspeed and float(deepspeed["gradient_clipping"]) != float(clipping):
            problems.append(
                f"deepspeed_config.gradient_clipping={deepspeed['gradient_clipping']} but the recipe's "
                f"max_grad_norm={clipping}; remove the key (--max_grad_norm sets it) or make them equal"
            )
        if "gradient_accumulation_steps" in deepspeed and deepspeed["gradient_accumulation_steps"] != accumulation:
            problems.append(
                f"deepspeed_config.gradient_accumulation_steps={deepspeed['gradient_accumulation_steps']} "
                f"but the recipe's is {accumulation}; remove the key (the recipe sets it)"
            )
    if stage not in ZERO_STAGES:
        problems.append(f"zero stage {stage!r}: must be one of {ZERO_STAGES}")
    if offload_param not in ("none", None) and stage != 3:
        problems.append(
            f"offload_param_device={offload_param} needs ZeRO stage 3 (got {stage}); use zero3_offload.yaml "
            "or set offload_param_device: none"
        )
    if offload_optimizer not in ("none", None) and stage == 0:
        problems.append(f"offload_optimizer_device={offload_optimizer} needs ZeRO stage 1, 2 or 3 (got 0)")
    return problems


def refuse(message: str) -> int:
    """Bad input to the checker itself: one line and exit status 2, as the recipes' (common.launch.errors)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config_file", help="accelerate config YAML")
    parser.add_argument("--recipe_config", help="recipe YAML whose batch sizes and model to check against")
    parser.add_argument("--num_processes", type=int, help="world size, if not the YAML's num_processes")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.config_file):
        return refuse(
            f"{args.config_file} does not exist; pass an accelerate config such as accelerate_configs/ddp.yaml"
        )
    if args.recipe_config and not os.path.isfile(args.recipe_config):
        return refuse(
            f"--recipe_config {args.recipe_config} does not exist; pass a recipe YAML such as "
            "recipes/configs/causal_lm_demo.yaml"
        )
    problems = check(args.config_file, args.recipe_config, args.num_processes)
    for problem in problems:
        print(f"{args.config_file}: {problem}")
    if not problems:
        print(f"{args.config_file}: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
