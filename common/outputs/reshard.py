"""Resuming on another world size: a DeepSpeed ZeRO checkpoint converted into the layout this run needs.

FSDP2 (DCP) checkpoints reshard as they load, and DDP's and one process's state is whole, so
those load as they are. A ZeRO checkpoint is partitioned by the world size that wrote it (and
under ZeRO-3 by its sub-group size): from another one it is converted once into DeepSpeed's
universal format (`ds_to_universal`, into step_N/universal beside the original, which is left
as it is) and the engine is told to load that. The data position is counted in samples
(`common.training.loop.TrainBatches`) and the learning-rate schedule in optimizer steps, so neither
needs converting.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

from common.launch.accelerator import (
    ZERO3_DEFAULT_SUB_GROUP_SIZE,
    ZERO3_SUB_GROUP_SIZE,
    launched_strategy,
    zero3_sub_group_size,
)
from common.launch.errors import NodeStopped, UsageError, describe
from common.launch.peers import reporting_progress
from common.outputs import portable
from common.outputs.run_dir import STATE_FILE, write_atomically


UNIVERSAL = "universal"  # a DeepSpeed checkpoint converted for another world size, inside its step_N
SCHEDULE = "lr_schedule"  # trainer_state.json: how far the saved schedule had stepped


def layout(accelerator) -> dict:
    """What shaped the saved state, for trainer_state.json: the world size, ZeRO-3's sub-group size
    (it shapes the flat optimizer partitions as the world size does), and the schedule's unit."""
    sub_group_size = zero3_sub_group_size(accelerator.state.deepspeed_plugin)
    return {
        "num_processes": accelerator.num_processes,
        SCHEDULE: "per_optimizer_step",
        **({"zero3_sub_group_size": sub_group_size} if sub_group_size is not None else {}),
    }


def is_universal(path: str) -> bool:
    return os.path.basename(os.path.normpath(path)) == UNIVERSAL


