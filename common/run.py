"""A run from start to finish: everything around a recipe's training loop, held by one `Run`.

    run_recipe(main, ModelArguments, DataArguments, TrainingArguments)   # parse, then main(...)
    run = start_run(model_args, data_args, args)      # before any data or model: refuse, build, seed
    ...data, model, optimizer, scheduler, accelerator.prepare(...)...
    state = run.begin(model, optimizer, scheduler, tokenizer, max_steps)   # resume, run.json, metrics
    ...the training loop: run.metrics, run.nonfinite, run.profiler, run.save_checkpoint(step, ...)...
    final_dir = run.finish()                           # the export, trackers closed

An earlier run in output_dir is left as it was until the new one is known to start (its
checkpoint loaded): `begin` clears it then, under --overwrite_output_dir.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time

from accelerate.utils import set_seed

from common.data.streaming import check_resumable
from common.launch import elastic, mesh
from common.launch.accelerator import (
    build_accelerator,
    launched_mesh_size,
    launched_strategy,
    refuse_more_processes_than_gpus,
    refuse_unsupported_mesh,
    unwrap,
)
from common.launch.errors import UsageError, exit_now, exit_with_error, one_line_errors
from common.launch.internals import share_zero3_fp32_partitions
from common.launch.peers import lost_peer_message
from common.launch.versions import outside_checked_range
from common.models.loading import check_block_size, export_dtype, model_hidden_size
from common.models.lora import LoraArguments, check_adapter_arguments
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.options.parsing import parse_args, to_dict
from common.outputs.checkpoints import load_checkpoint, save_checkpoint
from common.outputs.export import export_final
from common.outputs.metrics import MetricsLogger, start_trackers
from common.outputs.portable import optimizer_parameter_names
from common.outputs.reshard import convert_before_start, for_this_world_size
from common.outputs.run_dir import (
    STATE_FILE,
    check_output_dir,
    clear_earlier_run,
    launch_started,
    launch_starting,
    list_checkpoints,
    mark_launch_starting,
    resolve_checkpoint,
    set_aside_later_checkpoints,
)
from common.outputs.run_info import data_sources, record_run, tracker_config
from common.parallel import expert_parallel, pipeline, sequence_parallel, tensor_parallel
from common.training import experts, memory
from common.training.loop import check_global_batch, global_batch_problem
from common.training.nonfinite import NonFiniteGuard, nonfinite_check
from common.training.profiling import StepProfiler
from common.training.speed import refuse_fp8_where_it_cannot_run, speed_record
from common.training.time_budget import TimeBudget


def run_recipe(main, *argument_types, argv: list[str] | None = None):
    """Parse the command line (and --config YAML) into `argument_types`, call main with them, and
    end the process: status 0 once main returns, one line and a non-zero status on an error
    (`common.launch.errors.one_line_errors`)."""
    parsed = parse_args(argument_types, argv)
    training = next(p for p in parsed if isinstance(p, TrainingArguments))
    if argv is None:  # a process of its own (not a recipe's main() called in another program)
        # The libraries' millions of import-time objects live as long as the process: out of the garbage
        # collector's full passes, each of which would walk them all (at a one-process run's exit: 1.1 s of 1.2).
        gc.freeze()
    with one_line_errors(training.ddp_timeout), no_mark_left_if_refused(training.output_dir):
        with elastic_worlds(training.ddp_timeout):
            main(*parsed)
    exit_now(0)  # finished: exit 0 without the interpreter's teardown (common.launch.errors.exit_now says why)


@contextlib.contextmanager
def no_mark_left_if_refused(output_dir: str):
    """A launch refused at its start (bad input, a UsageError, before `begin` took over the folder)
    leaves output_dir as it was: the LAUNCH_STARTING mark its start wrote goes with it. Where torchrun
    may restart the worker (--max_restarts), the mark stays for the restart to read
    (`resume_after_restart`): it starts as the first attempt did, and is refused again."""
    marked_before = launch_starting(output_dir)
    try:
        yield
    except UsageError:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        if not marked_before and not restarts and _is_rank0():
            launch_started(output_dir)  # removes the mark (`begin` removed it already once it took over)
        raise


@contextlib.contextmanager
def elastic_worlds(ddp_timeout: float):
    """Under an elastic launch (common.launch.elastic), a lost peer ends this world at once, in one line, with the time
    noted for the next world's account: the agents then form the next world with the nodes left. (Elsewhere
    `one_line_errors` ends the run, after a grace for the peer's own line.) Bad input (a UsageError, met again by
    every world: a checkpoint that does not convert, a range no accumulation fits) is noted too: its line is
    printed once, and the workers of the worlds after it end at once, spending the restarts without repeating it."""
    launch = elastic.launched()
    if launch is not None and elastic.refused(launch):
        exit_now(2)  # the world that met it printed the line
    try:
        yield
    except UsageError:
        if launch is not None:
            elastic.note_refused(launch)
        raise
    except RuntimeError as error:
        message = lost_peer_message(error, ddp_timeout) if launch is not None else None
        if message is None:
            raise
        message = message.split(". A process or node died")[0]
        elastic.note_lost_peer(launch, message)
        exit_with_error(f"{message}; {elastic.after_a_loss(launch)}", 1, every_node=True)


def check_resume_position(accelerator, args, state: dict) -> None:
    """A checkpoint's data position against this run, before `begin` writes anything: another global
    batch (processes x batch x accumulation) would start elsewhere in the data and with other steps per
    epoch (common.training.loop.TrainBatches, which checks it again); a stream resumes on as many processes."""
    position = state.get("data") or {}
    check_global_batch(
        accelerator, position.get("global_batch"), args.per_device_train_batch_size, args.gradient_accumulation_steps
    )
    if "ranks" in position:  # a stream's state, one per process
        check_resumable(position, accelerator)


class Run:
    """The accelerator, the run's folder and resume point, and (after `begin`) the pieces the
    loop calls: `metrics`, `nonfinite`, `profiler`."""

    def __init__(self, arguments: tuple, accelerator, launch, checkpoint: str | None, clear_earlier: bool, world=None):
        self.arguments = arguments
        self.args = next(a for a in arguments if isinstance(a, TrainingArguments))
        model_args = next(a for a in arguments if isinstance(a, ModelArguments))
        lora = next((a for a in arguments if isinstance(a, LoraArguments)), None)
        self.merge_adapter = bool(lora and lora.use_peft and lora.save_merged_model)
        self.accelerator, self.launch, self.checkpoint = accelerator, launch, checkpoint
        self.clear_earlier = clear_earlier
        self.export_dtype = export_dtype(model_args)  # read once (a Hub model's config is a request)
        self.model = self.optimizer = self.scheduler = self.tokenizer = self.max_steps = None
        self.metrics = self.nonfinite = self.profiler = None
        self.experts = None  # common.training.experts.ExpertWatch, for a MoE with its router loss on
        self.optimizer_parameters = None
        self.world = world  # an elastic launch's common.launch.elastic.WorldWatch
        self.budget = TimeBudget(accelerator, self.args.max_train_seconds)  # the loop's clock (--max_train_seconds)

    def begin(self, model, optimizer, scheduler, tokenizer, max_steps: int, **record) -> dict:
        """After `accelerator.prepare`: load the checkpoint to resume from (if any), write run.json
        (with `record`'s extra fields), start the trackers, metrics, non-finite guard and profiler.
        Returns the saved trainer state ({"step": 0} for a fresh run)."""
        accelerator, args = self.accelerator, self.args
        self.model, self.optimizer, self.scheduler, self.tokenizer = model, optimizer, scheduler, tokenizer
        self.max_steps = max_steps
        share_zero3_fp32_partitions(optimizer)  # ZeRO-3 in fp32: no second fp32 copy (common.launch.internals)
        # the checks first: a resume refused here leaves output_dir exactly as it was
        loading = time.time()
        state = load_checkpoint(accelerator, self.checkpoint, model, optimizer, scheduler)
        check_resume_position(accelerator, args, state)
        if self.world is not None:  # before metrics.jsonl drops the rows of the steps lost
            self.world.begin(accelerator, args.output_dir, state["step"], (loading, time.time()))
        # a checkpoint names the optimizer's parameters, so another strategy can read it (common.outputs.portable)
        self.optimizer_parameters = optimizer_parameter_names(unwrap(accelerator, model), optimizer)
        if self.clear_earlier and accelerator.is_main_process:
            clear_earlier_run(args.output_dir)
        if self.checkpoint is not None and accelerator.is_main_process:
            aside = set_aside_later_checkpoints(args.output_dir, state["step"])
            if aside is not None:
                print(
                    f"resuming from step {state['step']}: the run's later checkpoints (the continuation this run "
                    f"replaces) were moved to {aside}; delete them once they are not needed",
                    file=sys.stderr,
                )
        if accelerator.is_main_process:
            launch_started(args.output_dir)  # the folder's checkpoints are this launch's from here on
        accelerator.wait_for_everyone()
        moe = experts.describe(unwrap(accelerator, model))
        written = record_run(
            accelerator,
            self.launch,
            model,
            optimizer,
            to_dict(*self.arguments),
            args.output_dir,
            max_steps=max_steps,
            **record,
            **pipeline.count_parameters(accelerator, model),  # pp.yaml: the whole model's
            **data_sources(self.arguments),
            nonfinite_check=nonfinite_check(accelerator, optimizer, scheduler),
            speed=speed_record(unwrap(accelerator, model), args),
            **({"experts": moe | expert_parallel.describe(unwrap(accelerator, model))} if moe else {}),
        )
        start_trackers(accelerator, args, tracker_config(written["args"]))
        self.metrics = MetricsLogger(
            accelerator,
            args.output_dir,
            max_steps,
            start_step=state["step"],
            model=model,
            optimizer=optimizer,
            peak_tflops=args.peak_tflops,
            on_step=self.world.stepped if self.world is not None else None,
        )
        self.experts = experts.watch(unwrap(accelerator, model))  # a MoE's aux loss and experts' load, each line
        if self.experts is not None:
            self.metrics.add_source(self.experts.figures)
        if (sent := expert_parallel.traffic(unwrap(accelerator, model))) is not None:  # ep.yaml: its all-to-alls
            self.metrics.add_source(sent.figures)
        if self.world is not None:
            self.world.started(self.metrics, accelerator)
        self.nonfinite = NonFiniteGuard(
            accelerator,
            model,
            args.nonfinite,
            args.max_nonfinite_skips,
            self.metrics,
            optimizer,
            scheduler,
            read_every=args.logging_steps,
            skipped=state.get("nonfinite_skips", 0),  # --max_nonfinite_skips bounds the run's, resumes included
        )
        self.profiler = StepProfiler(
            accelerator, args.profile_steps, args.output_dir, args.profile_memory, start_step=state["step"]
        )
        return state

    def router_loss(self):
        """A MoE's weighted router loss from the micro-batch's forwards, for a loss built from the logits (DPO's,
        GRPO's): add it to the loss as the model adds it to its own (common.training.experts). 0.0 for a dense
        model, or a MoE whose router loss is off."""
        return 0.0 if self.experts is None else self.experts.pending_loss()

    def check_accumulation(self, rule) -> None:
        """A recipe's own rule on a step's accumulation steps (`rule(accumulation)`: what is wrong in one line, or
        None; GRPO's whole groups per process), for every world this launch may train on: this one, and under a node
        range (common.launch.elastic) each number of nodes of it, with the accumulation that keeps the global batch
        there."""
        if self.world is not None:
            elastic.check_every_world(self.world.elastic, self.world.batch["asked"], rule)
        problem = rule(self.args.gradient_accumulation_steps)
        if problem is not None:
            raise UsageError(problem)

    def save_checkpoint(self, step: int, state: dict) -> str:
        """Every rank calls it: checkpoints/step_N with `state` (the data position, ...) beside
        accelerate's; the oldest pruned past --save_total_limit."""
        self.nonfinite.settle()  # a step skipped on the device is acted on before anything is written
        state = {**state, "nonfinite_skips": self.nonfinite.skipped}  # a resume counts on from them
        if self.world is not None:
            self.world.first_step(self.metrics, self.accelerator, self.args.output_dir)
        if self.optimizer_parameters is not None:
            state = {**state, "optimizer_parameters": self.optimizer_parameters}
        return save_checkpoint(
            self.accelerator,
            self.model,
            self.optimizer,
            self.scheduler,
            self.args.output_dir,
            step,
            state,
            self.args.save_total_limit,
            self.tokenizer,
            self.export_dtype,
        )

    def export(self, name: str = "final", cost: dict | None = None) -> str:
        """Every rank calls it: output_dir/<name> as a Hugging Face folder in the export dtype (with
        --use_peft the adapter, and with --save_merged_model the merged model in <name>_merged)."""
        return export_final(
            self.accelerator,
            self.model,
            self.tokenizer,
            self.args.output_dir,
            self.export_dtype,
            name=name,
            merge_adapter=self.merge_adapter,
            cost=cost,
        )

    def finish(self) -> str:
        """After the loop: the profiler stopped, final/ exported (its gather's time and host memory
        go to run.json's "final_export"), each rank's peak memory over the whole run recorded
        ("peak_memory_whole_run"), trackers and progress bar closed."""
        self.profiler.stop()
        self.nonfinite.settle()
        if self.world is not None:
            self.world.first_step(self.metrics, self.accelerator, self.args.output_dir)
        timing = self.budget.record()
        self.metrics.record_in_run_json("training_time", timing)  # before the export: its model card reads it
        cost = {}
        final_dir = self.export(cost=cost)
        self.metrics.record_in_run_json("final_export", cost)
        if self.budget.stopped:
            self.accelerator.print(
                f"--max_train_seconds {self.args.max_train_seconds:g}: stopped after step {self.budget.stopped_at} "
                f"of {self.max_steps}, {timing['train_seconds']:.1f} s after the first step began"
            )
        self.metrics.record_whole_run_peak()
        self.metrics.close()
        return final_dir


def start_run(*arguments) -> Run:
    """`arguments`: the recipe's parsed dataclasses. Refuse to clobber an earlier run (before any
    process group starts), build the accelerator, seed everything, and find the checkpoint to
    resume from (a DeepSpeed one saved on another layout is converted). Under `accelerate launch
    --max_restarts N`, a restarted worker resumes from the run's latest complete checkpoint."""
    started = time.time()
    args = next(a for a in arguments if isinstance(a, TrainingArguments))
    model_args = next((a for a in arguments if isinstance(a, ModelArguments)), None)
    data_args = next((a for a in arguments if isinstance(a, DataArguments)), None)
    if model_args is not None:  # an adapter to start from: trains on with --use_peft, else one line
        check_adapter_arguments(model_args, next((a for a in arguments if isinstance(a, LoraArguments)), None))
    launch_range = elastic.launched()
    world = None
    if launch_range is not None:  # --nnodes MIN:MAX: this world's accumulation keeps the global batch
        elastic.check_streaming(launch_range, bool(data_args and data_args.streaming))
        world = elastic.WorldWatch(launch_range, elastic.keep_global_batch(launch_range, args), started)
    underway = launch_range is not None and elastic.underway(launch_range)  # a node joining a run under way
    resume_after_restart(args, underway)
    check_output_dir(args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir)
    refuse_unsupported_mesh()
    refuse_more_processes_than_gpus()
    refuse_fp8_where_it_cannot_run(launched_strategy(), launched_mesh_size("tp"))
    if launched_mesh_size("tp") > 1:  # tp.yaml, fsdp_tp.yaml
        tensor_parallel.check_arguments(arguments)
    expert_parallel.check_arguments(arguments)  # ep.yaml
    if launched_mesh_size("sp") > 1 or launched_mesh_size("cp") > 1:  # zero3_ulysses.yaml, fsdp_cp.yaml
        sequence_parallel.check_arguments(arguments)
    if launched_mesh_size("pp") > 1:  # pp.yaml
        pipeline.check_arguments(arguments)
    if _is_rank0() and not int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) and not underway:
        mark_launch_starting(args.output_dir)
    checkpoint = resolve_checkpoint(args.output_dir, args.resume_from_checkpoint)
    check_saved_global_batch(checkpoint, args)  # before a conversion, a load or a line saying it resumes
    converting = time.time()
    convert_before_start(checkpoint, args.ddp_timeout)  # a ZeRO checkpoint of another layout, before any collective
    converted = time.time() - converting
    sized = (
        model_args is not None and launched_strategy() == "deepspeed"
    )  # ZeRO-3's bounds: the config read there only
    accelerator, launch = build_accelerator(
        args, model_hidden_size(model_args) if sized else None, {"pp": pipeline.PipelineAccelerator}
    )
    memory.mark("started")
    warnings = outside_checked_range() + (
        [check_block_size(model_args, data_args.block_size)] if data_args and model_args else []
    )
    if accelerator.is_main_process:
        for line in filter(None, warnings):
            print(f"warning: {line}", file=sys.stderr)
    set_seed(args.seed)
    clear_earlier = checkpoint is None and args.overwrite_output_dir
    converting = time.time()
    checkpoint = for_this_world_size(accelerator, checkpoint)
    if world is not None:
        world.timed("conversion", converted + time.time() - converting)
    run = Run(arguments, accelerator, launch, checkpoint, clear_earlier, world)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker, which ends in os._exit (errors.exit_now)
        _HELD_UNTIL_EXIT.append(run)
    return run


# A torchrun worker's Run (its accelerator, and through it the models it prepared) is held until the process ends, so
# that returning from a recipe's main() frees none of them. Seen (torch 2.13, gloo, ddp.yaml, 2 processes; twice in
# the first 20 or so runs forked by tests/warm_launcher.py, and once in a real launch, as `unwrap` in
# common/launch/accelerator.py notes): DDP's reducer, freed as main() returned, held the last reference to its gloo
# group, whose destructor joined the group's threads holding the GIL, while a thread that had finished an all-gather
# waited for the GIL to free the gathered tensor: the rank hung there for good.
_HELD_UNTIL_EXIT: list = []


def check_saved_global_batch(checkpoint: str | None, args) -> None:
    """The checkpoint's global batch, read from its state file, against this launch's (common.training.loop's
    check, with the data-parallel size the launch sets up): a refusal comes in seconds, with nothing converted."""
    if checkpoint is None:
        return
    with open(os.path.join(checkpoint, STATE_FILE)) as handle:
        saved = (json.load(handle).get("data") or {}).get("global_batch")
    ranks = mesh.launched_data_parallel_size()
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    problem = global_batch_problem(
        saved, args.per_device_train_batch_size, args.gradient_accumulation_steps, ranks, processes
    )
    if problem is not None:
        raise UsageError(problem)


def resume_after_restart(args, joining: bool = False) -> None:
    """torchrun sets TORCHELASTIC_RESTART_COUNT in the workers it restarts after a failure. They
    were launched with the first attempt's arguments (--overwrite_output_dir included): once this
    run has a complete checkpoint, continue from the latest one instead. `joining`: this worker's node joins an
    elastic launch already under way (common.launch.elastic), its agent's first attempt: the same, as for a restart.
    Where the first attempt
    died before taking over the folder's checkpoints (`common.outputs.run_dir.launch_starting`: an earlier
    run's, not yet cleared or set aside), its arguments stand: start afresh or from its checkpoint again."""
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if max_restarts and not restart and joining:
        restart = 1  # (its agent's count: a world that admits a node is no failure, torchrun counts it not)
    if max_restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Seen (torch 2.13, gloo): a rendezvous store kept across attempts (the configs' static rendezvous,
        # or c10d sharing the agent's store) hands restarted ranks a dead peer's address: they fail with
        # "Connection refused" or hang. Refused on the first attempt; torchrun then spends its restarts on
        # attempts that end at once, without repeating the line.
        if restart:
            sys.exit(2)
        raise UsageError(
            f"--max_restarts {max_restarts} needs a rendezvous store made fresh for each attempt, or "
            "a restarted worker can hang or fail to reach the dead one: launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 accelerate launch --rdzv_backend c10d --max_restarts "
            f'{max_restarts} ... (make <recipe> LAUNCH_ARGS="--max_restarts {max_restarts}" does both)'
        )
    first_attempt_ended_early = launch_starting(args.output_dir)
    if restart and list_checkpoints(args.output_dir) and not first_attempt_ended_early:
        args.resume_from_checkpoint, args.overwrite_output_dir = "latest", False
    elif restart and not first_attempt_ended_early and args.resume_from_checkpoint is None:
        args.overwrite_output_dir = True  # what the folder holds (run.json, metrics) is this launch's own
    if restart and _is_rank0():
        what = (
            "resuming from the latest checkpoint"
            if args.resume_from_checkpoint == "latest"
            else "the first attempt ended before it started training: starting as it did"
            if first_attempt_ended_early
            else "no checkpoint yet, starting again"
        )
        new_world = "a new world of an elastic launch" if joining else f"restart {restart} of at most {max_restarts}"
        print(f"{new_world}: {what}", file=sys.stderr)


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
