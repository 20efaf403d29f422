"""What each rank holds in memory, by category, counted in the run itself.

Right after the first optimizer step (a step post-hook on the optimizer that updates the
weights, when gradients, optimizer states and any master copy all exist; under ZeRO-3, which
calls it once per sub-group, after the last sub-group's) every tensor
this rank can reach is counted once, by its storage, into the first category that claims it:

- parameters: what the model computes with (this rank's shard under FSDP2 and ZeRO-3;
  under DeepSpeed with bf16, its bf16 copy)
- master_weights: a separate copy the optimizer updates (DeepSpeed's fp32 partitions)
- gradients: the model's and the master copy's
- optimizer_states: Adam's moments (and step counters)
- communication_buffers: DeepSpeed's gradient reduce buckets; DDP's gradient buckets when
  they are a copy (C++ tensors no Python object holds: sized from DDP's own logging data;
  none under the recipes, whose gradients are views into them)
- other_tensors: everything else alive (buffers such as RoPE tables, the batch, ...)

`activations` are the tensors the first micro-batch's forward with gradients saves for backward (a
saved-tensors hook; parameters excluded, autocast's low-precision weight copies
included), counted at the end of that forward. Not under pp.yaml (None there): the model's
first call runs the whole window's schedule, forward and backward, so the hook would keep every
micro-batch's saved tensors to the window's end, and the tensors it holds would keep alive the
graph of the first stage's shape-inference forward, which no backward frees (seen at 101M: 104 MB
more on the first stage's rank at the first step, held for the whole run). Beside them: the process's resident set
now and its peak (what the OS charges on CPU), and on a GPU torch's allocator figures.
The account goes to run.json ("memory_per_rank") and to a metrics.jsonl row.
"""

from __future__ import annotations

import gc
import warnings
from collections import defaultdict

import torch

from common.launch.internals import (
    ddp_bucket_bytes,
    innermost_optimizer,
    zero3_flat_master_groups,
    zero3_partition,
    zero_attribute_category,
    zero_optimizer,
)


CATEGORIES = (
    "parameters",
    "master_weights",
    "gradients",
    "optimizer_states",
    "communication_buffers",
    "other_tensors",
)
MODEL_STATE = ("parameters", "master_weights", "gradients", "optimizer_states")
MB = 2**20


def _local(tensor):
    """The plain tensor that holds a tensor's memory on this rank: a DTensor's (FSDP2, tensor parallel) part, the
    weight inside a wrapper subclass (torchao's float8 training weights under mixed_precision fp8, found through
    torch's __tensor_flatten__ protocol), any other tensor itself."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    if hasattr(tensor, "__tensor_flatten__"):
        inner, _ = tensor.__tensor_flatten__()  # the attribute names of the tensors it wraps, data first
        return _local(getattr(tensor, inner[0]))
    return tensor


class _Tally:
    """Bytes by category and dtype, each storage counted once."""

    def __init__(self):
        self.seen: set = set()
        self.bytes = defaultdict(lambda: defaultdict(int))

    def claim(self, category: str, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        tensor = _local(tensor)
        try:
            storage = tensor.untyped_storage()
            key = (tensor.device.type, tensor.device.index, storage.data_ptr())
        except (RuntimeError, NotImplementedError):  # a compiler's fake tensor (--torch_compile): no memory
            return
        if storage.nbytes() == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.bytes[category][str(tensor.dtype).replace("torch.", "")] += storage.nbytes()

    def claim_all(self, category: str, value, depth: int = 3) -> None:
        """Tensors in `value` and in the lists, tuples and dicts it holds (to `depth`)."""
        if isinstance(value, torch.Tensor):
            self.claim(category, value)
        elif depth and isinstance(value, (list, tuple)):
            for item in value:
                self.claim_all(category, item, depth - 1)
        elif depth and isinstance(value, dict):
            for item in value.values():
                self.claim_all(category, item, depth - 1)


_phases: dict = {}


def mark(phase: str) -> None:
    """Note this process's memory as a run passes a phase (started, model_built, prepared):
    the account reports each, so start-up and the model build show beside training."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else None
    _phases[phase] = {key: None if value is None else round(value, 1) for key, value in current_memory(device).items()}


