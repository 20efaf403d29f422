"""Optimizer, schedule and evaluation: the pieces around a recipe's training loop."""

from __future__ import annotations

import math
import time

import torch
from accelerate.utils import gather_object

from common.data.streaming import StreamLoader, check_resumable, every_rank_has
from common.launch import mesh
from common.launch.errors import UsageError
from common.launch.internals import start_accumulation_window
from common.options.arguments import TrainingArguments
from common.parallel import pipeline, sequence_parallel
from common.training.speed import adamw_kernel


NORM_TYPES = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
)


def is_norm(module) -> bool:
    """LayerNorm/GroupNorm/BatchNorm, or a model's own norm class (LlamaRMSNorm, T5LayerNorm, ...)."""
    return isinstance(module, NORM_TYPES) or "Norm" in type(module).__name__


def create_optimizer(model, args: TrainingArguments) -> torch.optim.Optimizer:
    """AdamW with two groups: weight decay on weights, none on biases or on the parameters
    of normalisation layers (chosen by module type, so GPT-2's ln_1/ln_f count too). Torch's
    fused kernel (GPU and CPU), as the HF Trainer's default: it updates in place, where the
    per-tensor step makes temporaries as large as the tensor it updates, which under DeepSpeed
    is the rank's whole flat fp32 partition (386 MB more at the peak of ZeRO-2/3 on 2
    processes at 101M)."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if not parameter.requires_grad or id(parameter) in seen:  # tied weights count once
                continue
            seen.add(id(parameter))
            (no_decay if is_norm(module) or name == "bias" else decay).append(parameter)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        **adamw_kernel(args),
    )


def steps_per_epoch(batches_per_epoch: int, gradient_accumulation_steps: int) -> int:
    """Optimizer steps in one epoch of `batches_per_epoch` batches per rank. Every step
    accumulates exactly gradient_accumulation_steps micro-batches; the last
    batches_per_epoch % gradient_accumulation_steps batches of an epoch are left out (as
    drop_last leaves out a partial batch; the next epoch's shuffle uses them)."""
    steps = batches_per_epoch // gradient_accumulation_steps
    if steps < 1:
        raise UsageError(
            f"an epoch has {batches_per_epoch} batches per process, fewer than "
            f"gradient_accumulation_steps={gradient_accumulation_steps}: use more data, a smaller "
            "per_device_train_batch_size or fewer accumulation steps"
        )
    return steps


def total_training_steps(args: TrainingArguments, train_loader, accelerator) -> int:
    """Optimizer steps in the run: max_steps if set (a --streaming loader has no length), else
    epochs x steps per epoch of the (unprepared) train loader's batches as the loop reads them: split
    over the ranks that read different ones (a tensor/context-parallel group shares its batches: `common.launch.mesh`),
    each read sp_size times under sequence parallelism (once per slice: `common.parallel.sequence_parallel`)."""
    if args.max_steps > 0:
        return args.max_steps
    shards = mesh.ulysses_shards(accelerator)
    batches = len(train_loader) // (mesh.data_parallel_size(accelerator) * shards) * shards
    return args.num_train_epochs * steps_per_epoch(batches, args.gradient_accumulation_steps)


def create_scheduler(optimizer, args: TrainingArguments, max_steps: int):
    """transformers' schedule over the run's optimizer steps: the recipes step it once per
    optimizer step (`common.launch.accelerator` tells accelerate not to step it per process)."""
    from transformers import get_scheduler  # here: its module imports peft (seconds), which --help need not

    return get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup_steps(args, max_steps),
        num_training_steps=max_steps,
        scheduler_specific_kwargs=args.scheduler_kwargs,
    )


def warmup_steps(args: TrainingArguments, max_steps: int) -> int:
    """--warmup_steps, or --warmup_ratio of the run's `max_steps` optimizer steps, rounded up (as Trainer)."""
    return args.warmup_steps or math.ceil(args.warmup_ratio * max_steps)


