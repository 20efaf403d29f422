"""Non-finite loss or gradients: every rank agrees, then the step is skipped or the run stops.

Each micro-batch's loss is checked on its rank (no synchronisation). At the optimizer step the
global gradient norm, which clipping has already reduced over every rank (the same on each),
decides: a non-finite loss makes non-finite gradients, so a finite norm means a good step, with
no collective. Only when it is not finite (or when there is no norm) does one all-gather tell
every rank which ranks saw a non-finite loss. Every rank then takes the same decision.

Where the optimizer is torch's fused AdamW on whole parameters (DDP, one process; not FSDP2 or
DeepSpeed), the norm is not even read at each step, which on a GPU would wait for the step's
kernels: the optimizer's step becomes a no-op on the device when the norm is not finite (its
found_inf, as under a GradScaler), and the norms are read on logging steps, before a checkpoint
and at the end (`settle`), where a skipped step is logged and acted on as below and the
schedule is stepped back. Until that read the schedule runs at most --logging_steps - 1 steps
ahead, and --nonfinite stop ends the run there, its weights finite. run.json's
`nonfinite_check` says which: "device" or "host". Elsewhere the norm is read at every step:

* skip (`--nonfinite skip`, the default): the optimizer and the learning-rate schedule do
  not step, the gradients are dropped, the data moves on. After `--max_nonfinite_skips`
  skips the run stops.
* stop (`--nonfinite stop`): the run ends with one line naming the step and the ranks.

DeepSpeed steps inside `backward`, before the loop can decide; it discards a step whose
gradient norm is not finite on its own (seen with deepspeed 0.19.8 under ZeRO-2 and ZeRO-3,
fp32 and bf16), and the loop then skips the schedule's step. Should DeepSpeed ever apply a
non-finite step (`was_step_applied`), the weights are lost and the run stops whatever the
policy. Either way no checkpoint is ever written from non-finite weights
(`check_finite_weights`, called before each save).

In fp16 the loss is scaled (accelerate's GradScaler, DeepSpeed's dynamic loss scale), and a
scale too high for a step's gradients overflows them: their norm is not finite while every loss
was. That is the scaler's routine, not a fault: the step is skipped, the scaler lowers its scale
(`GradScaler.update`, which its own step would have run) and the run goes on; the overflow is
logged in metrics.jsonl ("loss_scale_overflow") and counts towards no --max_nonfinite_skips.
More than MAX_OVERFLOWS_IN_A_ROW in a row (the scale halved each time) stops the run.
"""

from __future__ import annotations

import math

import torch

from common.launch.errors import RunStopped
from common.launch.internals import innermost_optimizer, skip_step_on_device
from common.parallel.shards import local_parameter_shards


# fp16: overflows in a row before the run stops (the scaler halves its scale at each: 2^16 falls below 2^-14)
MAX_OVERFLOWS_IN_A_ROW = 30


def skips_on_device(accelerator, inner, schedule) -> bool:
    """Whether a step can be skipped without a host read: `inner` (the torch optimizer) is the fused
    AdamW on whole (not DTensor) parameters, outside DeepSpeed, and `schedule` (the torch scheduler)
    a function of its step (LambdaLR, all of transformers' but reduce_lr_on_plateau), which can be
    stepped back."""
    if accelerator.state.deepspeed_plugin is not None or inner is None:
        return False
    whole = not any(hasattr(p, "to_local") for group in inner.param_groups for p in group["params"])
    return (
        isinstance(inner, torch.optim.Adam)
        and bool(inner.defaults.get("fused"))
        and whole
        and isinstance(schedule, torch.optim.lr_scheduler.LambdaLR)
    )


def torch_optimizer_and_schedule(optimizer, scheduler) -> tuple:
    """The torch optimizer and schedule under accelerate's wrappers."""
    return (None if optimizer is None else innermost_optimizer(optimizer)), getattr(scheduler, "scheduler", scheduler)


def nonfinite_check(accelerator, optimizer, scheduler) -> str:
    """run.json's "nonfinite_check": "device" where `skips_on_device`, else "host"."""
    return "device" if skips_on_device(accelerator, *torch_optimizer_and_schedule(optimizer, scheduler)) else "host"


