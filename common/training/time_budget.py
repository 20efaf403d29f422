"""--max_train_seconds: a run that stops at the first optimizer step that ends past a wall-clock budget.

The clock starts at the loop's first step (model loading, the evaluation before training and a resume's loading are
not counted) and counts everything after it: the steps, an on-policy step's sampling, a GRPO rollout, and the
evaluations and checkpoints inside the loop. Every rank stops at the same step: the decision is the ranks' largest
elapsed time against the budget, one all-reduce of one number per step, and only when a budget is set. The run then
ends as at --max_steps: the final evaluation, final/ and run.json (`train_seconds`, and `stopped_by_time_budget`
with the step). The learning-rate schedule still spans --max_steps (or the epochs): give a constant schedule, or
the steps the budget is expected to reach, for a decay that ends where the run does. A resumed run's budget is its
own launch's.
"""

from __future__ import annotations

import time

import torch


class TimeBudget:
    def __init__(self, accelerator, seconds: float | None):
        self.accelerator, self.seconds = accelerator, seconds
        self.started = None  # perf_counter at the first step
        self.ended = None  # perf_counter at the last check (the loop's end)
        self.stopped_at = None  # the step after which the budget stopped the run

    def start(self) -> None:
        """At the loop's first step (once: a second call keeps the first clock)."""
        if self.started is None:
            self.started = time.perf_counter()

    def done(self, step: int, max_steps: int) -> bool:
        """After optimizer step `step`, on every rank together: whether the loop ends here, at `max_steps` or
        because the budget is spent (the clock is read either way: `train_seconds`)."""
        self.ended = time.perf_counter()
        if step >= max_steps:
            return True
        if self.seconds is None or self.started is None:
            return False
        elapsed = torch.tensor([self.ended - self.started], dtype=torch.float64, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:  # the slowest rank's clock decides for all
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        if float(elapsed) >= self.seconds:
            self.stopped_at = step
        return self.stopped

    @property
    def stopped(self) -> bool:
        """Whether the budget ended the loop (before --max_steps)."""
        return self.stopped_at is not None

    def record(self) -> dict:
        """run.json's fields: the seconds from the first step to the last check, the budget and where it stopped."""
        seconds = 0.0 if self.started is None else (self.ended or time.perf_counter()) - self.started
        record = {"train_seconds": round(seconds, 3), "max_train_seconds": self.seconds}
        if self.stopped_at is not None:
            record["stopped_by_time_budget"] = {"step": self.stopped_at}
        return record
