"""Checkpoints: save every --save_steps so that a crash mid-save loses nothing, and load one to resume.

accelerate's own rotation deletes the oldest checkpoint before writing the new one, and its
automatic naming restarts at 0 after `load_state`. So checkpoints are named by optimizer
step, written to a temporary folder, renamed into place only once complete, and pruned only
after that (`common.outputs.run_dir`). A checkpoint written on another world size is converted
before the run starts (`common.outputs.reshard`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil

from common.launch.accelerator import unwrap
from common.launch.errors import RunStopped, UsageError, describe, load_fault
from common.launch.internals import innermost_optimizer, repair_zero3_universal_load
from common.launch.peers import lost_peer_message
from common.outputs import portable, reshard
from common.outputs.portable_load import load as load_portable
from common.outputs.run_dir import MODEL_FILES, STATE_FILE, checkpoints_dir, list_checkpoints, swap_into_place
from common.parallel import pipeline, tensor_parallel
from common.training.nonfinite import check_finite_weights


def save_checkpoint(
    accelerator,
    model,
    optimizer,
    scheduler,
    output_dir: str,
    step: int,
    state: dict,
    total_limit: int | None,
    tokenizer=None,
    dtype=None,
) -> str:
    """accelerate `save_state` into tmp, then an atomic rename to step_N, then prune.
    Weights that are not finite stop the run instead (nothing is written). Beside the state,
    MODEL_FILES holds what a Hugging Face folder needs besides the weights (config in the
    export `dtype`, tokenizer, adapter config), so scripts/export_checkpoint.py can turn any
    checkpoint into one without launching. `model`, `optimizer` and `scheduler` are the prepared ones
    (under tensor parallelism they are saved by `common.parallel.tensor_parallel`, which accelerate cannot)."""
    check_finite_weights(accelerator, model, step)
    root = checkpoints_dir(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f"tmp-step_{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a save that crashed
        os.makedirs(tmp, exist_ok=True)
    accelerator.wait_for_everyone()
    if pipeline.enabled(accelerator):  # DCP: each stage its share
        pipeline.save_state(accelerator, model, optimizer, scheduler, tmp)
    elif tensor_parallel.enabled(accelerator.state):
        tensor_parallel.save_state(accelerator, model, optimizer, scheduler, tmp)
    else:
        with tied_weights_unsaid():
            accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_model_files(unwrap(accelerator, model), tokenizer, dtype, os.path.join(tmp, MODEL_FILES))
        with open(os.path.join(tmp, STATE_FILE), "w") as handle:
            json.dump({"step": step, **reshard.layout(accelerator), **state}, handle)
        swap_into_place(tmp, final)  # a same-step folder from an earlier attempt is replaced
        if total_limit:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


class _TiedWeightsNote(logging.Filter):
    def filter(self, record) -> bool:
        return "Removed shared tensor" not in record.getMessage()  # accelerate prefixes "[RANK n] "


@contextlib.contextmanager
def tied_weights_unsaid():
    """accelerate's safetensors writer keeps one name of weights that share storage (tied embeddings: SmolLM2's,
    Qwen3's) and warns of the others on every save ("Removed shared tensor ..."). The model a checkpoint is loaded
    back into shares them again, so nothing is lost: the line is left out of the console."""
    quiet, source = _TiedWeightsNote(), logging.getLogger("accelerate.utils.other")
    source.addFilter(quiet)
    try:
        yield
    finally:
        source.removeFilter(quiet)


def load_checkpoint(accelerator, path: str | None, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG state; return the saved trainer state
    ({"step": 0} for a fresh run, when `path` is None). `model`, `optimizer` and `scheduler` are
    the prepared ones. A checkpoint of another strategy comes as its portable rewrite."""
    if path is None:
        return {"step": 0}
    universal = reshard.is_universal(path)
    # each param group's hyperparameters but the learning rate (the schedule sets it)
    hyperparameters = (
        [
            {key: value for key, value in group.items() if key not in ("params", "lr")}
            for group in innermost_optimizer(optimizer).param_groups
        ]
        if universal
        else None
    )
    try:
        if portable.is_portable(path):
            load_portable(accelerator, model, optimizer, scheduler, path)
        elif pipeline.enabled(accelerator):
            pipeline.load_state(accelerator, model, optimizer, scheduler, path)
        elif tensor_parallel.enabled(accelerator.state):
            tensor_parallel.load_state(accelerator, model, optimizer, scheduler, path)
        else:
            accelerator.load_state(path)
        if universal:
            repair_zero3_universal_load(optimizer, hyperparameters)
        with open(os.path.join(path, STATE_FILE)) as handle:
            state = json.load(handle)
    except Exception as error:
        if lost_peer_message(error, None) is not None:
            raise  # a collective failed: the exit policy names the lost peer
        raise load_failure(path, error) from None
    schedule_the_loaded_optimizer(optimizer, scheduler)  # before the schedule sets a rate
    reshard.schedule_from_before_per_step(scheduler, state)
    saved_processes = state.get("num_processes", accelerator.num_processes)
    accelerator.print(
        f"resumed from {path} at step {state['step']}"
        + (
            f" (saved by {saved_processes} process{'es' * (saved_processes != 1)})"
            if saved_processes != accelerator.num_processes
            else ""
        )
    )
    return state


