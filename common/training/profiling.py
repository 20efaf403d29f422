"""`--profile_steps A-B`: a torch.profiler trace of optimizer steps A to B, one file per rank.

The trace goes to `output_dir/profile/rank<N>.<time>.pt.trace.json` (TensorBoard's
profiler plugin reads the folder: `tensorboard --logdir output_dir/profile`; Perfetto and
chrome://tracing open a file). Steps are labelled `ProfilerStep#<optimizer step>`. The step
before A is a warm-up step the profiler does not keep. `--profile_memory` adds allocations
and frees (memory view).
"""

from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from common.launch.internals import start_profiler_at
from common.options.arguments import parse_steps


class StepProfiler:
    """`step()` after every optimizer step, `stop()` after the loop; both do nothing when off."""

    def __init__(self, accelerator, steps: str | None, output_dir: str, memory: bool, start_step: int):
        self.profiler = None
        if not steps:
            return
        first, last = parse_steps(steps)
        if last <= start_step:
            accelerator.print(f"warning: --profile_steps {steps} were run before step {start_step}; not profiling")
            return

        def schedule(step: int) -> ProfilerAction:
            if first <= step < last:
                return ProfilerAction.RECORD
            if step == last:
                return ProfilerAction.RECORD_AND_SAVE
            return ProfilerAction.WARMUP if step == first - 1 else ProfilerAction.NONE

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if accelerator.device.type == "cuda" else [])
        folder = os.path.join(output_dir, "profile")
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            record_shapes=True,
            profile_memory=memory,
            with_stack=memory,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                folder, worker_name=f"rank{accelerator.process_index}"
            ),
        )
        start_profiler_at(self.profiler, start_step + 1, schedule(start_step + 1))  # the step about to run
        self.profiler.start()
        accelerator.print(f"profiling optimizer steps {first}-{last} into {folder}")

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
