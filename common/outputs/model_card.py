"""The model card: README.md in every folder a run exports, with the Hub's metadata, from run.json and metrics.

    ---
    base_model: org/name              # a Hub model the run started from (a local folder is named below)
    library_name: transformers        # peft for an adapter
    tags: [accelerate-recipes, sft, deepspeed, lora]
    datasets: [org/data]              # --dataset_name, where the data came from the Hub
    ---
    # <folder>: what it is, base model, data, recipe and strategy, hyper-parameters, final metrics, command

Everything comes from the run's own records (`run.json`, `metrics.jsonl`), written before the
export, so the card says what ran rather than what was asked, and what the folder holds: a
checkpoint's export (step_N) shows the rows logged at or before step N and N trained steps,
not the run's last; the LoRA options appear only where LoRA trained.
"""

from __future__ import annotations

import json
import os
import shlex


HYPERPARAMETERS = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "num_train_epochs",
    "max_steps",
    "max_train_seconds",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "block_size",
    "seed",
)
LORA_HYPERPARAMETERS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")  # where LoRA trained


def write_model_card(
    folder: str, output_dir: str, what: str, step: int | None = None, logged_until: int | None = None
) -> None:
    """`folder`/README.md for the export `what` (final, best, final_merged, a checkpoint's step_N) of the
    run in `output_dir`; peft's template README, where peft wrote one, is replaced. `step`: the training step
    the folder's weights are at (a checkpoint's); None for the run's own exports, written as it reaches
    them, whose step is the last one metrics.jsonl holds. `logged_until`: metrics.jsonl's rows after that
    step are another continuation's (a checkpoint a resume set aside), so they are left out too."""
    from huggingface_hub import ModelCard, ModelCardData

    run = _read_json(os.path.join(output_dir, "run.json")) or {}
    args = run.get("args", {})
    bounds = [bound for bound in (step, logged_until) if bound is not None]
    rows = _logged_rows(output_dir, min(bounds) if bounds else None)
    if step is None:
        step = max((row["step"] for row in rows if isinstance(row.get("step"), int)), default=None)
    adapter = os.path.isfile(os.path.join(folder, "adapter_config.json"))
    base = args.get("model_name_or_path")
    on_hub = bool(base) and not os.path.exists(base)
    recipe = os.path.splitext(os.path.basename((run.get("command") or ["the recipe"])[0]))[0]
    strategy = run.get("launched_strategy", "?")
    lora = adapter or bool(args.get("use_peft"))
    tags = ["accelerate-recipes", recipe, strategy] + (["lora"] if lora else [])
    data = ModelCardData(
        base_model=base if on_hub else None,
        library_name="peft" if adapter else "transformers",
        tags=tags,
        datasets=_hub_datasets(args, run) or None,
    )
    body = "\n\n".join(
        [
            f"# {os.path.basename(os.path.normpath(output_dir))} / {what}",
            _what_it_is(adapter, base, args, what),
            "## Data\n\n" + _data(args, run),
            "## Training\n\n" + _training(run, recipe, step),
            "## Hyper-parameters\n\n"
            + _table(
                {
                    key: args[key]
                    for key in HYPERPARAMETERS + (LORA_HYPERPARAMETERS if lora else ())
                    if args.get(key) is not None
                }
            ),
            "## Results\n\n" + _results(rows),
            "## Command\n\n" + _command(run),
        ]
    )
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n").save(os.path.join(folder, "README.md"))


def _hub_datasets(args: dict, run: dict) -> list:
    """The Hub datasets the run trained on: --dataset_name, or a mixture's sources that are not local."""
    names = [args["dataset_name"]] if args.get("dataset_name") else []
    return list(
        dict.fromkeys(names + [source["source"] for source in run.get("data_sources", []) if source.get("hub")])
    )