def launched_layout() -> dict | None:
    """The ZeRO layout this launch will train in, read before any process group exists: the world
    size, and ZeRO-3's sub-group size as `common.launch.accelerator` will set it. None outside DeepSpeed."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    zero, path = {}, os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and os.path.isfile(path):
        with open(path) as handle:
            zero = json.load(handle).get("zero_optimization", {})
    stage = str(zero.get("stage", os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")))
    sub_group_size = zero.get("sub_group_size", ZERO3_SUB_GROUP_SIZE) if stage == "3" else None
    return {
        "num_processes": int(os.environ.get("WORLD_SIZE", "1")),
        "zero3_sub_group_size": None if sub_group_size is None else int(float(sub_group_size)),
    }


def _saved_layout(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE)) as handle:
        saved = json.load(handle)
    return {
        "num_processes": saved.get("num_processes"),
        "zero3_sub_group_size": saved.get("zero3_sub_group_size", ZERO3_DEFAULT_SUB_GROUP_SIZE),
    }


def _differs(saved: dict, wanted: dict) -> bool:
    return saved["num_processes"] not in (None, wanted["num_processes"]) or wanted["zero3_sub_group_size"] not in (
        None,
        saved["zero3_sub_group_size"],
    )


def _converted(target: str) -> bool:
    return os.path.isfile(os.path.join(target, STATE_FILE))


def convert_before_start(path: str | None, wait_s: float) -> None:
    """Before the process group starts: a checkpoint of another strategy family (rewritten into
    `common.outputs.portable`'s form), or a ZeRO checkpoint written in another layout than this launch's, is
    converted by the first process while the others wait for the converted folder (on the
    filesystem, not in a collective, so no collective timeout cuts a long conversion short). Rank 0
    keeps a status file beside the target (`STATUS`): a beat every BEAT_S seconds while it converts,
    its error line if it fails. A waiting rank ends with that line as soon as it reads it, and with
    one naming the shared filesystem the nodes need when the status has not changed for `wait_s`
    seconds (--ddp_timeout: rank 0 died or hangs, or this node does not see its files). Progress
    is printed every 30 s. `for_this_world_size` then finds the conversion done."""
    conversion = conversion_needed(path, portable.FAMILY[launched_strategy()], launched_layout())
    if conversion is None or _converted(conversion[0]):
        return
    if int(os.environ.get("RANK", "0")) == 0:
        convert(path, conversion)
        return
    waiting = (
        reporting_progress(f"waiting for rank 0 to convert {path}")
        if int(os.environ.get("LOCAL_RANK", "0")) == 0
        else contextlib.nullcontext()
    )  # one line per node
    with waiting:
        _wait_for_conversion(path, conversion[0], wait_s)


def conversion_needed(path: str | None, family: str, zero_layout: dict | None):
    """(target, what, convert) for a run of strategy `family` (common.outputs.portable.FAMILY) and, under
    DeepSpeed, `zero_layout` ({num_processes, zero3_sub_group_size}), which cannot load `path` as it
    is; else None."""
    if path is None or portable.is_portable(path):
        return None
    if portable.needs_rewrite(path, family):
        return (
            os.path.join(path, portable.PORTABLE),
            f"rewriting {path} ({portable.saved_family(path)}) to load "
            f"under {family} (per parameter, by name: common/outputs/portable.py)",
            lambda source, target: portable.rewrite(source, target, convert_to_universal),
        )
    if zero_layout is None or not _differs(_saved_layout(path), zero_layout):
        return None
    return (
        os.path.join(path, UNIVERSAL),
        f"converting {path} for {zero_layout['num_processes']} processes (DeepSpeed's universal format)",
        convert_to_universal,
    )


def convert(path: str, conversion: tuple) -> None:
    """Rank 0's side (and scripts/convert_checkpoint.py's): the conversion made, its status file kept
    beside the target and its progress printed."""
    target, what, converter = conversion
    print(f"{what} into {target}", file=sys.stderr, flush=True)
    with reporting_progress(what), _status_kept(target + STATUS):
        converter(path, target)


STATUS = ".status"  # target + STATUS: rank 0's conversion, {"launch", "beat", "error"}, read by the other ranks
BEAT_S = 5.0


@contextlib.contextmanager
def _status_kept(status_file: str):
    """Rank 0's side: a new launch id and a beat every BEAT_S seconds while the body runs; its error
    (the one line it ends with) if it raises."""
    status = {"launch": uuid.uuid4().hex, "beat": 0, "error": None}
    done = threading.Event()

    def write():  # best effort: a folder rank 0 cannot write fails the conversion itself, with its own error
        try:
            write_atomically(status_file, json.dumps(status))
        except OSError:
            pass

    def beat():
        while True:
            write()
            if done.wait(BEAT_S):
                return
            status["beat"] += 1

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    except BaseException as error:
        done.set()
        thread.join()
        status["error"] = str(error) if isinstance(error, UsageError) else describe(error)
        write()
        raise
    done.set()
    thread.join()
    if os.path.exists(status_file):
        os.remove(status_file)


def _read_status(status_file: str) -> dict | None:
    try:
        with open(status_file) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _wait_for_conversion(path: str, target: str, wait_s: float) -> None:
    """A waiting rank's side: until the target is complete, rank 0 reports an error (from a status
    that changed since this rank began waiting: one already there may be an earlier launch's), or the
    status stands still for `wait_s` seconds."""
    status_file = target + STATUS
    first = seen = _read_status(status_file)
    changed_at = time.monotonic()
    while not _converted(target):
        status = _read_status(status_file)
        if status != seen:
            seen, changed_at = status, time.monotonic()
        still = time.monotonic() - changed_at
        if status and status.get("error") and (status != first or still > wait_s):
            raise NodeStopped(f"rank 0 could not convert {path} for this run: {status['error']}")
        if still > wait_s:
            raise NodeStopped(
                f"waited {wait_s:.0f} s (--ddp_timeout) for rank 0 to convert {path} for this run "
                f"with no sign of it in {status_file}: rank 0 died or hangs, or this node does not see its files. "
                "Every node must reach the checkpoint and output_dir on one shared filesystem; check rank 0's log, "
                "then resume again (or as the checkpoint was written: its config and number of processes)"
            )
        time.sleep(1.0)


def for_this_world_size(accelerator, path: str | None) -> str | None:
    """The checkpoint to load on this run's layout: `path` itself, its portable rewrite for a run under
    another strategy family (common.outputs.portable), or for a ZeRO checkpoint of another world size or sub-group
    size (checkpoints written before the sub-group size was
    recorded had DeepSpeed's default) its universal conversion, which `convert_before_start` has
    made (made here by the main process otherwise). Call before `accelerator.prepare` (the engine
    reads the load_universal flag when built)."""
    plugin = accelerator.state.deepspeed_plugin
    this_run = (
        None
        if plugin is None
        else {"num_processes": accelerator.num_processes, "zero3_sub_group_size": zero3_sub_group_size(plugin)}
    )
    conversion = conversion_needed(path, portable.family(accelerator), this_run)
    if conversion is None:
        return path
    target, _, converter = conversion
    if accelerator.is_main_process and not _converted(target):
        converter(path, target)
    accelerator.wait_for_everyone()
    if not is_universal(target):
        accelerator.print(
            f"{path} holds {portable.FILES.get(portable.saved_family(path), 'other files')}, this run "
            f"reads {portable.FILES[portable.family(accelerator)]}: loading its rewrite {target}"
        )
        return target
    saved = _saved_layout(path)
    plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    same_sub_groups = this_run["zero3_sub_group_size"] in (None, saved["zero3_sub_group_size"])
    accelerator.print(
        f"{path} was saved by {saved['num_processes']} processes"
        + (
            ""
            if same_sub_groups
            else f" with ZeRO-3 sub_group_size {saved['zero3_sub_group_size']} "
            f"(this run: {this_run['zero3_sub_group_size']})"
        )
        + f": loading its universal conversion {target}"
    )
    return target


def convert_to_universal(path: str, target: str) -> None:
    """step_N/pytorch_model (ZeRO shards) -> target/pytorch_model (universal, per parameter),
    with the rest of the checkpoint copied beside it; written to a temporary folder first."""
    tmp = target + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(
        path,
        tmp,
        ignore=lambda folder, names: [
            name
            for name in names
            if folder == path
            and (
                name in ("pytorch_model", "latest", UNIVERSAL)
                or name.startswith((UNIVERSAL + ".", "portable"))
                or name.endswith(".py")
            )
        ],
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            os.path.join(path, "pytorch_model"),
            "--output_folder",
            os.path.join(tmp, "pytorch_model"),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise UsageError(
            f"checkpoint {path} could not be converted for another number of processes "
            f"(deepspeed.checkpoint.ds_to_universal: {last}); resume it on the number of "
            "processes that wrote it (num_processes in its trainer_state.json)"
        )
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