class NonFiniteGuard:
    def __init__(
        self,
        accelerator,
        model,
        policy: str,
        max_skips: int,
        metrics,
        optimizer=None,
        scheduler=None,
        read_every: int = 1,
        skipped: int = 0,
    ):
        """With `optimizer` and `scheduler`, where `skips_on_device`: steps are decided on the device
        and read every `read_every` steps (the logging steps), before a checkpoint and at the end.
        `skipped`: the steps the run skipped before (a resumed run's checkpoint holds them), which
        count towards `max_skips` as this launch's do."""
        self.accelerator, self.model, self.metrics = accelerator, model, metrics
        self.policy, self.max_skips = policy, max_skips
        self.scaler = accelerator.scaler  # fp16 under accelerate: its GradScaler
        self.scales_loss = self.scaler is not None or bool(getattr(model, "fp16_enabled", lambda: False)())
        self.overflows = self.overflows_in_a_row = 0
        self.bad_losses = torch.zeros(1, device=accelerator.device)
        self.skipped = skipped
        self.inner, self.schedule = torch_optimizer_and_schedule(optimizer, scheduler)  # found once
        self.on_device = skips_on_device(accelerator, self.inner, self.schedule)
        self.read_every = max(read_every, 1)
        self.pending: list = []  # (step, gradient norm, this rank's non-finite losses), not read yet

    def record(self, loss: torch.Tensor) -> None:
        """Call on every micro-batch (before backward); costs no synchronisation."""
        self.bad_losses += (~torch.isfinite(loss.detach().float())).sum()

    def skip_step(self, step: int, grad_norm) -> bool:
        """Call on every rank at each optimizer step, after clipping. True: skip this step."""
        if self.on_device and torch.is_tensor(grad_norm):
            norm = grad_norm.detach().float().reshape(())
            skip_step_on_device(self.inner, (~torch.isfinite(norm)).float())
            self.pending.append((step, norm, self.bad_losses.clone()))
            self.bad_losses.zero_()
            if step % self.read_every == 0:
                self.settle()
            return False  # the optimizer steps; a non-finite norm makes its step a no-op on the device
        norm = None if grad_norm is None else float(grad_norm)
        if norm is not None and math.isfinite(norm):  # every rank read the same norm: none gathers
            self.bad_losses.zero_()
            self.overflows_in_a_row = 0
            return False
        ranks = self.accelerator.gather(self.bad_losses.clone()).tolist()
        self.bad_losses.zero_()
        skip = self._decide(step, norm, [rank for rank, bad in enumerate(ranks) if bad])
        if skip and self.scaler is not None:
            self.scaler.update()  # what its step would have run: a lower scale, ready for the next unscale_
        return skip

    def settle(self) -> None:
        """Read the steps decided on the device since the last read (one host read) and act on those
        skipped: as at once, and the schedule stepped back. Every rank calls it at the same steps."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        norms = torch.stack([norm for _, norm, _ in pending]).tolist()
        bad = [i for i, norm in enumerate(norms) if not math.isfinite(norm)]
        if not bad:
            self.overflows_in_a_row = 0
            return
        table = self.accelerator.gather(torch.cat([pending[i][2] for i in bad]).reshape(1, -1)).tolist()
        for column, i in enumerate(bad):
            if i > (bad[column - 1] + 1 if column else 0):  # a good step came before this one
                self.overflows_in_a_row = 0
            self._decide(pending[i][0], norms[i], [rank for rank, row in enumerate(table) if row[column]])
            self.schedule.last_epoch -= 2  # one step back: LambdaLR's rate is a function of its step count
            self.schedule.step()
        if bad[-1] < len(norms) - 1:  # good steps after the last one skipped
            self.overflows_in_a_row = 0

    def _decide(self, step: int, norm, loss_ranks: list) -> bool:
        if not loss_ranks and norm is None:
            return False
        if self.scales_loss and not loss_ranks:  # fp16: the loss scale overflowed the gradients
            self.overflows += 1
            self.overflows_in_a_row += 1
            stop = self.overflows_in_a_row > MAX_OVERFLOWS_IN_A_ROW
            self.metrics.log_event(
                {
                    "step": step,
                    "event": "loss_scale_overflow",
                    "grad_norm": str(norm),
                    "action": "stopped" if stop else "skipped",
                    "overflows": self.overflows,
                }
            )
            if stop:  # each overflow halved the scale: the gradients are not finite at any scale
                raise RunStopped(
                    f"step {step}: the gradients overflowed {self.overflows_in_a_row} steps in a row "
                    "while every loss was finite, each time at half the loss scale before: they are "
                    "not finite at any scale; lower the learning rate, use bf16, or check the model "
                    "and data, then resume from the last checkpoint"
                )
            return True
        what = (
            f"non-finite loss on rank {', '.join(map(str, loss_ranks))}" if loss_ranks else "non-finite gradients"
        ) + f" (gradient norm {norm})"
        applied = hasattr(self.model, "was_step_applied") and self.model.was_step_applied()
        self.skipped += not applied
        stop = applied or self.policy == "stop" or self.skipped > self.max_skips
        self.metrics.log_event(
            {
                "step": step,
                "event": "nonfinite",
                "loss_ranks": loss_ranks,
                "grad_norm": str(norm),
                "action": "stopped" if stop else "skipped",
                "skipped_steps": self.skipped,
            }
        )
        if applied:
            raise RunStopped(
                f"step {step}: {what}, and DeepSpeed applied it, so the weights are no longer "
                "finite; resume from the last checkpoint with a lower learning rate or without the "
                "offending data"
            )
        if self.policy == "stop":
            raise RunStopped(
                f"step {step}: {what}; stopped (--nonfinite stop). Checkpoints hold finite weights: "
                "resume from the last one with a lower learning rate or without the offending data, "
                "or pass --nonfinite skip"
            )
        if self.skipped > self.max_skips:
            raise RunStopped(
                f"step {step}: {what}; {self.skipped} steps were non-finite, more than "
                f"--max_nonfinite_skips {self.max_skips}: lower the learning rate, check the data "
                "and the model's weights, then resume from the last checkpoint"
            )
        self.accelerator.print(
            f"warning: step {step}: {what}; step skipped ({self.skipped} of at most {self.max_skips})"
        )
        return True


def check_finite_weights(accelerator, model, step: int) -> None:
    """Collective. Stops the run rather than write a checkpoint of non-finite weights."""
    bad = torch.zeros(1, device=accelerator.device)
    with torch.no_grad():
        for shard in local_parameter_shards(model):
            if shard.numel() and shard.is_floating_point():
                bad += (~torch.isfinite(shard)).any().float()
    if float(accelerator.reduce(bad, reduction="sum")) > 0:
        raise RunStopped(
            f"step {step}: the weights hold non-finite values, so no checkpoint was written; "
            "resume from the last checkpoint with a lower learning rate"
        )
