"""The errors a run ends with, and the exit policy: one line, `error: ...`, and a non-zero status.

`UsageError` (bad input: exit 2) and `RunStopped` (the run cannot go on: exit 1) carry a
message that says what is wrong and what to do. A collective that fails because a peer was
lost becomes one line on every node (`common.launch.peers.lost_peer_message`). Anything else keeps
its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import pickle
import re
import sys
import time
import zipfile

from common.launch.internals import close_progress_bars
from common.launch.peers import lost_peer_message, peer_exited


class UsageError(ValueError):
    """Bad input from the user: the message says what is wrong and what to do."""


class RunStopped(RuntimeError):
    """The run cannot go on (non-finite weights, a lost peer): the message says why and what to do."""


class NodeStopped(RunStopped):
    """A RunStopped that every node meets alone (waiting on rank 0's files): each node reports it at once."""


def describe(error: BaseException) -> str:
    """A library's exception in one line, for a UsageError: its type and the line that says why
    (transformers' validation errors put it on a later line, "ValueError: The hidden size ...")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next(
        (line for line in lines if line.startswith(("ValueError:", "TypeError:"))), lines[0] if lines else ""
    )
    return f"{type(error).__name__}: {reason}"[:300]


def downloads_off(*variables: str) -> str:
    """For an error about something that did not load from the Hub: where downloads are off
    (`variables` such as HF_HUB_OFFLINE, which make sets for its demos and tests), a clause
    saying so and how to turn them on; else ''."""
    names = [name for name in variables if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")]
    if not names:
        return ""
    return (
        f"; {' and '.join(names)} {'is' if len(names) == 1 else 'are'} set here, so only what the Hub cache "
        f"already holds loads: set {'=0 '.join(names)}=0 to download"
    )


# errno values that mean the host's storage failed, not the file read
HOST_IO_ERRNOS = (
    errno.EIO,
    errno.ENOSPC,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ESTALE,
    errno.ETIMEDOUT,
    errno.ENOMEM,
    errno.EDQUOT,
)
# what the libraries say of a file cut short or corrupt: safetensors' header, a torch zip, a pickle, JSON
DAMAGE_SAID = re.compile(
    r"deserializ|header|unexpected end|truncat|corrupt|invalid load key|PytorchStreamReader|"
    r"zip archive|Expecting value|Unterminated|EOF",
    re.IGNORECASE,
)


def load_fault(error: BaseException) -> str | None:
    """Why a file (weights, a checkpoint, a tokenizer) did not load, as far as the library's error
    says: "memory" (this host ran out), "io" (this host's storage failed), "damaged" (the file is cut
    short or corrupt), or None (anything else: a mismatch, a missing name)."""
    if isinstance(error, MemoryError) or "out of memory" in str(error).lower():
        return "memory"
    if isinstance(error, OSError) and error.errno in HOST_IO_ERRNOS:
        return "io"
    if isinstance(error, (EOFError, pickle.UnpicklingError, zipfile.BadZipFile)) or DAMAGE_SAID.search(
        f"{type(error).__name__}: {error}"
    ):
        return "damaged"
    return None


# How long another rank waits before it reports: an error every rank meets is reported by rank 0,
# and torchrun ends the other ranks as soon as rank 0 exits.
REPORT_AFTER_S = 10.0
# How long a rank whose peer closed the connection waits before it reports the lost peer: when the
# peer exited on this node (after its own error line), torchrun ends this rank within that time.
PEER_EXIT_GRACE_S = 5.0


def exit_with_error(error: Exception | str, status: int = 2, every_node: bool = False):
    """Print `error: ...` once and exit. Rank 0 (with `every_node`, local rank 0 of each node)
    prints at once; another rank prints `error: rank N: ...` only if it is still running
    REPORT_AFTER_S later, that is when rank 0 did not meet the same error (it may be waiting in
    a collective for this rank, which torchrun ends once this one exits)."""
    reporter = int(os.environ.get("LOCAL_RANK" if every_node else "RANK", "0")) == 0
    if not reporter:
        time.sleep(REPORT_AFTER_S)
    close_progress_bars()  # so the error starts its own line
    where = "" if reporter else f"rank {os.environ.get('RANK', '?')}: "
    print(f"error: {where}{error}", file=sys.stderr, flush=True)
    exit_now(status)


def exit_now(status: int) -> None:
    """End the process with `status` once its output is flushed; a torchrun worker skips the
    interpreter's teardown.
    Seen (torch 2.13, gloo, 2 processes; twice in one run of this suite, under ddp and fsdp): a
    rank aborting after its work was done and its process group destroyed ("terminate called
    without an active exception", SIGABRT), so a finished run exited 1: a C++ thread still
    joinable when the interpreter tore it down. Nothing is left to run by then (trackers and
    progress bars closed, files written): only output and logging are flushed."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker torchrun started (one process runs no such threads)
        os._exit(status)
    sys.exit(status)


@contextlib.contextmanager
def one_line_errors(ddp_timeout: float | None = None):
    """Bad input found anywhere in the run (a missing column, an output_dir holding a run, ...)
    ends it with one line and exit status 2; a run that cannot go on (`RunStopped`, a lost peer
    within `ddp_timeout` seconds) with one line and exit status 1."""
    try:
        yield
    except UsageError as error:
        exit_with_error(error)
    except RunStopped as error:
        exit_with_error(error, status=1, every_node=isinstance(error, NodeStopped))
    except RuntimeError as error:
        message = lost_peer_message(error, ddp_timeout)
        if message is None:
            raise
        if peer_exited(error):  # it may have ended with its own error line: torchrun then ends this rank first
            time.sleep(PEER_EXIT_GRACE_S)
        exit_with_error(message, status=1, every_node=True)


def exits_on_usage_error(main):
    """Decorate a script's main(): its errors end it as `one_line_errors` says."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        with one_line_errors():
            return main(*args, **kwargs)

    return wrapper