def _what_it_is(adapter: bool, base, args: dict, what: str) -> str:
    start = (
        f"the pretrained model `{base}`"
        if base
        else f"a model built from `{args.get('model_config')}` (trained from scratch)"
    )
    if args.get("adapter_name_or_path"):  # an adapter trained on (DPO after a LoRA SFT, say)
        start += f" with the LoRA adapter `{args['adapter_name_or_path']}`, trained on from its weights"
    kind = (
        "A LoRA adapter (load it with `peft.PeftModel.from_pretrained` on the base model)"
        if adapter
        else "The base model with its LoRA adapter merged in"
        if what.endswith("_merged")
        else "A Hugging Face model folder (load it with `from_pretrained`)"
    )
    return f"{kind}, trained from {start}. Written by the run's `{what}` export."


def _data(args: dict, run: dict) -> str:
    sources = {
        "dataset": args.get("dataset_name"),
        "train file": args.get("train_file"),
        "validation file": args.get("validation_file"),
    }
    counts = {key: run[key] for key in ("train_blocks", "dropped_examples") if run.get(key) is not None}
    for source in run.get("data_sources", []):  # a --dataset_mixture's sources and the rows each gave
        taken = (
            f"{source['train']} training rows"
            if "train" in source
            else f"{source['rows']} rows"
            if "rows" in source
            else f"drawn with probability {source['probability']}"
        )
        sources[f"source {source['source']} ({source['split']})"] = taken
    return _table({**{k: v for k, v in sources.items() if v}, **counts}) or "Not recorded."


def _training(run: dict, recipe: str, step: int | None) -> str:
    stopped = run.get("training_time", {}).get("stopped_by_time_budget", {})  # --max_train_seconds ended it there
    facts = {
        "recipe": f"recipes/{recipe}.py",
        "strategy": run.get("launched_strategy"),
        "distributed type": run.get("distributed_type"),
        "processes": run.get("participating_processes"),
        "mixed precision": run.get("mixed_precision"),
        "compute dtype": run.get("compute_dtype"),
        "master weights": run.get("master_weights_dtype"),
        "ZeRO stage": run.get("zero_stage"),
        "effective batch size": run.get("effective_batch_size"),
        "trained steps": step if step is not None else stopped.get("step", run.get("max_steps")),
    }
    versions = run.get("versions", {})
    facts["versions"] = ", ".join(f"{name} {version}" for name, version in versions.items() if version)
    return _table({key: value for key, value in facts.items() if value not in (None, "")})


def _logged_rows(output_dir: str, until: int | None) -> list[dict]:
    """metrics.jsonl's rows, those after step `until` left out (None: all of them)."""
    rows = []
    path = os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path) as handle:
            for line in handle:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line a crash left half-written
                if until is None or row.get("step", 0) <= until:
                    rows.append(row)
    return rows


def _results(rows: list[dict]) -> str:
    """The last evaluation and the last logged training step of `rows`."""
    evaluation, train = {}, {}
    for row in rows:
        if any(key.startswith("eval_") for key in row):
            evaluation = row
        elif "loss" in row:
            train = row
    shown = {f"eval at step {evaluation['step']}: {k}": v for k, v in evaluation.items() if k.startswith("eval_")}
    if train:
        shown[f"train loss at step {train['step']}"] = train["loss"]
    return (
        _table({key: round(value, 4) if isinstance(value, float) else value for key, value in shown.items()})
        or "No evaluation was logged."
    )


def _command(run: dict) -> str:
    command = run.get("command")
    if not command:
        return "Not recorded."
    launch = (
        f"accelerate launch --num_processes {run.get('world_size', 1)} (the {run.get('launched_strategy')} config)"
    )
    return f"Launched with {launch}:\n\n```bash\npython {' '.join(shlex.quote(part) for part in command)}\n```"


def _table(rows: dict) -> str:
    if not rows:
        return ""
    lines = [f"| {key} | {str(value).replace('|', '/')} |" for key, value in rows.items()]
    return "\n".join(["| | |", "|---|---|", *lines])


def _read_json(path: str):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None
