"""Elastic multi-node runs: a node range (--nnodes MIN:MAX) that shrinks to the nodes left and grows back.

    make causal_lm CONFIG=accelerate_configs/multi_node_ddp.yaml \
        LAUNCH_ARGS="--nnodes 1:2 --machine_rank 0 --main_process_ip 10.0.0.1"      # the same on every node
    python -m common.launch.elastic --nnodes 1:2 --max_restarts 3 --rdzv_backend c10d \
        --config_file accelerate_configs/multi_node_ddp.yaml --main_process_ip 10.0.0.1 recipes/causal_lm.py ...

The launcher (`main`) is `accelerate launch` with torchrun's node range, which accelerate's --num_machines cannot
carry, and the c10d rendezvous on the main node's address; it refuses in one line what cannot change its world (a
static rendezvous, no restarts, a parallelism_config mesh whose sizes are fixed to num_processes). When a node is
lost, the survivors' collectives fail (at once for a dead process, within --ddp_timeout for a cut network), their
agents form a new world with the nodes left, and the workers resume from the latest complete checkpoint
(`common.run.resume_after_restart`). A node that comes back joins at the next rendezvous: the running agents
restart their workers to admit it. On every world the global batch is the one the command asked for on MAX nodes,
the accumulation steps making up for the processes missing (`keep_global_batch`), so the data order
(`common.training.loop.TrainBatches`) and the schedule (optimizer steps) go on as before.

The workers share what the world was through the rendezvous store, which lives as long as the main node's agent (the
launch): whether the run is underway (a node that joins later resumes rather than starts afresh), the last world's
members, accumulation and clock, the last step it trained (rank 0 writes it at each step), and the survivors'
notes of the loss. `WorldWatch` turns them into one line per change of world, a `world_change` row in metrics.jsonl
and run.json's `world_changes`, with the time from the loss to the first step on the new world and its parts.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError

from common.launch.errors import UsageError


ENV = "RECIPES_ELASTIC"  # MIN:MAX:HOST:PORT, set by the launcher for its workers (as accelerate sets ACCELERATE_*)
# The rendezvous' timing, where --rdzv_conf does not set it. torchrun's defaults (a node counted lost after 3 missed
# heartbeats 5 s apart, then 30 s for more nodes once MIN are in) made 16 s of a 29 s shrink seen here: a node is
# counted lost after 5 missed heartbeats 1 s apart, and the rendezvous waits 5 s for more once MIN are in.
RENDEZVOUS = {"keep_alive_interval": 1, "keep_alive_max_attempt": 5, "last_call_timeout": 5}
KEY = "recipes.elastic/"  # the rendezvous store's keys of this module


# ---- the launcher ----------------------------------------------------------------------------------------------
def parse_range(text: str) -> tuple[int, int]:
    """'MIN:MAX' (or 'N') -> (MIN, MAX); bad input is one line."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if not 1 <= low <= high or high < 2:
        raise UsageError(
            f"--nnodes {text}: give the range of nodes the run may train on as MIN:MAX, 1 <= MIN <= MAX and MAX >= 2 "
            "(e.g. --nnodes 1:2); one node restarts its workers with --max_restarts alone"
        )
    return low, high


def split_launch_args(argv: list[str]) -> tuple[tuple[int, int], list[str]]:
    """(the node range, accelerate launch's arguments without --nnodes)."""
    for index, token in enumerate(argv):
        if token == "--nnodes" or token.startswith("--nnodes="):
            value = token.split("=", 1)[1] if "=" in token else (argv[index + 1] if index + 1 < len(argv) else "")
            rest = argv[:index] + argv[index + (1 if "=" in token else 2) :]
            break
    else:
        raise UsageError("python -m common.launch.elastic needs --nnodes MIN:MAX (otherwise use accelerate launch)")
    return parse_range(value), rest


