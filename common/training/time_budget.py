"""--max_train_seconds: a run that stops at the first optimizer step that ends past a wall-clock budget.

The clock starts at the loop's first step (model loading, the evaluation before training and a resume's loading are
not counted) and counts everything after it: the steps, an on-policy step's sampling, a GRPO rollout, and the
evaluations and checkpoints inside the loop. Every rank stops at the same step: the decision is the ranks' largest
elapsed time against the budget, one all-reduce of one number per step, and only when a budget is set. The run then
ends as at --max_steps: the final evaluation, final/ and run.json (`train_seconds`, and `stopped_by_time_budget`
with the step). The learning-rate schedule still spans --max_steps (or the epochs): give a constant schedule, or
the steps the budget is expected to reach, for a decay that ends where the run does. The workers count it from
their own first step: a resumed run, and each restart under --max_restarts or a node range, gets it whole again; a
stopped run keeps the checkpoints --save_steps wrote, none more.
"""

from __future__ import annotations

import time

import torch


class TimeBudget:
    def __init__(self, accelerator, seconds: float | None):
        self.accelerator, self.seconds = accelerator, seconds
        self.started = None  # perf_counter at the first step
        self.elapsed = None  # seconds from the first step to the last step checked (the ranks' largest if compared)
        self.checked = None  # (step, whether the loop ends there): asked again for the same step, no new collective
        self.stopped_at = None  # the step after which the budget stopped the run

    def start(self) -> None:
        """At the loop's first step (once: a second call keeps the first clock)."""
        if self.started is None:
            self.started = time.perf_counter()

    def done(self, step: int, max_steps: int) -> bool:
        """After optimizer step `step`, on every rank together: whether the loop ends here, at `max_steps` or
        because the budget is spent. The first call for a step reads the clock (and, with a budget on several
        processes, compares it over the ranks: one all-reduce); later calls for the same step give the same answer
        (the recipe's evaluation asks first, TrainBatches after: a run stopped at an evaluation step evaluates once)."""
        if self.checked is not None and self.checked[0] == step:
            return self.checked[1]
        if self.started is not None:
            self.elapsed = time.perf_counter() - self.started
        ends = step >= max_steps
        if not ends and self.seconds is not None and self.elapsed is not None:
            if self.accelerator.num_processes > 1:  # the slowest rank's clock decides for all
                elapsed = torch.tensor([self.elapsed], dtype=torch.float64, device=self.accelerator.device)
                torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
                self.elapsed = float(elapsed)
            if self.elapsed >= self.seconds:
                self.stopped_at, ends = step, True
        self.checked = (step, ends)
        return ends

    @property
    def stopped(self) -> bool:
        """Whether the budget ended the loop (before --max_steps)."""
        return self.stopped_at is not None

    def record(self) -> dict:
        """run.json's fields: the seconds from the first step to the last step's end (0 where no step ran), the
        budget and where it stopped."""
        record = {"train_seconds": round(self.elapsed or 0.0, 3), "max_train_seconds": self.seconds}
        if self.stopped_at is not None:
            record["stopped_by_time_budget"] = {"step": self.stopped_at}
        return record
