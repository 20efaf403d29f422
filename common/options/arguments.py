"""The recipes' shared options (model, data, training) as dataclasses, each value checked on its own.

A bad value is a `UsageError` with a one-line message, raised while parsing (`common.options.parsing`),
before any process group exists. Options that are wrong only together are checked there. A
number's bounds are declared in its annotation, `seed: Annotated[int, Range(0, 2**32 - 1)]`,
and checked (`check_ranges`) before anything else of its dataclass.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Annotated

import torch

from common.launch.errors import UsageError
from common.options.dataset_mixture import parse_mixture
from common.options.ranges import AT_LEAST_0, AT_LEAST_1, Range, check_ranges


DTYPES = ("auto", "float32", "bfloat16", "float16")
# the speed options' choices (common.training.speed applies them)
ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention", "sdpa_varlen")
OPTIMIZERS = {"adamw_torch_fused": {"fused": True}, "adamw_torch": {"foreach": True}}
# --report_to: accelerate's trackers, each with how to install it (trackio and mlflow are this project's extras)
TRACKERS = {
    "tensorboard": "pip install tensorboard",
    "wandb": "pip install wandb",
    "trackio": "pip install '.[trackio]' (trackio)",
    "mlflow": "pip install '.[mlflow]' (mlflow-skinny with its SQLite store)",
}


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@dataclass
class SpeedArguments:
    attn_implementation: str = field(
        default="auto",
        metadata={
            "help": f"Attention kernel: {', '.join(ATTENTION)}. auto: flash_attention_2 where flash-attn is installed "
            "(GPU); for packed rows flex_attention on a GPU, else sdpa_varlen (per-example sdpa); otherwise "
            "the model's default (sdpa). run.json records the one used."
        },
    )
    torch_compile: bool = field(
        default=False,
        metadata={
            "help": "Compile each repeated layer once with torch.compile (accelerate's regional compilation, inductor); "
            "the first steps take the compile time."
        },
    )
    optim: str = field(
        default="adamw_torch_fused",
        metadata={"help": f"AdamW kernel: {' or '.join(OPTIMIZERS)} (torch's foreach implementation)."},
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Recompute layers' activations in the backward instead of keeping them (less memory, ~1/3 more "
            "compute per checkpointed layer)."
        },
    )
    gradient_checkpointing_every_n_layers: int = field(
        default=1,
        metadata={
            "help": "With --gradient_checkpointing: checkpoint one layer in N (2: every other layer), trading some "
            "of the memory saved back for speed."
        },
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata={"help": "Patch the model with Liger's Triton kernels (NVIDIA GPU and the liger-kernel package)."},
    )

    def __post_init__(self):
        on_gpu = torch.cuda.is_available()
        if self.attn_implementation not in ATTENTION:
            raise UsageError(
                f"--attn_implementation must be one of {', '.join(ATTENTION)}, got {self.attn_implementation!r}"
            )
        if self.attn_implementation == "flash_attention_2" and not (on_gpu and installed("flash_attn")):
            raise UsageError(
                "--attn_implementation flash_attention_2 needs an NVIDIA GPU and the flash-attn package "
                "(pip install flash-attn); --attn_implementation auto picks the fastest kernel installed"
            )
        if self.attn_implementation == "flex_attention" and not on_gpu:
            raise UsageError(
                "--attn_implementation flex_attention: torch's flex_attention has no backward on CPU; on "
                "a host without a GPU use auto (sdpa, and sdpa_varlen for packed rows)"
            )
        if self.optim not in OPTIMIZERS:
            raise UsageError(f"--optim must be one of {', '.join(OPTIMIZERS)}, got {self.optim!r}")
        if self.gradient_checkpointing_every_n_layers < 1:
            raise UsageError(
                f"--gradient_checkpointing_every_n_layers must be at least 1, got "
                f"{self.gradient_checkpointing_every_n_layers}"
            )
        if self.gradient_checkpointing_every_n_layers > 1 and not self.gradient_checkpointing:
            raise UsageError(
                "--gradient_checkpointing_every_n_layers chooses which layers --gradient_checkpointing "
                "recomputes; add --gradient_checkpointing true"
            )
        if self.use_liger_kernel and not on_gpu:
            raise UsageError(
                "--use_liger_kernel: Liger's kernels are Triton GPU kernels and this host has no CUDA GPU; "
                "drop --use_liger_kernel here"
            )
        if self.use_liger_kernel and not installed("liger_kernel"):
            raise UsageError("--use_liger_kernel needs the liger-kernel package: pip install liger-kernel")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub name or local folder of a pretrained model."}
    )
    model_config: str | None = field(
        default=None, metadata={"help": "Config file/folder to build a randomly initialised model."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer; defaults to model_name_or_path."}
    )
    adapter_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A saved PEFT adapter to load on top of model_name_or_path; the recipes train it on with "
            "--use_peft (a LoRA run's final/ may also be given as --model_name_or_path)."
        },
    )
    torch_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the weights are loaded and trained in: float32 (fp32 master "
            "weights, whatever the checkpoint's dtype; mixed precision comes from the "
            "accelerate config), auto (the checkpoint's), bfloat16 or float16."
        },
    )
    save_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of the exported model: auto (the dtype the pretrained checkpoint "
            "was saved in; float32 for a model built from a config), float32, "
            "bfloat16 or float16."
        },
    )
    output_router_logits: bool | None = field(
        default=None,
        metadata={
            "help": "Mixture-of-experts models: add the router's load-balancing loss (weighted by the config's "
            "router_aux_loss_coef) to the loss, and log aux_loss and the experts' load (true), or not (false); "
            "unset: as the model's config says (Hub MoE checkpoints mostly ship it off)."
        },
    )

    def __post_init__(self):
        if bool(self.model_name_or_path) == bool(self.model_config):
            raise UsageError(
                "give exactly one of --model_name_or_path or --model_config "
                '(clear one set in the recipe YAML with --model_config "")'
            )
        if self.model_config:
            require_path(self.model_config, "model_config")
            _require_json_config(self.model_config)
        for key in ("model_name_or_path", "tokenizer_name_or_path", "adapter_name_or_path"):
            _require_local_or_hub_name(getattr(self, key), key)
        if not (self.tokenizer_name_or_path or self.model_name_or_path):
            raise UsageError("--model_config needs --tokenizer_name_or_path")
        for key, allowed in (("torch_dtype", DTYPES), ("save_dtype", DTYPES)):
            if getattr(self, key) not in allowed:
                raise UsageError(f"--{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset name."})
    dataset_config_name: str | None = None
    train_file: str | None = field(default=None, metadata={"help": "json/jsonl/csv/parquet/txt"})
    validation_file: str | None = None
    dataset_mixture: str | None = field(
        default=None,
        metadata={
            "help": "Several sources mixed into one training set, as the alignment-handbook's dataset_mixture: a mapping "
            "in the recipe YAML, or a YAML/JSON file (or JSON) here; see common/data/mixture.py."
        },
    )
    validation_split_percentage: Annotated[int, Range(above=0, below=100)] = field(
        default=5, metadata={"help": "Held-out share of train when no validation split exists."}
    )
    text_column: str = "text"
    block_size: Annotated[int, Range(low=2)] = field(
        default=128,
        metadata={
            "help": "Tokens per training row: causal_lm.py's packed block; sft.py's longest example and dpo.py's "
            "longest side of a pair (longer ones: --overlong)."
        },
    )
    max_eval_samples: Annotated[int | None, Range(low=1, why="unset: all of them")] = None
    preprocessing_num_workers: Annotated[int | None, AT_LEAST_0] = field(
        default=None,
        metadata={
            "help": "Processes that tokenize the data (datasets' map num_proc); default: the main process alone."
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Read the training split as it is consumed (an IterableDataset: data larger than memory or disk), "
            "each process tokenizing and packing its own documents, in file order; needs --max_steps. "
            "See common/data/streaming.py."
        },
    )

    def __post_init__(self):
        check_ranges(self)
        if sum(map(bool, (self.dataset_name, self.train_file, self.dataset_mixture))) != 1:
            raise UsageError(
                "give exactly one of --dataset_name, --train_file or --dataset_mixture (clear one a recipe "
                "YAML sets with --train_file '' --validation_file '')"
            )
        self.mixture = parse_mixture(self.dataset_mixture) if self.dataset_mixture else None  # not an option itself
        if self.mixture and self.mixture.test_split_size and self.validation_file:
            raise UsageError(
                "--validation_file and the mixture's test_split_size both give the validation set; "
                "drop one (--validation_file '' clears a recipe YAML's)"
            )
        for key in ("train_file", "validation_file"):
            if getattr(self, key):
                require_path(getattr(self, key), key)


@dataclass
class TrainingArguments(SpeedArguments):  # + the speed options (above; common.training.speed applies them)
    output_dir: str = field(
        default="outputs/run", metadata={"help": "Where run.json, metrics, checkpoints and the final model go."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Start afresh in an output_dir that already holds a run."}
    )
    seed: Annotated[int, Range(0, 2**32 - 1, why="numpy's seeds are 32-bit")] = 42
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; overrides num_train_epochs when > 0."})
    num_train_epochs: Annotated[int, AT_LEAST_1] = 1
    max_train_seconds: Annotated[float | None, Range(above=0, why="unset: no time limit")] = field(
        default=None,
        metadata={
            "help": "Stop at the first optimizer step that ends this many seconds after the first step began (every "
            "rank at the same step; evaluations and saves inside the loop count), then evaluate and export as at "
            "--max_steps, whose schedule still applies (common/training/time_budget.py)."
        },
    )
    per_device_train_batch_size: Annotated[int, AT_LEAST_1] = 8
    per_device_eval_batch_size: Annotated[int, AT_LEAST_1] = 8
    gradient_accumulation_steps: Annotated[int, AT_LEAST_1] = 1
    auto_find_batch_size: bool = field(
        default=False,
        metadata={
            "help": "Before training, halve the per-device batch (to a divisor) while a training step runs out of "
            "memory, raising gradient_accumulation_steps to keep the global batch (common/training/batch_size.py)."
        },
    )
    learning_rate: Annotated[float, AT_LEAST_0] = field(
        default=5e-5,
        metadata={
            "help": "AdamW's peak learning rate (Trainer's default, for fine-tuning; from scratch, raise it: the demo "
            "YAMLs set theirs)."
        },
    )
    weight_decay: Annotated[float, AT_LEAST_0] = 0.0
    adam_beta1: Annotated[float, Range(0, below=1)] = 0.9
    adam_beta2: Annotated[float, Range(0, below=1)] = 0.999
    adam_epsilon: Annotated[float, AT_LEAST_0] = 1e-8
    max_grad_norm: Annotated[float, Range(low=0, why="0 turns clipping off")] = field(
        default=1.0,
        metadata={
            "help": "Clip the global gradient norm to this under every strategy (DeepSpeed included); 0: no clipping."
        },
    )
    lr_scheduler_type: str = field(
        default="cosine",
        metadata={
            "help": "A transformers.get_scheduler name, stepped once per optimizer step (not reduce_lr_on_plateau or "
            "greedy, which step on an evaluation metric)."
        },
    )
    lr_scheduler_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "The scheduler's own arguments as a JSON object (a mapping in the recipe YAML), e.g. "
            "'{\"min_lr_rate\": 0.1}' for cosine_with_min_lr, '{\"num_decay_steps\": 100}' for "
            "warmup_stable_decay."
        },
    )
    warmup_steps: Annotated[int, AT_LEAST_0] = 0
    warmup_ratio: Annotated[float, Range(low=0, below=1)] = field(
        default=0.0,
        metadata={
            "help": "Warm up over this fraction of the run's optimizer steps (rounded up), as Trainer's and the "
            "alignment-handbook's warmup_ratio; or give --warmup_steps, not both."
        },
    )
    logging_steps: Annotated[int, AT_LEAST_1] = 10
    eval_steps: Annotated[int, AT_LEAST_0] = field(
        default=0, metadata={"help": "Evaluate every N steps; 0 evaluates at the end only."}
    )
    eval_on_start: bool = field(
        default=False,
        metadata={
            "help": "Evaluate once before the first step too (the summary's 'before' figure; kept across a resume), "
            "as Trainer's eval_on_start; off: no evaluation before training."
        },
    )
    save_steps: Annotated[int, AT_LEAST_0] = field(
        default=0, metadata={"help": "Checkpoint every N steps; 0 saves no checkpoints."}
    )
    save_total_limit: Annotated[int | None, Range(low=1, why="unset keeps every checkpoint")] = field(
        default=None, metadata={"help": "Keep at most N checkpoints (oldest pruned after a save succeeds)."}
    )
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "'latest' or a checkpoint folder."})
    report_to: str = field(
        default="tensorboard",
        metadata={
            "help": f"{', '.join(TRACKERS)} or none (trackio and mlflow: pip install '.[trackio]' or '.[mlflow]')."
        },
    )
    sync_each_micro_batch: bool | None = field(
        default=None,
        metadata={
            "help": "Reduce gradients after every micro-batch rather than once per optimizer step. Default: on under "
            "FSDP (gradients stay sharded while accumulating: less memory, more communication), off otherwise."
        },
    )
    run_name: str = "recipe"
    ddp_timeout: Annotated[int, Range(1, 10**9, why="seconds")] = field(
        default=1800,
        metadata={
            "help": "Seconds a collective waits for the other ranks before the run ends with an error naming the "
            "lost peer. Long enough for work one rank does alone (tokenising a corpus, an export)."
        },
    )
    nonfinite: str = field(
        default="skip",
        metadata={
            "help": "A step whose loss or gradients are not finite on any rank: skip (every rank leaves weights, "
            "optimizer and schedule as they were; the run stops after --max_nonfinite_skips) or stop."
        },
    )
    profile_steps: str | None = field(
        default=None,
        metadata={
            "help": "Trace optimizer steps FIRST-LAST (e.g. 3-5) with torch.profiler into output_dir/profile, one "
            "file per rank (TensorBoard or Perfetto)."
        },
    )
    profile_memory: bool = field(default=False, metadata={"help": "With --profile_steps: record memory too."})
    peak_tflops: Annotated[float | None, Range(above=0)] = field(
        default=None,
        metadata={
            "help": "The device's dense peak TFLOP/s in the compute dtype, for MFU; default: a table of common GPUs "
            "in bf16/fp16 (MFU is left empty on CPU or an unknown device)."
        },
    )
    max_nonfinite_skips: Annotated[int, AT_LEAST_0] = field(
        default=10, metadata={"help": "Skipped non-finite steps the run tolerates."}
    )

    def __post_init__(self):
        check_ranges(self)
        super().__post_init__()
        if self.learning_rate == 0:
            raise UsageError("--learning_rate is 0, so nothing would train; pass a positive learning rate")
        self._check_scheduler()
        if os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise UsageError(f"--output_dir {self.output_dir} is a file; pass a folder (it is created if missing)")
        if self.profile_steps:
            parse_steps(self.profile_steps)
        if self.nonfinite not in ("skip", "stop"):
            raise UsageError(f"--nonfinite must be skip or stop, got {self.nonfinite!r}")
        if self.report_to not in (*TRACKERS, "none"):
            raise UsageError(f"--report_to must be {', '.join(TRACKERS)} or none, got {self.report_to!r}")
        if self.report_to != "none" and importlib.util.find_spec(self.report_to) is None:
            raise UsageError(
                f"--report_to {self.report_to} needs the {self.report_to} package, which is not installed "
                f"here: {TRACKERS[self.report_to]}, or pass another --report_to"
            )
        if self.resume_from_checkpoint not in (None, "latest"):
            require_path(self.resume_from_checkpoint, "resume_from_checkpoint")
        if self.warmup_steps and self.warmup_ratio:
            raise UsageError(
                f"--warmup_steps {self.warmup_steps} and --warmup_ratio {self.warmup_ratio} both set the "
                "warm-up; give one of them"
            )

    @property
    def scheduler_kwargs(self) -> dict:
        return json.loads(self.lr_scheduler_kwargs) if self.lr_scheduler_kwargs else {}

    def _check_scheduler(self) -> None:
        """Every scheduler offered steps with no argument, once per optimizer step: those that need
        a metric are refused, and those that need arguments are built once here to check them."""
        from transformers import SchedulerType, get_scheduler

        offered = [kind.value for kind in SchedulerType if kind.value not in METRIC_SCHEDULERS]
        if self.lr_scheduler_type in METRIC_SCHEDULERS:
            raise UsageError(
                f"--lr_scheduler_type {self.lr_scheduler_type} steps on an evaluation metric, which "
                f"these recipes' loop does not give it; use one of {', '.join(offered)}"
            )
        if self.lr_scheduler_type not in offered:
            raise UsageError(
                f"--lr_scheduler_type {self.lr_scheduler_type!r} is not a scheduler; use one of {', '.join(offered)}"
            )
        try:
            kwargs = self.scheduler_kwargs
        except ValueError as error:
            raise UsageError(
                f"--lr_scheduler_kwargs is not JSON ({error}); pass an object such as '{{\"min_lr_rate\": 0.1}}'"
            ) from None
        if not isinstance(kwargs, dict):
            raise UsageError(f"--lr_scheduler_kwargs must be a JSON object, got {self.lr_scheduler_kwargs}")
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=self.learning_rate or 1.0)
        steps = max(self.max_steps, self.warmup_steps + 1, 2)
        try:
            schedule = get_scheduler(
                self.lr_scheduler_type,
                optimizer,
                num_warmup_steps=self.warmup_steps,
                num_training_steps=steps,
                scheduler_specific_kwargs=kwargs,
            )
            optimizer.step()
            schedule.step()
        except (TypeError, ValueError) as error:
            example = SCHEDULER_KWARGS_EXAMPLES.get(self.lr_scheduler_type, "{}")
            reason = str(error).splitlines()[0]
            raise UsageError(
                f"--lr_scheduler_type {self.lr_scheduler_type} with --lr_scheduler_kwargs "
                f"{json.dumps(kwargs)}: {reason}; pass its arguments, e.g. --lr_scheduler_kwargs "
                f"'{example}'"
            ) from None


# Schedulers whose step() takes an evaluation metric; the recipes step once per optimizer step.
METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")
SCHEDULER_KWARGS_EXAMPLES = {
    "cosine_with_min_lr": '{"min_lr_rate": 0.1}',
    "cosine_warmup_with_min_lr": '{"min_lr_rate": 0.1}',
    "warmup_stable_decay": '{"num_decay_steps": 100}',
}


def parse_steps(text: str) -> tuple[int, int]:
    """--profile_steps FIRST-LAST as (first, last) optimizer steps (common.training.profiling traces them)."""
    try:
        first, last = (int(part) for part in text.split("-"))
    except ValueError:
        raise UsageError(f"--profile_steps must be FIRST-LAST optimizer steps such as 3-5, got {text!r}") from None
    if not 1 <= first <= last:
        raise UsageError(f"--profile_steps {text}: need 1 <= FIRST <= LAST")
    return first, last


def _require_json_config(path: str) -> None:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"--model_config {file} is not a readable JSON model config ({error}); pass a config.json "
            "such as recipes/configs/tiny_llama.json"
        ) from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UsageError(
            f'--model_config {file} has no "model_type"; a transformers config.json names its '
            "model_type (llama, gpt2, ...)"
        )


def _require_local_or_hub_name(value: str | None, key: str) -> None:
    """A local folder that exists, or something shaped like a Hub name (`org/name` or `name`).
    A path that looks local (starts with ., /, ~ or has more than one /) must exist."""
    if value and os.path.isfile(value):
        raise UsageError(f"--{key} {value} is a file; pass the folder that holds it")
    if not value or os.path.exists(value):
        return
    looks_local = value.startswith((".", "/", "~")) or value.count("/") > 1
    if looks_local:
        raise UsageError(f"--{key} {value} does not exist; pass an existing local folder or a Hub name (org/name)")


def require_path(path: str, key: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"{key}: {path} does not exist; check the path (relative paths start at {os.getcwd()})")