def set_machines(args, nodes: tuple[int, int]) -> None:
    """accelerate launch's parsed arguments (`--num_machines N` and `--num_machines=N` alike): the machines are the
    range's MAX, as torchrun's workers and the config's num_processes count them; another number given is one line."""
    low, high = nodes
    if args.num_machines is not None and args.num_machines != high:
        raise UsageError(
            f"--num_machines {args.num_machines} beside --nnodes {low}:{high}: the range says the nodes (at most "
            f"{high}); drop --num_machines"
        )
    args.num_machines = high


def check_config(config_file: str | None, nodes: tuple[int, int], launch_args=None) -> None:
    """What in the accelerate config cannot change its world, before anything starts: a launcher that is not
    torchrun (one process, use_cpu, DeepSpeed's pdsh), or a mesh (parallelism_config, in the file or given on the
    command line as --parallelism_config_*_size: `launch_args`) whose sizes multiply to num_processes; and
    num_processes (given or the config's), which counts MAX nodes' processes, not a multiple of MAX (accelerate would
    floor the processes per node). The rendezvous and restarts are checked on torchrun's arguments (`_adjust`)."""
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file

    config = load_config_from_file(config_file or default_config_file)
    kind = str(getattr(config, "distributed_type", "NO")).split(".")[-1]
    deepspeed = getattr(config, "deepspeed_config", None) or {}
    if kind not in ("MULTI_GPU", "FSDP", "DEEPSPEED") or getattr(config, "use_cpu", False):
        raise UsageError(
            f"--nnodes {nodes[0]}:{nodes[1]} with {config_file} ({kind}): an elastic run is launched by torchrun, "
            "one process per GPU on each node: start from multi_node_ddp.yaml, multi_node_fsdp.yaml or "
            "multi_node_zero3.yaml"
        )
    if kind == "DEEPSPEED" and deepspeed.get("deepspeed_multinode_launcher", "pdsh") != "standard":
        raise UsageError(
            f"--nnodes {nodes[0]}:{nodes[1]} with {config_file}: DeepSpeed's own multi-node launcher "
            f"({deepspeed.get('deepspeed_multinode_launcher', 'pdsh')}) has no node range; set "
            "deepspeed_multinode_launcher: standard (torchrun on each node), as multi_node_zero3.yaml does"
        )
    mesh = dict(getattr(config, "parallelism_config", None) or {})
    given = {
        k: v
        for k, v in (vars(launch_args) if launch_args is not None else {}).items()
        if k.startswith("parallelism_config_")
    }
    mesh.update({k: v for k, v in given.items() if k.endswith("_size") and v is not None and int(v) > 1})
    sizes = {k: v for k, v in mesh.items() if k.endswith("_size") and int(v) > 1}
    if sizes:
        named = " x ".join(f"{k.removeprefix('parallelism_config_')} {v}" for k, v in sizes.items())
        raise UsageError(
            f"--nnodes {nodes[0]}:{nodes[1]} with {config_file}: its mesh ({named}) is fixed to num_processes, so it "
            "cannot follow a world that loses or gains nodes (tensor-, pipeline-, context-parallel and hybrid-shard "
            "sizes); launch it on a fixed set of nodes, or elastically with multi_node_fsdp.yaml or "
            "multi_node_zero3.yaml, which shard over whatever world forms"
        )
    given_processes = getattr(launch_args, "num_processes", None)
    processes = given_processes or getattr(config, "num_processes", None)
    if processes and processes % nodes[1]:
        where = f"--num_processes {processes}" if given_processes else f"{config_file}'s num_processes {processes}"
        raise UsageError(
            f"{where} with --nnodes {nodes[0]}:{nodes[1]}: it counts the processes of {nodes[1]} nodes, the same "
            f"number on each, so it must be a multiple of {nodes[1]} (e.g. {nodes[1]} x the GPUs of a node)"
        )


