"""The run's output folder: its layout, starting over an earlier run, and swapping folders into place.

    output_dir/run.json, metrics.jsonl, logs/, profile/
    output_dir/checkpoints/step_N/         complete checkpoints (tmp-step_N while being written)
    output_dir/final/, best/, exported/    Hugging Face folders

Nothing of an earlier run is touched until the new run is known to start.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil

from common.errors import UsageError

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"  # inside step_N: the step, the data position, the layout that wrote it
MODEL_FILES = "model_files"  # inside step_N: config, generation config, tokenizer, adapter config


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints, oldest first. A folder is complete once renamed to step_N."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    steps = [(int(m.group(1)), name) for name in os.listdir(root) if (m := STEP_DIR.match(name))]
    return [os.path.join(root, name) for _, name in sorted(steps)]


def check_output_dir(output_dir: str, resume_from_checkpoint: str | None, overwrite: bool) -> None:
    """Refuse to start a fresh run on top of an earlier one (nothing of the user's is lost)."""
    if resume_from_checkpoint is None and not overwrite and (
            list_checkpoints(output_dir) or os.path.exists(os.path.join(output_dir, "final"))):
        raise UsageError(f"output_dir {output_dir} already holds a run; pass --resume_from_checkpoint latest "
                         "to continue it, --overwrite_output_dir to start afresh, or another --output_dir")


def resolve_checkpoint(output_dir: str, resume_from_checkpoint: str | None) -> str | None:
    """The checkpoint to resume from: a step_N folder, the latest of the run ('latest'), or None."""
    if resume_from_checkpoint != "latest":
        if resume_from_checkpoint and not os.path.isfile(os.path.join(resume_from_checkpoint, STATE_FILE)):
            raise UsageError(f"--resume_from_checkpoint {resume_from_checkpoint} is not a complete checkpoint "
                             f"(no {STATE_FILE}); pass a step_N folder or 'latest'")
        return resume_from_checkpoint
    found = list_checkpoints(output_dir)
    return found[-1] if found else None  # 'latest' with none yet starts from scratch


def clear_earlier_run(output_dir: str) -> None:
    """--overwrite_output_dir: the earlier run's checkpoints, exports, logs and metrics go (main
    process, once the new run is known to start)."""
    for name in ("checkpoints", "final", "logs"):
        shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    if os.path.exists(os.path.join(output_dir, "metrics.jsonl")):
        os.remove(os.path.join(output_dir, "metrics.jsonl"))


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