@torch.no_grad()
def evaluate_loss(model, dataloader, accelerator) -> dict:
    """Token-weighted mean loss over the whole eval set, every example counted once.

    Per-example loss sums and token counts are gathered with `gather_for_metrics`,
    which drops the samples duplicated to even out the last batch across ranks."""
    model.eval()  # (sequence parallelism: DeepSpeed's exchange is off, each rank reads whole rows)
    loss_sum, token_count = 0.0, 0
    for batch in sequence_parallel.whole_rows(dataloader):
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        labels = batch["labels"][:, 1:]
        per_token = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), labels, ignore_index=-100, reduction="none"
        )
        mask = labels != -100
        sums, counts = mesh.gather_for_metrics(accelerator, ((per_token * mask).sum(1), mask.sum(1)))
        loss_sum += sums.double().sum().item()
        token_count += int(counts.sum().item())
    model.train()
    loss = loss_sum / max(token_count, 1)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": token_count}


def _settled(pending):
    """A label-token count from `TrainBatches._label_tokens`, once its all-reduce is done."""
    if pending is None:
        return None
    count, reduction = pending
    if reduction is not None:
        reduction.wait()
    return count.float().clamp(min=1)


def check_global_batch(accelerator, saved: int | None, per_device: int, accumulation: int) -> None:
    """A checkpoint's global batch (`saved`) against this run's: another one would start elsewhere in the data
    and with other steps per epoch. Checked by `common.run` before anything is converted, loaded or written, and
    here."""
    problem = global_batch_problem(
        saved, per_device, accumulation, mesh.data_parallel_size(accelerator), accelerator.num_processes
    )
    if problem is not None:
        raise UsageError(problem)


def global_batch_problem(saved, per_device: int, accumulation: int, ranks: int, processes: int) -> str | None:
    """What is wrong with resuming a checkpoint of global batch `saved` on `ranks` data-parallel ranks (of
    `processes`; a tensor/context-parallel group shares one batch) x `per_device` x `accumulation`, or None."""
    global_batch = per_device * accumulation * ranks
    if saved is None or saved == global_batch:
        return None
    kind = "processes" if ranks == processes else "data-parallel ranks"
    kind = kind[:-1] if ranks == 1 else kind  # "1 process"
    return (
        f"the checkpoint was trained with a global batch of {saved} samples per step and this run's is "
        f"{global_batch} ({ranks} {kind} x {per_device} per device x {accumulation} accumulation): set "
        f"--per_device_train_batch_size and --gradient_accumulation_steps so that {kind} x batch x "
        f"accumulation = {saved}"
    )