def current_memory(device) -> dict:
    """The process's resident set now and at its peak (MB); on a GPU also torch's allocator."""
    status = {}
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    status[key] = int(value.split()[0]) / 1024
    except OSError:  # no /proc (macOS): the peak only, from getrusage (bytes there, KB on Linux)
        import resource

        status["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    figures = {"rss_mb": status.get("VmRSS"), "peak_rss_mb": status.get("VmHWM")}
    if getattr(device, "type", "") == "cuda":
        figures.update(
            allocated_mb=torch.cuda.memory_allocated(device) / MB,
            peak_allocated_mb=torch.cuda.max_memory_allocated(device) / MB,
            reserved_mb=torch.cuda.memory_reserved(device) / MB,
        )
    return figures


class MemoryAccount:
    """Counts this rank's memory once, at its first optimizer step (see the module docstring)."""

    def __init__(self, model, optimizer, device, count_activations: bool = True):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.report: dict | None = None
        self.activation_bytes: int | None = None
        self._saved: list = []
        self._saving = None
        self._hooks = [innermost_optimizer(optimizer).register_step_post_hook(self._after_step)]
        if count_activations:
            self._hooks += [
                model.register_forward_pre_hook(self._start_saving),
                model.register_forward_hook(self._stop_saving),
            ]

    def _start_saving(self, module, args):
        # (a forward without gradients saves nothing: GRPO's scoring of its rollout before the first step)
        if self.activation_bytes is None and self._saving is None and module.training and torch.is_grad_enabled():
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
            self._saving.__enter__()

    def _pack(self, tensor):
        self._saved.append(tensor)
        return tensor

    def _stop_saving(self, module, args, output):
        if self._saving is None:
            return
        self._saving.__exit__(None, None, None)
        self._saving = None
        weights = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        counted, total = set(), 0
        for tensor in self._saved:
            storage = _local(tensor).untyped_storage()  # FSDP2 frees unsharded weights after forward: nbytes 0
            if storage.data_ptr() not in weights and storage.data_ptr() not in counted:
                counted.add(storage.data_ptr())
                total += storage.nbytes()
        self._saved.clear()
        self.activation_bytes = total
        for hook in self._hooks[1:]:
            hook.remove()

    def _after_step(self, inner, args, kwargs):
        groups = zero3_flat_master_groups(self.optimizer)
        if groups and not any(p is groups[-1] for group in inner.param_groups for p in group["params"]):
            return  # ZeRO-3 steps its sub-groups one at a time: count after the last
        self._hooks[0].remove()
        mark("first_step")
        self.report = {**self.count(inner), "phases": dict(_phases)}

    def count(self, inner) -> dict:
        tally = _Tally()
        model = self.model
        for parameter in model.parameters():
            tally.claim("parameters", zero3_partition(parameter))
            tally.claim("parameters", parameter)
        for group in inner.param_groups:
            for parameter in group["params"]:
                tally.claim("master_weights", parameter)
        for parameter in model.parameters():
            tally.claim("gradients", parameter.grad)
        zero = zero_optimizer(self.optimizer)
        flat_groups = zero3_flat_master_groups(self.optimizer)  # ZeRO-3's, stepped one at a time
        for parameter in [p for group in inner.param_groups for p in group["params"]] + flat_groups:
            tally.claim("gradients", parameter.grad)
        tally.claim_all("optimizer_states", list(inner.state.values()))
        if zero is not None:
            for attribute, value in vars(zero).items():
                tally.claim_all(zero_attribute_category(attribute), value)
        buckets = ddp_bucket_bytes(model)
        if buckets:  # in the gradients' dtype
            tally.bytes["communication_buffers"][str(next(model.parameters()).dtype).replace("torch.", "")] += buckets
        alive = gc.get_objects()
        for value in alive:  # DeepSpeed's bucket objects (ZeRO-3's IPGBucketZ3, ...) wherever held
            if "bucket" in type(value).__name__.lower() and hasattr(value, "__dict__"):
                tally.claim_all("communication_buffers", vars(value))
        with warnings.catch_warnings():  # isinstance on torch's deprecated `reduce_op` object warns
            warnings.simplefilter("ignore", FutureWarning)
            for value in alive:
                try:
                    is_tensor = isinstance(value, torch.Tensor)
                except ReferenceError:  # a weak proxy (the compiler keeps some) whose object is gone
                    continue
                if is_tensor:
                    tally.claim("other_tensors", value)
        return self._summary(tally)

    def _summary(self, tally: _Tally) -> dict:
        by_dtype = {
            category: {dtype: n for dtype, n in sorted(tally.bytes[category].items()) if n} for category in CATEGORIES
        }
        totals = {category: sum(tally.bytes[category].values()) / MB for category in CATEGORIES}
        return {
            "bytes_by_category": by_dtype,
            **{f"{category}_mb": round(total, 1) for category, total in totals.items()},
            "model_state_mb": round(sum(totals[c] for c in MODEL_STATE), 1),
            "tensors_mb": round(sum(totals.values()), 1),
            "activations_mb": None if self.activation_bytes is None else round(self.activation_bytes / MB, 1),
            "activation_bytes": self.activation_bytes,
            **{key: None if value is None else round(value, 1) for key, value in current_memory(self.device).items()},
        }