def _adjust(nodes: tuple[int, int]):
    """torchrun's namespace as accelerate built it -> the elastic launch (internals.torchrun_adjusted)."""

    def adjust(args) -> None:
        label = f"--nnodes {nodes[0]}:{nodes[1]}"
        if args.rdzv_backend == "static":
            raise UsageError(
                f"{label} needs torchrun's c10d rendezvous, which re-forms the world when nodes leave or join; the "
                "static one (the config's rdzv_backend: static) holds a fixed set: add --rdzv_backend c10d "
                '(make <recipe> LAUNCH_ARGS="--nnodes ..." adds it)'
            )
        if args.max_restarts < 1:
            raise UsageError(
                f"{label} without --max_restarts: a lost node would end the run, since the workers restart to form "
                "the smaller world; add --max_restarts N, one per loss to survive (make adds 3)"
            )
        if not args.rdzv_endpoint:  # accelerate passes the main node's address as master_addr (same_network)
            args.rdzv_endpoint = f"{args.master_addr}:{args.master_port}"
        args.nnodes = f"{nodes[0]}:{nodes[1]}"
        given = args.rdzv_conf or ""
        defaults = [f"{key}={value}" for key, value in RENDEZVOUS.items() if key not in given]
        args.rdzv_conf = ",".join(filter(None, [given, *defaults]))
        host, _, port = args.rdzv_endpoint.rpartition(":")
        os.environ[ENV] = f"{nodes[0]}:{nodes[1]}:{host}:{port or 29400}"
        # each attempt's workers on a store of their own (common.run.resume_after_restart says why)
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

    return adjust


