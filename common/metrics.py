"""What a practitioner watches, computed and logged in one place.

Train lines carry step, loss, lr, grad_norm, tokens/s (in total and per device),
samples/s, achieved TFLOP/s per device and MFU (`common.flops`), the share of the time
spent waiting for data, peak memory per rank (and, on a GPU, memory allocated and
reserved) and elapsed time; eval lines carry eval_loss and friends. Each goes to
`output_dir/metrics.jsonl` (appended, so a resumed run continues the file), to
accelerate's trackers (TensorBoard, W&B) and to a tqdm bar on the main process.
"""

from __future__ import annotations

import json
import os
import time

import torch
from tqdm.auto import tqdm

from common.flops import ModelFlops, device_peak_tflops


class MetricsLogger:
    def __init__(self, accelerator, output_dir: str, total_steps: int, start_step: int = 0, model=None,
                 peak_tflops: float | None = None):
        """`model` (prepared) gives the FLOPs per token; `peak_tflops` overrides the device table."""
        self.accelerator = accelerator
        self.flops = ModelFlops(accelerator.unwrap_model(model)) if model is not None else None
        compute = {"bf16": "bfloat16", "fp16": "float16"}.get(accelerator.mixed_precision)
        self.peak_tflops = device_peak_tflops(accelerator.device, compute, peak_tflops)
        self.window_flops = torch.zeros(1, dtype=torch.float64, device=accelerator.device)
        self.data_wait_s = 0.0
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.start_time = time.perf_counter()
        self.window_start = self.start_time
        self.window_tokens = torch.zeros(2, device=accelerator.device)  # tokens, samples on this rank
        self.window_loss, self.window_batches = 0.0, 0
        if accelerator.is_main_process and os.path.exists(self.path):
            self._drop_rows_after(start_step)
        self.progress = tqdm(total=total_steps, initial=start_step, desc="training",
                             disable=not accelerator.is_main_process, dynamic_ncols=True)

    def _drop_rows_after(self, step: int) -> None:
        """A resumed run repeats the steps after its checkpoint: drop the crashed run's copies."""
        with open(self.path) as handle:
            kept = [line for line in handle if json.loads(line)["step"] <= step]
        with open(self.path, "w") as handle:
            handle.writelines(kept)

    def record_batch(self, loss: torch.Tensor, batch: dict) -> None:
        """Call on every micro-batch: counts tokens that carry a label, and the loss."""
        labels = batch.get("labels", batch["input_ids"])
        self.window_tokens[0] += (labels != -100).sum()
        self.window_tokens[1] += labels.shape[0]
        if self.flops is not None:
            self.window_flops += self.flops.per_batch(batch)
        self.window_loss += loss.detach().float()
        self.window_batches += 1

    def add_data_wait(self, seconds: float) -> None:
        """Time the loop spent waiting for its next batches (common.training.TrainBatches)."""
        self.data_wait_s += seconds

    def log_train(self, step: int, lr: float, grad_norm) -> dict:
        """Average the window over micro-batches and ranks; call on every rank."""
        totals = self.accelerator.reduce(self.window_tokens.clone(), reduction="sum")
        flops = float(self.accelerator.reduce(self.window_flops.clone(), reduction="sum"))
        waited = self.accelerator.gather(torch.tensor([self.data_wait_s], device=self.accelerator.device))
        mean_loss = self.accelerator.reduce(
            torch.as_tensor(self.window_loss / max(self.window_batches, 1), device=self.accelerator.device),
            reduction="mean")
        peak = self.accelerator.gather(torch.tensor([peak_memory_mb(self.accelerator.device)],
                                                    device=self.accelerator.device))
        now = time.perf_counter()
        seconds = max(now - self.window_start, 1e-9)
        tflops = flops / seconds / self.accelerator.num_processes / 1e12 if self.flops is not None else None
        row = {"step": step, "loss": float(mean_loss), "lr": lr,
               "grad_norm": None if grad_norm is None else float(grad_norm),
               "tokens_per_s": float(totals[0]) / seconds, "samples_per_s": float(totals[1]) / seconds,
               "tokens_per_s_per_device": float(totals[0]) / seconds / self.accelerator.num_processes,
               "tflops_per_device": tflops,
               "mfu": tflops / self.peak_tflops if tflops is not None and self.peak_tflops else None,
               "data_wait_fraction": float(waited.max()) / seconds,  # the slowest rank's
               "elapsed_s": now - self.start_time,
               "peak_memory_mb_per_rank": [round(float(m), 1) for m in peak.tolist()],
               **gpu_memory_mb(self.accelerator)}
        self.window_start, self.window_loss, self.window_batches = now, 0.0, 0
        self.window_tokens.zero_()
        self.window_flops.zero_()
        self.data_wait_s = 0.0
        self._write(row)
        self.progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}")
        return row

    def log_eval(self, step: int, metrics: dict) -> dict:
        row = {"step": step, **metrics, "elapsed_s": time.perf_counter() - self.start_time}
        self._write(row)
        if self.accelerator.is_main_process:
            self.progress.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        return row

    def log_event(self, row: dict) -> None:
        """Something the run did besides training (a skipped step, ...): one metrics.jsonl row."""
        self._write({**row, "elapsed_s": time.perf_counter() - self.start_time})

    def advance(self) -> None:
        self.progress.update(1)

    def close(self) -> None:
        self.progress.close()
        self.accelerator.end_training()

    def _write(self, row: dict) -> None:
        self.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"},
                             step=row["step"])
        if self.accelerator.is_main_process:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(row) + "\n")


def gpu_memory_mb(accelerator) -> dict:
    """Memory allocated and reserved by torch's caching allocator on each rank's GPU; {} on CPU."""
    device = accelerator.device
    if not (torch.cuda.is_available() and getattr(device, "type", "") == "cuda"):
        return {}
    local = torch.tensor([torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)],
                         dtype=torch.float64, device=device) / 2**20
    both = accelerator.gather(local.unsqueeze(0)).tolist()
    return {"memory_allocated_mb_per_rank": [round(a, 1) for a, _ in both],
            "memory_reserved_mb_per_rank": [round(r, 1) for _, r in both]}


def peak_memory_mb(device) -> float:
    """Peak allocated GPU memory on a GPU, else the process's peak resident set size."""
    if torch.cuda.is_available() and getattr(device, "type", "") == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
