"""What a practitioner watches, computed and logged in one place.

Train lines carry step, loss, lr, grad_norm, tokens/s (the input tokens, padding left out; in total and per
device), label_tokens/s (those the loss is taken on), samples/s (examples: a packed row's each, DPO's pairs),
achieved TFLOP/s per device and MFU (`common.training.flops`), the share of the time
spent waiting for data, peak memory per rank (and, on a GPU, memory allocated and
reserved) and elapsed time; eval lines carry eval_loss and friends. Each goes to
`output_dir/metrics.jsonl` (appended, so a resumed run continues the file), to
accelerate's trackers (TensorBoard, W&B) and to a tqdm bar on the main process.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from common.launch import mesh
from common.launch.accelerator import autocast_dtype
from common.outputs.run_dir import write_atomically
from common.parallel import pipeline
from common.training.flops import ModelFlops, device_peak_tflops
from common.training.memory import MemoryAccount, current_memory


# a train line's own keys, which no recipe figure replaces
RESERVED = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s")
# beside the loss and the learning rate on the progress bar, where a recipe logs them: what a TRL user watches
BAR_FIGURES = ("reward", "reward_std", "kl", "completions/mean_length", "rewards/accuracies", "rewards/margins")
BAR_FIGURES += ("accuracy", "margin")


class MetricsLogger:
    def __init__(
        self,
        accelerator,
        output_dir: str,
        total_steps: int,
        start_step: int = 0,
        model=None,
        optimizer=None,
        peak_tflops: float | None = None,
        on_step=None,
    ):
        """`model` (prepared) gives the FLOPs per token, and with `optimizer` (prepared) the
        memory account (`common.training.memory`); `peak_tflops` overrides the device table. `on_step(step)`:
        called at each optimizer step (`advance`), every rank (an elastic launch's account of how far
        each world got, `common.launch.elastic.WorldWatch.stepped`)."""
        self.accelerator = accelerator
        self.step, self.on_step = start_step, on_step
        self.output_dir = output_dir
        self.memory = (
            MemoryAccount(model, optimizer, accelerator.device, count_activations=not pipeline.enabled(accelerator))
            if optimizer is not None
            else None
        )
        self.flops = (
            ModelFlops(pipeline.whole_skeleton(accelerator, model), mesh.sequence_shards(accelerator))
            if model is not None
            else None
        )
        compute = autocast_dtype(accelerator.mixed_precision)
        self.peak_tflops = device_peak_tflops(accelerator.device, compute, peak_tflops)
        self.data_wait_s = 0.0
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.start_time = time.perf_counter()
        self.window_start = self.start_time
        self.shards = mesh.sequence_shards(accelerator)
        # label tokens, samples, model FLOPs and input tokens on this rank, summed over ranks in one reduce
        self.window_sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)
        self.window_loss, self.window_batches = 0.0, 0
        self.window_values = {}  # a recipe's own per-batch figures (`record_values`)
        self.window_calls = {}  # figures reduced over the ranks per micro-batch, then averaged (`record_per_call`)
        self.latest = {}  # figures logged as they last stood (`record_latest`)
        self.sources = []  # `add_source`'s callables
        if accelerator.is_main_process and os.path.exists(self.path):
            self._drop_rows_after(start_step)
        self.postfix = {}  # the bar's figures: the last train line's
        self.progress = tqdm(
            total=total_steps,
            initial=start_step,
            desc="training",
            disable=not accelerator.is_main_process,
            dynamic_ncols=True,
        )

    def _drop_rows_after(self, step: int) -> None:
        """A resumed run repeats the steps after its checkpoint: drop the crashed run's copies,
        and a last line that a crash left half-written (the file is replaced whole)."""
        kept = [
            line if line.endswith("\n") else line + "\n" for row, line in self._logged() if row.get("step", 0) <= step
        ]
        write_atomically(self.path, "".join(kept))

    def _logged(self):
        """metrics.jsonl's rows, each with its line; a line torn by a crash mid-write left out."""
        with open(self.path) as handle:
            for line in handle:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                yield row, line

    def record_batch(self, loss: torch.Tensor, batch: dict, examples=None, extra_forwards: int = 0) -> None:
        """Call on every micro-batch: counts its input tokens (padding left out), the tokens that carry a label,
        its examples (`examples` where a row is not one: DPO's pairs; else its rows, or a packed row's
        examples), its FLOPs (with `extra_forwards` forward passes of a frozen copy of the model: DPO's
        reference), and the loss."""
        input_ids = batch["input_ids"]
        labels = batch.get("labels", input_ids)
        mask = batch.get("attention_mask")
        self.window_sums[0] += (labels != -100).sum()
        self.window_sums[3] += input_ids.numel() if mask is None else mask.sum()
        if examples is None:
            packed = "position_ids" in batch and input_ids.shape[0] == 1 and self.shards == 1
            examples = (batch["position_ids"] == 0).sum() if packed else input_ids.shape[0] / self.shards
        self.window_sums[1] += examples  # a split row's ranks each hold a share of its tokens, and of the row
        if self.flops is not None:
            self.window_sums[2] += self.flops.per_batch(batch)
            for _ in range(extra_forwards):
                self.window_sums[2] += self.flops.per_batch(batch, forward_only=True)
        self.window_loss += loss.detach().float()
        self.window_batches += 1

    def record_values(self, values: dict) -> None:
        """A recipe's own figures for a micro-batch (DPO's rewards/*: each a tensor of per-example
        values); the train line carries their mean over the window's examples on every rank."""
        for name, value in values.items():
            value = value.detach().float().to(self.accelerator.device)  # reduced over the ranks (NCCL: on the GPU)
            total = self.window_values.get(name, 0.0)
            self.window_values[name] = total + torch.stack(
                [value.sum(), torch.tensor(float(value.numel()), device=value.device)]
            )

    def record_per_call(self, values: dict) -> None:
        """Figures taken per micro-batch over every rank, then averaged over the logging window's micro-batches, as
        TRL logs its per-call metrics: name -> (how, value, count) of this rank's micro-batch; how "pooled" sums the
        values and the counts over the ranks (a mean over every rank's tokens), "min" and "max" take the smallest
        and largest value over the ranks (NaN: this rank has none). Every rank records the same names as often."""
        for name, (how, value, count) in values.items():
            entry = torch.stack([torch.as_tensor(value).detach().double().cpu(), torch.tensor(float(count))])
            self.window_calls.setdefault(name, (how, []))[1].append(entry)

    def record_latest(self, name: str, value: float) -> None:
        """A figure logged as it last stood (TRL's num_tokens: the input tokens seen so far)."""
        self.latest[name] = value

    def _per_call(self) -> dict:
        """`record_per_call`'s figures over the ranks and the window (every rank calls it: one gather a figure)."""
        reduced = {}
        for name, (how, entries) in self.window_calls.items():
            local = torch.stack(entries).to(self.accelerator.device)
            per_rank = self.accelerator.gather(local).view(-1, len(entries), 2).cpu()
            if how == "pooled":
                calls = per_rank[..., 0].sum(0) / per_rank[..., 1].sum(0).clamp(min=1.0)
            else:
                values = per_rank[..., 0]
                fill = math.inf if how == "min" else -math.inf
                extreme = values.nan_to_num(nan=fill).amin(0) if how == "min" else values.nan_to_num(nan=fill).amax(0)
                calls = torch.where(extreme.isinf(), math.nan, extreme)
            reduced[name] = None if calls.isnan().all() else float(calls.nanmean())
        return reduced

    def add_source(self, figures) -> None:
        """`figures(accelerator) -> dict`: a window's figures kept elsewhere (a MoE's aux loss and experts' load:
        common.training.experts), called at each train line on every rank, after which it starts a new window."""
        self.sources.append(figures)

    def add_data_wait(self, seconds: float) -> None:
        """Time the loop spent waiting for its next batches (common.training.loop.TrainBatches)."""
        self.data_wait_s += seconds

    def log_train(self, step: int, lr: float, grad_norm) -> dict:
        """Average the window over micro-batches and ranks; call on every rank."""
        device = self.accelerator.device
        label_tokens, samples, flops, tokens = mesh.reduce_sum(self.accelerator, self.window_sums.clone()).tolist()
        mean_loss = self.accelerator.reduce(
            torch.as_tensor(self.window_loss / max(self.window_batches, 1), device=device), reduction="mean"
        )
        own = {}
        if self.window_values:  # one reduce for all of them
            sums = self.accelerator.reduce(torch.stack(list(self.window_values.values())), reduction="sum").tolist()
            # a figure nothing recorded in the window (a reward that scored no completion) is None, not 0
            own = {name: total / count if count else None for name, (total, count) in zip(self.window_values, sums)}
        own.update(self._per_call())
        for figures in self.sources:
            own.update(figures(self.accelerator))
        own.update(self.latest)
        own = {name: value for name, value in own.items() if name not in RESERVED}  # never the line's own keys
        # one row per rank: [data wait, peak memory (, allocated, reserved on a GPU)]
        per_rank = self.accelerator.gather(
            torch.tensor([[self.data_wait_s, *memory_mb(device)]], dtype=torch.float64, device=device)
        ).tolist()
        now = time.perf_counter()
        seconds = max(now - self.window_start, 1e-9)
        tflops = flops / seconds / self.accelerator.num_processes / 1e12 if self.flops is not None else None
        row = {
            "step": step,
            "loss": float(mean_loss),
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            **own,
            "tokens_per_s": tokens / seconds,
            "label_tokens_per_s": label_tokens / seconds,
            "samples_per_s": samples / seconds,
            "tokens_per_s_per_device": tokens / seconds / self.accelerator.num_processes,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak_tflops if tflops is not None and self.peak_tflops else None,
            "data_wait_fraction": max(rank[0] for rank in per_rank) / seconds,  # the slowest rank's
            "elapsed_s": now - self.start_time,
            "peak_memory_mb_per_rank": [round(rank[1], 1) for rank in per_rank],
        }
        if len(per_rank[0]) > 2:
            row["memory_allocated_mb_per_rank"] = [round(rank[2], 1) for rank in per_rank]
            row["memory_reserved_mb_per_rank"] = [round(rank[3], 1) for rank in per_rank]
        self.window_start, self.window_loss, self.window_batches = now, 0.0, 0
        self.window_values, self.window_calls = {}, {}
        self.window_sums.zero_()
        self.data_wait_s = 0.0
        self._write(row)
        # a figure this line lacks (GRPO's rewards on a step that reuses its rollout) keeps its last value
        shown = {name: f"{row[name]:.4g}" for name in BAR_FIGURES if row.get(name) is not None}
        kept = {name: self.postfix[name] for name in BAR_FIGURES if name in self.postfix}
        self.postfix = {"loss": f"{row['loss']:.4f}", "lr": f"{lr:.2e}", **kept, **shown}
        self.progress.set_postfix(self.postfix)
        self._log_memory(step)
        return row

    def _log_memory(self, step: int) -> None:
        """The memory account, once every rank has one (after the first optimizer step, on all
        ranks alike): a metrics.jsonl row and run.json's "memory_per_rank"."""
        if self.memory is None or self.memory.report is None:
            return
        per_rank = gather_object([self.memory.report])
        self.memory = None
        self._write({"step": step, "memory_per_rank": per_rank})
        self.record_in_run_json("memory_per_rank", per_rank)

    def record_whole_run_peak(self) -> list[dict]:
        """Every rank: its peak over the whole run so far (the process's resident set high-water
        mark; on a GPU also the allocator's peak), into run.json's "peak_memory_whole_run"; the
        memory account, taken at the first optimizer step, cannot see what grows after it."""
        figures = current_memory(self.accelerator.device)
        peak = {key: round(figures[key], 1) for key in ("peak_rss_mb", "peak_allocated_mb") if figures.get(key)}
        per_rank = gather_object([peak])
        self.record_in_run_json("peak_memory_whole_run", per_rank)
        return per_rank

    def record_in_run_json(self, key: str, value) -> None:
        """Add a measurement to run.json (main process; the file is replaced whole)."""
        path = os.path.join(self.output_dir, "run.json")
        if self.accelerator.is_main_process and os.path.exists(path):
            with open(path) as handle:
                record = json.load(handle)
            record[key] = value
            write_atomically(path, json.dumps(record, indent=2, default=str))

    def log_eval(self, step: int, metrics: dict) -> dict:
        row = {"step": step, **metrics, "elapsed_s": time.perf_counter() - self.start_time}
        self._write(row)
        if self.accelerator.is_main_process:
            self.progress.write(
                " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
            )
        return row

    def eval_at_start(self) -> dict | None:
        """The evaluation logged at step 0 (--eval_on_start), this run's or, after a resume, the one of the run it
        continues (metrics.jsonl keeps the rows up to the checkpoint): a summary's 'before'. Main process only."""
        if not self.accelerator.is_main_process or not os.path.exists(self.path):
            return None
        return next(
            (row for row, _ in self._logged() if row.get("step") == 0 and any(key.startswith("eval_") for key in row)),
            None,
        )

    def log_event(self, row: dict) -> None:
        """Something the run did besides training (a skipped step, ...): one metrics.jsonl row."""
        self._write({**row, "elapsed_s": time.perf_counter() - self.start_time})

    def show_phase(self, what: str) -> None:
        """A phase inside a step on the bar, after the last train line's figures (a rollout's prompts sampled so
        far): a step that takes minutes shows it is moving."""
        self.progress.set_postfix({**self.postfix, "now": what})

    def advance(self) -> None:
        """Every rank, once per optimizer step (the loop's step count goes up by one)."""
        self.step += 1
        self.progress.set_postfix(self.postfix, refresh=False)  # a phase shown inside the step is over
        self.progress.update(1)
        if self.on_step is not None:
            self.on_step(self.step)

    def close(self) -> None:
        self.progress.close()
        self.accelerator.end_training()

    def _write(self, row: dict) -> None:
        self.accelerator.log(
            {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}, step=row["step"]
        )
        if self.accelerator.is_main_process:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(row) + "\n")


def start_trackers(accelerator, args, config: dict) -> None:
    """accelerate's tracker for --report_to, the run's scalar arguments as its configuration. MLflow
    writes to output_dir/mlflow.db (SQLite, no server) unless MLFLOW_TRACKING_URI names a store;
    its experiment, and trackio's project, is --run_name, and the run is named after output_dir."""
    name = os.path.basename(os.path.abspath(args.output_dir))
    if args.report_to == "mlflow" and accelerator.is_main_process and not os.environ.get("MLFLOW_TRACKING_URI"):
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{os.path.abspath(os.path.join(args.output_dir, 'mlflow.db'))}")
    accelerator.init_trackers(
        args.run_name, config, init_kwargs={"mlflow": {"run_name": name}, "trackio": {"name": name, "embed": False}}
    )


def memory_mb(device) -> tuple:
    """(peak allocated, allocated, reserved) by torch's allocator on a GPU; (peak resident set
    size,) of the process elsewhere."""
    figures = current_memory(device)
    if "allocated_mb" in figures:
        return figures["peak_allocated_mb"], figures["allocated_mb"], figures["reserved_mb"]
    return (figures["peak_rss_mb"],)
