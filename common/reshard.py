"""Resuming on another world size: a DeepSpeed ZeRO checkpoint converted into the layout this run needs.

FSDP2 (DCP) checkpoints reshard as they load, and DDP's and one process's state is whole, so
those load as they are. A ZeRO checkpoint is partitioned by the world size that wrote it (and
under ZeRO-3 by its sub-group size): from another one it is converted once into DeepSpeed's
universal format (`ds_to_universal`, into step_N/universal beside the original, which is left
as it is) and the engine is told to load that. The data position is counted in samples
(`common.training.TrainBatches`) and the learning-rate schedule in optimizer steps, so neither
needs converting.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from common.accelerator import ZERO3_DEFAULT_SUB_GROUP_SIZE, zero3_sub_group_size
from common.errors import UsageError
from common.run_dir import STATE_FILE

UNIVERSAL = "universal"  # a DeepSpeed checkpoint converted for another world size, inside its step_N
SCHEDULE = "lr_schedule"  # trainer_state.json: how far the saved schedule had stepped


def layout(accelerator) -> dict:
    """What shaped the saved state, for trainer_state.json: the world size, ZeRO-3's sub-group size
    (it shapes the flat optimizer partitions as the world size does), and the schedule's unit."""
    sub_group_size = zero3_sub_group_size(accelerator.state.deepspeed_plugin)
    return {"num_processes": accelerator.num_processes, SCHEDULE: "per_optimizer_step",
            **({"zero3_sub_group_size": sub_group_size} if sub_group_size is not None else {})}


def is_universal(path: str) -> bool:
    return os.path.basename(os.path.normpath(path)) == UNIVERSAL


def for_this_world_size(accelerator, path: str | None) -> str | None:
    """The checkpoint to load on this run's layout: `path` itself, or for a ZeRO checkpoint of
    another world size or sub-group size (checkpoints written before the sub-group size was
    recorded had DeepSpeed's default) its universal conversion, made once by the main process.
    Call before `accelerator.prepare` (the engine reads the load_universal flag when built)."""
    if path is None or accelerator.state.deepspeed_plugin is None:
        return path
    with open(os.path.join(path, STATE_FILE)) as handle:
        saved_state = json.load(handle)
    saved = saved_state.get("num_processes", accelerator.num_processes)
    sub_group_size = zero3_sub_group_size(accelerator.state.deepspeed_plugin)
    saved_sub_group_size = saved_state.get("zero3_sub_group_size", ZERO3_DEFAULT_SUB_GROUP_SIZE)
    same_layout = sub_group_size in (None, saved_sub_group_size)
    if saved == accelerator.num_processes and same_layout:
        return path
    target = os.path.join(path, UNIVERSAL)
    if accelerator.is_main_process and not os.path.isfile(os.path.join(target, STATE_FILE)):
        _convert_to_universal(path, target)
    accelerator.wait_for_everyone()
    accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    accelerator.print(f"{path} was saved by {saved} processes"
                      + ("" if same_layout else f" with ZeRO-3 sub_group_size {saved_sub_group_size} (this run: "
                                                f"{sub_group_size})")
                      + f": loading its universal conversion {target}")
    return target


def _convert_to_universal(path: str, target: str) -> None:
    """step_N/pytorch_model (ZeRO shards) -> target/pytorch_model (universal, per parameter),
    with the rest of the checkpoint copied beside it; written to a temporary folder first."""
    tmp = target + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(path, tmp, ignore=lambda folder, names: [
        name for name in names if folder == path and (name in ("pytorch_model", "latest", UNIVERSAL)
                                                      or name.startswith(UNIVERSAL + ".") or name.endswith(".py"))])
    result = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         os.path.join(path, "pytorch_model"), "--output_folder", os.path.join(tmp, "pytorch_model"),
         "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
        capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise UsageError(f"checkpoint {path} could not be converted for another number of processes "
                         f"(deepspeed.checkpoint.ds_to_universal: {last}); resume it on the number of "
                         "processes that wrote it (num_processes in its trainer_state.json)")
    shutil.rmtree(target, ignore_errors=True)  # only ever an incomplete conversion (no state file)
    os.replace(tmp, target)


def schedule_from_before_per_step(scheduler, state: dict) -> None:
    """Checkpoints written before the schedule stepped once per optimizer step (no SCHEDULE
    key) hold a schedule that accelerate stepped num_processes times per step: put it at the
    step it had reached."""
    saved_processes = state.get("num_processes", 1)
    if SCHEDULE in state or saved_processes == 1:
        return
    schedule = scheduler.scheduler
    schedule.last_epoch = schedule.last_epoch // saved_processes - 1
    schedule.step()  # recomputes the learning rates at that step