def main(argv: list[str] | None = None) -> None:
    """`accelerate launch` with --nnodes MIN:MAX; bad input is one line and exit status 2, before anything starts."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    from common.launch.internals import torchrun_adjusted

    try:
        nodes, rest = split_launch_args(list(sys.argv[1:] if argv is None else argv))
        args = launch_command_parser().parse_args(rest)
        set_machines(args, nodes)
        check_config(args.config_file, nodes, args)
        with torchrun_adjusted(_adjust(nodes)) as called:
            launch_command(args)
        if not called:
            raise UsageError(f"--nnodes {nodes[0]}:{nodes[1]}: the launch did not go through torchrun")
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RendezvousError as error:  # this node's agent lost the rendezvous: the run cannot go on here
        print(f"error: {rendezvous_lost(error, nodes)}", file=sys.stderr, flush=True)
        sys.exit(1)
    except SignalException as stop:  # Ctrl-C or a kill: the agent has stopped this node's workers
        print(f"error: {stopped(stop.sigval, args.machine_rank)}", file=sys.stderr, flush=True)
        sys.exit(128 + int(stop.sigval))


def stopped(sigval: int, machine_rank: int | None) -> str:
    """The one line for a node whose launcher was stopped by a signal: what the other nodes do without it."""
    main = not machine_rank
    return f"node {machine_rank or 0} stopped by {signal.Signals(sigval).name}: its workers were stopped; " + (
        "it was the main node, whose launcher holds the rendezvous, so the other nodes end too: launch again "
        "with --resume_from_checkpoint latest"
        if main
        else "the other nodes go on without it, and this node's command run again joins them"
    )


def rendezvous_lost(error: Exception, nodes: tuple[int, int]) -> str:
    """The one line for an agent whose rendezvous ended: its store (held by the main node's agent) gone, or fewer
    than MIN nodes within the rendezvous' join_timeout."""
    endpoint = os.environ.get(ENV, "::?:?").split(":", 2)[2]
    if isinstance(error, RendezvousTimeoutError):
        return (
            f"fewer than {nodes[0]} node{'s' * (nodes[0] > 1)} (--nnodes {nodes[0]}:{nodes[1]}) joined the rendezvous at "
            f"{endpoint} within its join_timeout: start the missing nodes (or launch with a smaller MIN), then resume "
            "with --resume_from_checkpoint latest"
        )
    return (
        f"the rendezvous at {endpoint} is gone ({type(error).__name__}): the main node (--main_process_ip), whose "
        "agent holds it, was lost or stopped, and an elastic run goes on only while the main node lives; launch again "
        "on the nodes left, one of them the main node, with --resume_from_checkpoint latest"
    )


# ---- the workers -----------------------------------------------------------------------------------------------
@dataclass
class Elastic:
    """What the launcher told its workers: the node range and the rendezvous store's address."""

    min_nodes: int
    max_nodes: int
    host: str
    port: int

    @property
    def per_node(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    @property
    def world(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    def store(self, timeout_s: float = 60.0):
        """The rendezvous store (the main node's agent holds it for the whole launch)."""
        import torch.distributed

        return torch.distributed.TCPStore(
            self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )


def launched() -> Elastic | None:
    value = os.environ.get(ENV)
    if not value or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    low, high, rest = value.split(":", 2)
    host, _, port = rest.rpartition(":")
    return Elastic(int(low), int(high), host, int(port))


def keep_global_batch(elastic: Elastic, args) -> dict:
    """The global batch the command asks for on MAX nodes (processes x batch x accumulation), kept on every world
    of the range: this world's accumulation set to make it up. A range where some number of nodes cannot make it
    with a whole number of accumulation steps is refused in one line, at the start."""
    per_device, typed = args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_batch = elastic.max_nodes * elastic.per_node * per_device * typed
    short = [nodes for nodes, accumulation in accumulations(elastic, typed).items() if accumulation is None]
    if short:
        per_world = short[0] * elastic.per_node * per_device
        raise UsageError(
            f"--nnodes {elastic.min_nodes}:{elastic.max_nodes} cannot keep the global batch of {global_batch} samples "
            f"({elastic.max_nodes} nodes x {elastic.per_node} processes x {per_device} per device x {typed} "
            f"accumulation) on {short[0]} node{'s' * (short[0] > 1)}: {global_batch} is not a multiple of "
            f"{per_world}; set --gradient_accumulation_steps to a multiple of {whole_on_every_world(elastic)}, the "
            "smallest whose global batch every number of nodes of the range makes whole, or narrow the range"
        )
    args.gradient_accumulation_steps = global_batch // (elastic.world * per_device)
    return {"global_batch": global_batch, "accumulation": args.gradient_accumulation_steps, "asked": typed}


def accumulations(elastic: Elastic, typed: int) -> dict[int, int | None]:
    """Each number of nodes of the range -> the accumulation steps that keep the global batch of MAX nodes with
    `typed` (MAX x typed / nodes: the processes per node and the per-device batch cancel out); None where that is
    no whole number."""
    span = range(elastic.min_nodes, elastic.max_nodes + 1)
    return {n: None if elastic.max_nodes * typed % n else elastic.max_nodes * typed // n for n in span}


def whole_on_every_world(elastic: Elastic) -> int:
    """The smallest --gradient_accumulation_steps whose global batch every number of nodes of the range makes whole:
    each n divides MAX x it, so it is a multiple of n / gcd(n, MAX) for every n (and those multiples all work)."""
    span = range(elastic.min_nodes, elastic.max_nodes + 1)
    return math.lcm(*(n // math.gcd(n, elastic.max_nodes) for n in span))


def check_every_world(elastic: Elastic, typed: int, rule) -> None:
    """A recipe's own rule on a step's accumulation (`rule(accumulation)`: what is wrong, or None; GRPO's whole
    groups), for each number of nodes of the range with the accumulation `keep_global_batch` gives it, at the start
    rather than in the world that meets it. One line naming the first that breaks it, with the smallest
    --gradient_accumulation_steps that keeps every world whole and within the rule (of its first 1000 candidates)."""
    for nodes, accumulation in accumulations(elastic, typed).items():
        problem = rule(accumulation)
        if problem is None:
            continue
        step = whole_on_every_world(elastic)
        fits = next(
            (
                candidate
                for candidate in range(step, 1000 * step + 1, step)
                if all(rule(a) is None for a in accumulations(elastic, candidate).values())
            ),
            None,
        )
        advice = (
            f"set --gradient_accumulation_steps to {fits} (every world of the range keeps it), or narrow the range"
            if fits is not None
            else "no --gradient_accumulation_steps fits every world of the range: change what the rule names, or "
            "narrow the range"
        )
        raise UsageError(
            f"--nnodes {elastic.min_nodes}:{elastic.max_nodes} on {nodes} node{'s' * (nodes > 1)} trains with "
            f"{accumulation} accumulation steps (the global batch of {elastic.max_nodes} nodes kept): {problem}; "
            f"{advice}"
        )


def check_streaming(elastic: Elastic, streaming: bool) -> None:
    """--streaming on a range that can change the number of processes: a stream's checkpoint holds each process's
    place in it and resumes only on as many processes (common.data.streaming.check_resumable), so the first loss would
    spend the restarts on worlds that refuse it. One line at the start instead."""
    if streaming and elastic.min_nodes < elastic.max_nodes:
        raise UsageError(
            f"--streaming with --nnodes {elastic.min_nodes}:{elastic.max_nodes}: a stream's checkpoint resumes only "
            "on the number of processes that wrote it, and a node range changes that number; train on a map-style "
            f"dataset (drop --streaming), or launch on a fixed number of nodes (--nnodes {elastic.max_nodes})"
        )


def underway(elastic: Elastic) -> bool:
    """Whether a world of this launch has started training (its checkpoints are this launch's): a node that joins
    later, whose agent has not restarted, resumes then as the others do."""
    return elastic.store().check([KEY + "underway"])


def note_refused(elastic: Elastic) -> None:
    """Bad input met by a world of this launch (best effort): the later worlds end at once (`refused`)."""
    try:
        elastic.store(timeout_s=5).set(KEY + "refused", "1")
    except Exception:  # noqa: BLE001
        pass


def refused(elastic: Elastic) -> bool:
    return elastic.store().check([KEY + "refused"])


def _ranges(ranks: list[int]) -> str:
    spans, start = [], None
    for index, rank in enumerate(ranks):
        start = rank if start is None else start
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            spans.append(f"{start}" if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(spans)


def after_a_loss(elastic: Elastic) -> str:
    """What a survivor's line says comes next: a new world of the nodes left, or, where this world had MIN nodes
    (so a loss leaves fewer), a wait for a node to come back (its agent ends the launch in one line without one)."""
    nodes = elastic.world // max(elastic.per_node, 1)
    if nodes > elastic.min_nodes:
        return "elastic launch: the nodes left form a new world and resume"
    return (
        f"elastic launch: this world had {nodes} node{'s' * (nodes > 1)}, the least --nnodes "
        f"{elastic.min_nodes}:{elastic.max_nodes} trains on, so it goes on only if a lost node comes back within the "
        "rendezvous' join_timeout"
    )


def note_lost_peer(elastic: Elastic, message: str) -> None:
    """A survivor's side: when and how its collective failed, for the next world's account (best effort)."""
    try:
        note = {"time": time.time(), "rank": int(os.environ.get("RANK", "0")), "message": message}
        elastic.store(timeout_s=5).append(KEY + "lost", json.dumps(note) + "\n")
    except Exception:  # the store's host gone too: the run ends anyway  # noqa: BLE001
        pass


def process_started_at() -> float:
    import psutil

    return psutil.Process().create_time()


class WorldWatch:
    """One worker's account of the world it trains in, against the last one of the launch (rank 0 reports)."""

    def __init__(self, elastic: Elastic, batch: dict, started_at: float):
        self.elastic, self.batch = elastic, batch
        self.times = {"process": process_started_at(), "start_run": started_at}
        self.change: dict | None = None  # this world's change, until its first step is timed
        self.changes: list = []
        self.step_store = None  # rank 0's client, for `stepped`
        self.first_step_at: float | None = None

    def timed(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds

    def begin(self, accelerator, output_dir: str, resumed_step: int, loaded_at: tuple[float, float]) -> None:
        """Every rank, after the checkpoint is loaded and before metrics.jsonl drops the lost steps' rows: compare
        this world with the launch's last one, print the line for a change, and record this world in the store."""
        from accelerate.utils import gather_object

        members = gather_object([[socket.gethostname(), os.getppid()]])  # a node: its host and its agent
        self.resumed_step = resumed_step
        if not accelerator.is_main_process:
            return
        store = self.elastic.store()
        previous = json.loads(store.get(KEY + "world")) if store.check([KEY + "world"]) else None
        # This launch's changes, from the store: every one of them, also where this world starts afresh (a loss
        # before the first checkpoint); and run.json is rewritten whole (common.outputs.run_info.record_run) before
        # `started`
        # adds them back, so a world that fails in between would drop them there. A launch that resumes an earlier
        # one's run (a new store) reads that run's from run.json.
        if store.check([KEY + "changes"]):
            self.changes = json.loads(store.get(KEY + "changes"))
        else:
            earlier = _read_json(os.path.join(output_dir, "run.json")).get("world_changes", [])
            self.changes = earlier if resumed_step else []
        notes = []  # read and cleared at every world: a restart on the same nodes leaves none for a later change
        if store.check([KEY + "lost"]):
            notes = [json.loads(line) for line in store.get(KEY + "lost").decode().splitlines() if line]
            store.delete_key(KEY + "lost")
        if previous is not None and previous["members"] != members:
            lost = [rank for rank, member in enumerate(previous["members"]) if member not in members]
            joined = sum(member not in previous["members"] for member in members)
            last_step, last_at = _last_step(store, previous, os.path.join(output_dir, "metrics.jsonl"))
            detected = min((note["time"] for note in notes), default=None)
            what = (
                f"after rank{'s' * (len(lost) > 1)} {_ranges(lost)} {'were' if len(lost) > 1 else 'was'} lost"
                if lost
                else f"after {joined} process{'es' * (joined > 1)} joined"
            )
            self.change = {
                "from_processes": len(previous["members"]),
                "to_processes": len(members),
                "lost_ranks": lost,
                "joined_processes": joined,
                "at_step": last_step,
                "resumed_from_step": resumed_step,
                "steps_lost": max(last_step - resumed_step, 0),
                "accumulation": [previous["accumulation"], self.batch["accumulation"]],
                "global_batch": self.batch["global_batch"],
                "detected_by": notes[0]["message"] if notes else None,
                "seconds": _parts(self.times, last_at, detected, loaded_at),
            }
            print(
                f"world {len(previous['members'])} -> {len(members)} processes {what} at step {last_step}; resumed "
                f"from step {resumed_step}, accumulation {previous['accumulation']} -> {self.batch['accumulation']}, "
                f"global batch {self.batch['global_batch']} kept ({self.change['steps_lost']} steps since the "
                "checkpoint to train again)",
                file=sys.stderr,
                flush=True,
            )
        self.members = members

    def started(self, metrics, accelerator) -> None:
        """Rank 0, once metrics.jsonl is this world's: its world_change row and run.json's list, and this world
        in the store (its members, accumulation, and its metrics clock: elapsed_s counts from it)."""
        if not accelerator.is_main_process:
            return
        clock = time.time() - (time.perf_counter() - metrics.start_time)
        if self.change is not None:
            metrics.log_event({"step": self.change["resumed_from_step"], "world_change": self.change})
            self.changes = [*self.changes, self.change]
        metrics.record_in_run_json("world_changes", self.changes)
        store = self.elastic.store()
        store.set(KEY + "changes", json.dumps(self.changes))
        world = {
            "members": self.members,
            "accumulation": self.batch["accumulation"],
            "metrics_clock": clock,
            "resumed_from_step": self.resumed_step,
        }
        store.delete_key(KEY + "step")  # the last world's last step, read by `begin`: this world's from here on
        store.set(KEY + "world", json.dumps(world))
        store.set(KEY + "underway", "1")
        self.clock, self.step_store = clock, store

    def stepped(self, step: int) -> None:
        """Rank 0, at each optimizer step (common.outputs.metrics.MetricsLogger.advance): the step and its time in the
        store,
        where the next world reads how far this one got (metrics.jsonl's rows come every --logging_steps only). One
        write to the main node's agent (about 12 us on loopback); best effort, as the store may go with the run."""
        now = time.time()
        if self.first_step_at is None:
            self.first_step_at = now
        if self.step_store is None:
            return
        try:
            self.step_store.set(KEY + "step", json.dumps({"step": step, "time": now}))
        except Exception:  # noqa: BLE001
            self.step_store = None

    def first_step(self, metrics, accelerator, output_dir: str) -> None:
        """Rank 0, at a checkpoint or the end: the time from the loss to the first step on this world (`stepped`),
        into run.json."""
        if self.change is None or not accelerator.is_main_process or self.first_step_at is None:
            return
        seconds = self.change["seconds"]
        first_at = self.first_step_at
        seconds["first_step"] = round(first_at - self.times["loaded"], 3)
        if seconds.get("last_step_at") is not None:
            seconds["loss_to_first_step"] = round(first_at - seconds["last_step_at"], 3)
        self.changes[-1] = self.change
        metrics.record_in_run_json("world_changes", self.changes)
        self.elastic.store().set(KEY + "changes", json.dumps(self.changes))
        print(
            "world change: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items() if isinstance(v, float) and k != "last_step_at"),
            file=sys.stderr,
            flush=True,
        )
        self.change = None


def _parts(times: dict, last_at: float | None, detected: float | None, loaded_at: tuple[float, float]) -> dict:
    """The time from the last step of the old world to the loaded checkpoint, in parts (seconds): detection (the
    last step logged to a survivor's failed collective), restart and rendezvous (to this process's start: the agents
    noticed, stopped their workers, formed the new world and started these), start-up (imports), set-up (process
    group, data, model, prepare), conversion (a checkpoint rewritten for this world), load."""
    times["loaded"] = loaded_at[1]
    conversion = times.get("conversion", 0.0)
    parts = {
        "last_step_at": last_at,
        "detection": None if detected is None or last_at is None else detected - last_at,
        "restart_and_rendezvous": times["process"] - (detected or last_at) if (detected or last_at) else None,
        "start_up": times["start_run"] - times["process"],
        "set_up": loaded_at[0] - times["start_run"] - conversion,
        "conversion": conversion,
        "load": loaded_at[1] - loaded_at[0],
    }
    return {k: (round(v, 3) if isinstance(v, float) and k != "last_step_at" else v) for k, v in parts.items()}


def _read_json(path: str) -> dict:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def _train_rows(path: str):
    try:
        with open(path) as handle:
            lines = handle.readlines()
    except OSError:
        return
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row and "elapsed_s" in row:
            yield row


def _last_step(store, previous: dict, metrics_path: str) -> tuple[int, float | None]:
    """The last optimizer step the previous world completed, and when (time.time()): what its rank 0 wrote at each
    step (`WorldWatch.stepped`); without it, its last train row in metrics.jsonl, logged every --logging_steps
    (the rows up to its resume point are an earlier world's, their elapsed_s on another clock: left out); without
    one, its resume point, untimed."""
    if store.check([KEY + "step"]):
        last = json.loads(store.get(KEY + "step"))
        return last["step"], last["time"]
    resumed = previous.get("resumed_from_step", 0)
    rows = [row for row in _train_rows(metrics_path) if row["step"] > resumed]
    if rows:
        return rows[-1]["step"], previous["metrics_clock"] + rows[-1]["elapsed_s"]
    return resumed, None


if __name__ == "__main__":
    main()
