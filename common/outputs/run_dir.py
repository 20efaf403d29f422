"""The run's output folder: its layout, starting over an earlier run, and swapping folders into place.

    output_dir/run.json, metrics.jsonl, logs/, profile/
    output_dir/checkpoints/step_N/         complete checkpoints (tmp-step_N while being written)
    output_dir/checkpoints/abandoned_after_step_N/   later checkpoints set aside by a resume from step_N
    output_dir/final/, best/, *_merged/, exported/   Hugging Face folders

Nothing of an earlier run is touched until the new run is known to start (its model prepared,
its checkpoint loaded); until then LAUNCH_STARTING marks that the folder's checkpoints are not
yet the launch's own, so a worker restarted before that does not resume them.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil

from common.launch.errors import UsageError


STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"  # inside step_N: the step, the data position, the layout that wrote it
MODEL_FILES = "model_files"  # inside step_N: config, generation config, tokenizer, adapter config
# Everything a run writes into output_dir: what makes it hold a run, and what --overwrite_output_dir clears
# (with a folder's leftovers of an interrupted swap, name.tmp and name.old). Other files there are the user's.
RUN_FOLDERS = ("checkpoints", "final", "final_merged", "best", "best_merged", "exported", "logs", "profile")
REFERENCE_TABLE = "reference_log_probs.pt"  # DPO's precomputed reference log-probs (common.objectives.reference)
COMPLETIONS = "completions.jsonl"  # GRPO's --log_completions
RUN_FILES = ("run.json", "metrics.jsonl", "mlflow.db", "curves.png", REFERENCE_TABLE, COMPLETIONS)
# Written when a launch starts where checkpoints exist, removed once it has cleared them (--overwrite_output_dir)
# or set aside those past its resume point: till then a restarted worker must not resume 'latest'.
LAUNCH_STARTING = ".launch_starting"
ABANDONED = "abandoned_after_step_"  # checkpoints/abandoned_after_step_N/: later checkpoints a resume set aside


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints, oldest first. A folder is complete once renamed to step_N."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    steps = [(int(m.group(1)), name) for name in os.listdir(root) if (m := STEP_DIR.match(name))]
    return [os.path.join(root, name) for _, name in sorted(steps)]


def earlier_run(output_dir: str) -> list[str]:
    """What an earlier run left in output_dir (RUN_FOLDERS, RUN_FILES and their leftovers), by name."""
    if not os.path.isdir(output_dir):
        return []
    names = set(RUN_FOLDERS) | set(RUN_FILES) | {f"{name}{end}" for name in RUN_FOLDERS for end in (".tmp", ".old")}
    return sorted(name for name in os.listdir(output_dir) if name in names)


def check_output_dir(output_dir: str, resume_from_checkpoint: str | None, overwrite: bool) -> None:
    """Refuse to start a fresh run on top of an earlier one (nothing of the user's is lost)."""
    found = earlier_run(output_dir)
    if resume_from_checkpoint is None and not overwrite and found:
        raise UsageError(
            f"output_dir {output_dir} already holds a run ({', '.join(found)}); pass "
            "--resume_from_checkpoint latest to continue it, --overwrite_output_dir to start afresh, "
            "or another --output_dir"
        )


def mark_launch_starting(output_dir: str) -> None:
    """At a launch's start (not a restart's): where output_dir already holds checkpoints, mark that
    they are not yet this launch's (LAUNCH_STARTING) until `begin` has cleared them
    (--overwrite_output_dir) or set aside those past its resume point; a stale mark goes."""
    marker = os.path.join(output_dir, LAUNCH_STARTING)
    if list_checkpoints(output_dir):
        write_atomically(marker, "a launch is starting here: until it has, these checkpoints are not its own\n")
    elif os.path.exists(marker):
        os.remove(marker)


def launch_starting(output_dir: str) -> bool:
    """Whether the launch that started last here has yet to take over the folder's checkpoints: a
    worker restarted then keeps the first attempt's arguments rather than resume 'latest'."""
    return os.path.exists(os.path.join(output_dir, LAUNCH_STARTING))


def launch_started(output_dir: str) -> None:
    if launch_starting(output_dir):
        os.remove(os.path.join(output_dir, LAUNCH_STARTING))


def resolve_checkpoint(output_dir: str, resume_from_checkpoint: str | None) -> str | None:
    """The checkpoint to resume from: a step_N folder, the latest of the run ('latest'), or None."""
    if resume_from_checkpoint != "latest":
        if resume_from_checkpoint and not os.path.isfile(os.path.join(resume_from_checkpoint, STATE_FILE)):
            raise UsageError(
                f"--resume_from_checkpoint {resume_from_checkpoint} is not a complete checkpoint "
                f"(no {STATE_FILE}); pass a step_N folder or 'latest'"
            )
        return resume_from_checkpoint
    found = list_checkpoints(output_dir)
    return found[-1] if found else None  # 'latest' with none yet starts from scratch


def clear_earlier_run(output_dir: str) -> None:
    """--overwrite_output_dir: everything the earlier run wrote goes (`earlier_run`: checkpoints,
    every export, logs, profile, run.json and metrics), the user's other files stay (main process,
    once the new run is known to start)."""
    for name in earlier_run(output_dir):
        path = os.path.join(output_dir, name)
        if os.path.islink(path) and os.path.isdir(path):  # checkpoints -> /scratch/...: emptied, the link kept
            for entry in os.listdir(path):
                inside = os.path.join(path, entry)
                shutil.rmtree(inside) if os.path.isdir(inside) and not os.path.islink(inside) else os.remove(inside)
        else:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def set_aside_later_checkpoints(output_dir: str, step: int) -> str | None:
    """A run resumed from step_`step` while later checkpoints exist replaces their continuation:
    they move to checkpoints/abandoned_after_step_<step>/ (kept, not deleted), so that neither
    'latest' nor the pruning of --save_total_limit takes them for this run's. Returns that folder,
    or None when there were none. Main process."""
    later = [path for path in list_checkpoints(output_dir) if int(STEP_DIR.match(os.path.basename(path))[1]) > step]
    if not later:
        return None
    aside = os.path.join(checkpoints_dir(output_dir), f"{ABANDONED}{step}")
    suffix = 1
    while os.path.exists(aside if suffix == 1 else f"{aside}_{suffix}"):
        suffix += 1
    aside = aside if suffix == 1 else f"{aside}_{suffix}"
    os.makedirs(aside)
    for path in later:
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    return aside


def write_atomically(path: str, text: str) -> None:
    """Replace the file at `path` with `text` whole: a crash leaves the old file or the new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_folder(target: str, write) -> None:
    """Write into target.tmp, then swap it into place, so a crash leaves the old folder whole."""
    tmp = f"{target}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    swap_into_place(tmp, target)


def swap_into_place(tmp: str, target: str) -> None:
    """Replace `target` with the complete folder `tmp`, atomically: `target` names the old folder
    or the new one at every moment, never neither. Linux's renameat2(RENAME_EXCHANGE) swaps the
    two names in one step, and the old folder (now at `tmp`) is removed afterwards; where that
    call is missing, the old folder is first moved to `target.old` (a crash between the two
    renames leaves it there, and `resolve_checkpoint` never reads it)."""
    if not os.path.exists(target):
        os.replace(tmp, target)
        return
    if not _exchange(tmp, target):
        old = f"{target}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        tmp = old
    shutil.rmtree(tmp)


def _exchange(first: str, second: str) -> bool:
    """Swap two paths in one step (Linux renameat2 with RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rename = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    return rename(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), exchange) == 0