class TrainBatches:
    """The loop's micro-batches, epoch after epoch until optimizer step `max_steps` (none when
    resumed there), one optimizer step's window of gradient_accumulation_steps batches at a time.

    * Loss normalisation: before a window is handed out, its label tokens are counted
      over every micro-batch and every rank. Each batch carries `num_items_in_batch` =
      that count / (processes x accumulation steps), so the model's summed token loss,
      after accelerate divides by the accumulation steps and the strategy averages over
      ranks, is the mean over all label tokens of the global batch: 1 x B, 2 x B/2 and
      1 x B/2 with accumulation 2 train the same model, whatever the lengths. The count's
      all-reduce runs a step ahead, during the previous window's work (a stream's windows are
      read one at a time: its state is the checkpointed position).
    * Sync: the last micro-batch of each window syncs and steps (accelerate's counter
      is aligned to the window), epoch boundaries included.
    * Data wait: the time spent fetching each window goes to `metrics`.
    * Position: `position` is where the data order stands after the current window: the
      epoch, the samples of it already trained on and the global batch (processes x batch x
      accumulation). A checkpoint stores it and a resumed run restarts there, the epoch's
      seeded order restored with `set_epoch`. The order does not depend on the layout: the
      epoch's shuffle is one permutation of the whole dataset and step k of an epoch trains
      on its samples [k x G, (k+1) x G) for global batch G, split across ranks and
      micro-batches. So a run resumes on any number of processes that keeps G (batch or
      accumulation rescaled), at the same sample, with the same steps per epoch
      (floor(dataset / G)); another G is refused."""

    def __init__(
        self,
        accelerator,
        dataloader,
        gradient_accumulation_steps: int,
        max_steps: int,
        resume_from: dict,
        metrics=None,
        budget=None,
    ):
        """`metrics` (a MetricsLogger) is told how long each window waited for its batches; `budget` (the run's
        common.training.time_budget.TimeBudget, --max_train_seconds) may end the windows before step `max_steps`.
        `dataloader` is a prepared DataLoader, or a common.data.streaming.StreamLoader (--streaming)."""
        self.split = dataloader if sequence_parallel.is_split(dataloader) else None  # zero3_ulysses.yaml's adapter
        dataloader = sequence_parallel.whole_rows(dataloader)
        self.accelerator, self.dataloader, self.metrics, self.budget = accelerator, dataloader, metrics, budget
        self.accumulation, self.max_steps, self.start_step = (
            gradient_accumulation_steps,
            max_steps,
            resume_from["step"],
        )
        shards = self.split.sp_world_size if self.split is not None else 1  # the ranks that split each row
        self.batch = dataloader.total_batch_size // shards  # samples per micro-batch over all ranks
        self.global_batch = self.batch * gradient_accumulation_steps
        self.stream = dataloader if isinstance(dataloader, StreamLoader) else None
        position = resume_from.get("data")
        if self.stream is not None:
            if position is not None:
                self._check_global_batch(position.get("global_batch", self.global_batch))
                check_resumable(position, accelerator)
                self.stream.restore(position["ranks"][accelerator.process_index])
            return
        self.per_epoch = steps_per_epoch(len(dataloader) * shards, gradient_accumulation_steps)
        if position is None:  # a fresh run, or a checkpoint that stored only its step
            epoch, steps_in = divmod(resume_from["step"], self.per_epoch)
            position = {"epoch": epoch, "samples": steps_in * self.global_batch}
        elif "samples" not in position:  # written before positions were counted in samples: same layout
            position = {"epoch": position["epoch"], "samples": position["batches"] * self.batch}
        self._check_global_batch(position.get("global_batch", self.global_batch))
        self._position = {
            "epoch": position["epoch"],
            "samples": position["samples"],
            "global_batch": self.global_batch,
        }

    def _check_global_batch(self, saved: int) -> None:
        check_global_batch(
            self.accelerator, saved, self.batch // mesh.data_parallel_size(self.accelerator), self.accumulation
        )

    @property
    def position(self) -> dict:
        """Where the data order stands after the last window handed out (what a checkpoint
        stores). Streaming: every rank's stream state, gathered (all ranks call it together)."""
        if self.stream is None:
            return self._position
        return {"ranks": gather_object([self.stream.state()]), "global_batch": self.global_batch}

    def __iter__(self):
        windows = self._epoch_windows() if self.stream is None else self._stream_windows()
        steps = self.max_steps - self.start_step
        upcoming = self._fetch(windows) if steps > 0 else None
        if self.budget is not None and steps > 0:
            self.budget.start()
        for step in range(steps):  # one window per optimizer step
            window, position, pending = upcoming
            if step > 0 and self.budget is not None and self.budget.done(self.start_step + step, self.max_steps):
                _settled(pending)  # the next window's count, already on its way on every rank
                return
            if self.stream is None and step + 1 < steps:
                # the next window now: its label-token count's all-reduce then runs during this step
                # instead of holding every rank at the next one's start (a stream's state must not run ahead)
                upcoming = self._fetch(windows)
            if position is not None:
                self._position = position
            tokens = _settled(pending)
            groups = mesh.check_shared_batch(self.accelerator, window[0]) if step == 0 else 0
            if groups and self.metrics is not None:  # each tensor/context-parallel group's ranks hold one batch
                self.metrics.record_in_run_json("shared_batch_groups_checked", groups)
            if step == 0 and self.split is not None and self.metrics is not None:  # what each rank's slice held
                self.metrics.record_in_run_json(
                    "sequence_parallel",
                    {"sp_size": self.split.sp_world_size, "slice_tokens": int(window[0]["input_ids"].shape[1])},
                )
            start_accumulation_window(self.accelerator)  # the window's last batch syncs
            if tokens is not None:
                count = self.accelerator.num_processes * self.accumulation * mesh.context_shards(self.accelerator)
                window = [{**batch, "num_items_in_batch": tokens / count} for batch in window]
            window = [sequence_parallel.as_model_input(batch) for batch in window]
            pipeline.begin_window(self.accelerator, window, tokens)  # pp.yaml: its schedule runs the whole window
            yield from window
            if self.stream is not None and step + 1 < steps:
                upcoming = self._fetch(windows)
        if self.budget is not None and steps > 0:
            self.budget.done(self.max_steps, self.max_steps)  # the clock read at the last step's end

    def _fetch(self, windows) -> tuple:
        """The next window, the data position after it (None for a stream: its live state) and its
        label-token count, being summed over the ranks."""
        waiting = time.perf_counter()
        window, position = next(windows)
        if self.metrics is not None:
            self.metrics.add_data_wait(time.perf_counter() - waiting)
        return window, position, self._label_tokens(window)

    def _epoch_windows(self):
        """Windows of a map-style loader, epoch after epoch (the caller stops mid-epoch: the
        rest of that epoch is never read)."""
        epoch, skip = self._position["epoch"], self._position["samples"] // self.batch
        used = self.per_epoch * self.accumulation
        while True:
            self.dataloader.set_epoch(epoch)
            batches = (
                sequence_parallel.batches(self.accelerator, self.split, skip)
                if self.split is not None  # slices
                else iter(self.accelerator.skip_first_batches(self.dataloader, skip) if skip else self.dataloader)
            )
            for start in range(skip, used, self.accumulation):
                window = [next(batches) for _ in range(self.accumulation)]
                end = start + self.accumulation
                done = (epoch + 1, 0) if end == used else (epoch, end * self.batch)
                yield window, {"epoch": done[0], "samples": done[1], "global_batch": self.global_batch}
            for _ in batches:  # the epoch's leftover batches: finish the iterator so accelerate closes it
                pass
            epoch, skip = epoch + 1, 0

    def _stream_windows(self):
        """Windows of a stream: a step only when every rank has a full window; when any
        rank's stream runs out, every rank starts the next epoch."""
        in_epoch = 0 if self.stream.at_epoch_start else 1  # resumed mid-epoch: it already had steps
        while True:
            window = self.stream.window(self.accumulation)
            if every_rank_has(self.accelerator, window):
                in_epoch += 1
                yield window, None
                continue
            if in_epoch == 0:
                raise UsageError(
                    f"the training stream gives a process fewer than one step's blocks "
                    f"({self.accumulation} x {self.batch // self.accelerator.num_processes} blocks per "
                    "process): use more data, a smaller batch or fewer accumulation steps"
                )
            self.stream.next_epoch()
            in_epoch = 0

    def _label_tokens(self, window):
        """Next-token targets (labels after the shift, not -100) in the window, over all ranks, as
        (count, its all-reduce in flight or None), read by `_settled`; None for sequence-level
        labels (one per example), whose loss is already a mean."""
        if any("shift_labels" not in b and ("labels" not in b or b["labels"].dim() < 2) for b in window):
            return None
        count = sum((sequence_parallel.targets(b) != -100).sum() for b in window).to(self.accelerator.device)
        if self.accelerator.num_processes > 1:
            return count, torch.distributed.all_reduce(count, async_op=True)
        return count, None