def schedule_the_loaded_optimizer(optimizer, scheduler) -> None:
    """Under optimizer offload (GPU hosts), accelerate swaps the recipe's AdamW for a DeepSpeedCPUAdam built on the
    same param-group dicts, and the schedule keeps the AdamW. Loading a checkpoint gives the CPUAdam new groups, so
    the schedule then set a learning rate nobody read: every step after a resume ran at the checkpoint's rate (seen
    on an H100: loss gap 0.11 two steps after the resume). The schedule steps the optimizer that updates the weights."""
    schedule, updating = getattr(scheduler, "scheduler", scheduler), innermost_optimizer(optimizer)
    if getattr(schedule, "optimizer", updating) is not updating:
        schedule.optimizer = updating


def load_failure(path: str, error: BaseException) -> Exception:
    """The one-line error for a checkpoint that does not load: a fault of this host (memory, I/O),
    a damaged file, or a checkpoint written with other model or strategy arguments."""
    reason, fault = describe(error), load_fault(error)
    if fault == "memory":
        return RunStopped(
            f"checkpoint {path} could not be loaded: this host ran out of memory ({reason}); free "
            "memory (fewer processes per node, a host with more) and resume again; the checkpoint "
            "itself may be fine"
        )
    if fault == "io":
        return RunStopped(
            f"checkpoint {path} could not be read: an I/O error on this host ({reason}); check the "
            "filesystem (space, permissions, the mount) and resume again; the checkpoint itself may "
            "be fine"
        )
    if fault == "damaged" or isinstance(error, FileNotFoundError):
        return UsageError(
            f"checkpoint {path} is damaged ({reason}): resume from an earlier one "
            "(--resume_from_checkpoint <output_dir>/checkpoints/step_N) or start afresh with "
            "--overwrite_output_dir"
        )
    return UsageError(
        f"checkpoint {path} does not load into this run ({reason}); it was written with other "
        "model or strategy arguments: resume with the arguments in its run's run.json, pass another "
        "--resume_from_checkpoint, or start afresh with --overwrite_output_dir"
    )


def write_model_files(model, tokenizer, dtype, folder: str) -> None:
    """What a Hugging Face folder holds besides the weights, with the base model's config (and
    generation config) for a peft model, so that the model can be built again from them."""
    os.makedirs(folder, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    save_config(base.config, dtype or base.config.dtype, folder)
    if getattr(base, "generation_config", None) is not None and base.can_generate():
        base.generation_config.save_pretrained(folder)
    if hasattr(model, "peft_config"):
        model.peft_config["default"].save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def save_config(config, dtype, folder: str) -> None:
    """save_pretrained writes the live parameters' dtype; say what the file holds."""
    trained_dtype, config.dtype = config.dtype, dtype
    try:
        config.save_pretrained(folder)
    finally:
        config.dtype = trained_dtype
