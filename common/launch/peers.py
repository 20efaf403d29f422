"""A lost peer ends the run loudly, and long work on the main process alone is seen not to be hung.

Every collective waits at most `--ddp_timeout` seconds (`common.launch.accelerator`). When a rank
dies, hangs or becomes unreachable, the others fail inside a collective with a backend error
(gloo: "Timed out waiting ... for recv", "Connection closed by peer [10.77.1.2]:..."). This
turns that error into one line, printed on every node (the survivors may not include rank 0).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import time


LOST_PEER = re.compile(
    r"timed out|timeout|connection (closed|reset|refused)|broken pipe|no route to host|"
    r"network is unreachable|connection abort",
    re.IGNORECASE,
)
ADDRESS = re.compile(r"\[([0-9a-fA-F:.]+)\]:(\d+)")
# A communication backend's own error: gloo raises a plain RuntimeError, with its source location
# ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer") or without it (DDP's backward: "Application
# timeout caused pair closure"); NCCL and the rendezvous store raise torch.distributed's DistError types.
# Another error that mentions a timeout (a CUDA launch timeout) is not one.
BACKEND = re.compile(
    r"/gloo/|ProcessGroup(Gloo|NCCL|MPI|UCC)|\bNCCL\b|\bc10d\b|timeout caused pair closure|"
    r"Timed out waiting \d+ms for (recv|send)|Connection (closed|reset) by peer|(Read|Write) error \["
)


def free_port() -> int:
    """A TCP port free on this host now, for a launch's rendezvous (--main_process_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lost_peer_message(error: BaseException, timeout: float | None) -> str | None:
    """The one line for a collective that failed because a peer was lost; None for other errors.
    `timeout`: the seconds every collective waits (--ddp_timeout), for the line to say."""
    text = str(error)
    if not (from_the_backend(error) and LOST_PEER.search(text)):
        return None
    reason = next((line.strip() for line in text.splitlines() if LOST_PEER.search(line)), text.splitlines()[0])
    reason = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", reason)  # drop the backend's source location
    reason = re.sub(r"\s*\bGLHF!?", "", reason).strip()  # gloo's sign-off on a closed pair, not a reason
    # gloo's advice after the reason ("This is typically caused by ...", an emoji): the line gives its own
    reason = re.split(r"\.?\s+This is typically caused by", reason)[0].strip()
    if len(reason) > 200:  # the backend's first line can run on: cut at a word, and say so
        reason = reason[:200].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    addresses = sorted({address for address, _ in ADDRESS.findall(text)})
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    others = [r for r in range(world) if r != rank]
    where = (
        (f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others[0]}-{others[-1]}")
        + (f" at {', '.join(addresses)}" if addresses else "")
        + f" ({store_holder()} is {os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')})"
    )
    return (
        f"lost contact with {where} during a collective on rank {rank} "
        f"(host {os.uname().nodename}): {reason}. A process or node died, hangs or cannot be reached: check "
        "every node's processes and logs, that the nodes reach each other on the interface in use "
        f"(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), then resume with --resume_from_checkpoint latest "
        f"(collectives wait --ddp_timeout {'?' if timeout is None else f'{timeout:g}'} s)"
    )


def store_holder() -> str:
    """What MASTER_ADDR:MASTER_PORT is: under common.launch.elastic's agents the workers' store, which the agent of
    the node the rendezvous made first hosts, not necessarily the main node; under accelerate launch the main
    node's."""
    # common.launch.elastic.ENV, which its launcher sets for its workers (elastic imports this module's importers)
    return "the workers' store" if os.environ.get("RECIPES_ELASTIC") else "the main node"


def from_the_backend(error: BaseException) -> bool:
    """Whether `error` was raised by a collective's communication backend (gloo, NCCL, the store)."""
    import torch.distributed

    return isinstance(error, getattr(torch.distributed, "DistError", ())) or (
        isinstance(error, RuntimeError) and bool(BACKEND.search(str(error)))
    )


def peer_exited(error: BaseException) -> bool:
    """The collective failed because a peer closed its connection (it exited or was killed), not
    because it stopped answering."""
    return bool(re.search(r"connection (closed|reset)|broken pipe", str(error), re.IGNORECASE))


def collective_timeout(accelerator) -> float:
    """Seconds a collective waits for the other ranks: the timeout the accelerator's process group
    was given (--ddp_timeout, `common.launch.accelerator`), else torch's default."""
    from torch.distributed.constants import default_pg_timeout

    handler = getattr(accelerator, "init_handler", None)
    return (handler.timeout if handler is not None else default_pg_timeout).total_seconds()


@contextlib.contextmanager
def main_process_alone(accelerator, what: str, every: float = 30.0):
    """Work the main process does while the other ranks wait for it in a collective (tokenizing a
    corpus, exporting or merging a large model). Past `every` seconds it prints how long it has
    been at it and how long the others will wait (--ddp_timeout), so a waiting cluster is seen
    not to be hung, and warns once half of that wait is spent."""
    if not accelerator.is_main_process:
        yield
        return
    timeout = collective_timeout(accelerator)

    def line(elapsed: float) -> str:
        warning = " - over half of it: if this runs longer, raise --ddp_timeout" if elapsed > timeout / 2 else ""
        return (
            f"{what}: {elapsed:.0f} s so far on the main process; the other ranks wait for it up to "
            f"--ddp_timeout {timeout:.0f} s{warning}"
        )

    with reporting_progress(what, line, every):
        yield


@contextlib.contextmanager
def reporting_progress(what: str, line=None, every: float = 30.0):
    """Long work, seen not to be hung: past every `every` seconds one line (`line(elapsed)`, by
    default how long it has taken so far), and a closing line if any was printed."""
    line = line or (lambda elapsed: f"{what}: {elapsed:.0f} s so far")
    start, done, said = time.time(), threading.Event(), []

    def report():
        while not done.wait(every):
            print(line(time.time() - start), file=sys.stderr, flush=True)
            said.append(1)

    thread = threading.Thread(target=report, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if said:
            print(f"{what}: done in {time.time() - start:.0f} s", file=sys.stderr, flush=True)
