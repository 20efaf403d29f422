"""Pipeline parallelism from the config (pp.yaml): the decoder split into stages by layers, run by a schedule.

accelerate has no pipeline parallelism for training, so this module is all of it. The config's
`parallelism_config` block carries `parallelism_config_pp_size` and `parallelism_config_pp_schedule`
beside accelerate's own sizes; accelerate's launcher accepts them there but exports only the sizes it
knows, so common.launch.mesh reads them from the file the launch was given (docs/strategies.md says why).

* The split (torchtitan's rule, `stage_layers`): the embeddings and the final norm with the head each count
  as one layer of work, and the stages get as even a share as that allows; a model's stages follow its
  `base_model_pp_plan` (embed_tokens, layers, norm). Each rank keeps its stages' modules in the model itself,
  under their names in the whole model (`model.layers.5...`), so checkpoints are the whole model's keys.
* The loop: `PipelineAccelerator.prepare` wraps the rank's share of the model in a `PipelineModel`. The
  recipes' loop is unchanged: `common.training.loop.TrainBatches` hands each optimizer step's window of
  micro-batches to `begin_window`, and the window's first `model(**batch)` runs the schedule (GPipe, 1F1B,
  or interleaved 1F1B with two stages per rank) forward and backward over all of them; each call then
  returns its micro-batch's loss, the same value on every stage, and `accelerator.backward` has nothing left
  to do. Only the first stage reads the inputs and only the last computes the loss.
* The numbers: each micro-batch's loss is its summed token loss over the global batch's label tokens
  (the schedule's own scaling off), gradients are summed over the data-parallel replicas of a stage, the
  clipping norm is taken over every stage, and the losses every rank records (for the non-finite guard
  and the logs) are the last stage's, sent to the others.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator

from common.launch import mesh
from common.launch.errors import UsageError
from common.launch.internals import module_view
from common.launch.mesh import PipelineSettings


# schedules kept, one per micro-batch shape: each keeps its stages' receive buffers, shaped once, so padded batches
# of many lengths would hold a set for each; one set, as make estimate-memory counts (a new shape builds anew)
KEPT_SCHEDULES = 1


def whole_rounds(micro_batches: int, size: int) -> bool:
    """Whether torch's Interleaved1F1B runs this many micro-batches on `size` ranks: whole rounds of them."""
    return micro_batches % max(1, micro_batches // size) == 0


@functools.cache
def schedule_keeps_outputs() -> bool:
    """Whether torch's schedules keep the last stage's logits of every micro-batch to the window's end and merge
    them into one more copy: torch before `step(return_outputs=False)`, which common.parallel.pipeline passes (it reads
    only the losses, computed inside the schedule)."""
    import inspect

    from torch.distributed.pipelining import ScheduleGPipe

    return "return_outputs" not in inspect.signature(ScheduleGPipe.step).parameters


def stage_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Decoder layer indices of each stage, torchtitan's rule: the embeddings and the final norm with the head
    each weigh one layer, and the num_layers + 2 units are dealt out as evenly as they go (the first stages one
    more where they do not divide), the first stage's share holding the embeddings and the last's the head."""
    if num_stages > num_layers:
        raise UsageError(
            f"{num_stages} pipeline stages but the model has {num_layers} decoder layers: every stage before the "
            "last needs at least one (the last may hold the norm and head alone); lower parallelism_config_pp_size, "
            "or use a schedule with one stage per rank (1F1B, GPipe)"
        )
    if num_stages == 1:
        return [list(range(num_layers))]
    per_stage, extra = divmod(num_layers + 2, num_stages)
    shares = [per_stage + (1 if stage < extra else 0) for stage in range(num_stages)]
    shares[0] -= 1  # the embeddings' unit
    shares[-1] = num_layers - sum(shares[:-1])  # the rest, beside the norm and head
    layers, start = [], 0
    for share in shares:
        layers.append(list(range(start, start + share)))
        start += share
    return layers


def model_problems(model, settings: PipelineSettings) -> list[str]:
    """Why `model` (real or on the meta device) cannot be split into `settings`' stages, one line each."""
    config, name = model.config, type(model).__name__
    if not splits(config.model_type) or not hasattr(model, HEAD) or model.base_model is model:
        return [
            f"pipeline parallelism splits the causal LMs checked here through their own forward (Llama, Qwen2/3, "
            f"Mistral, Mixtral, Gemma 1-3, Phi-3, OLMo, ...: common.parallel.pipeline.SPLITS), and {name} "
            f"({config.model_type}) is not one; use ddp.yaml, fsdp.yaml or zero3.yaml"
        ]
    if getattr(config.get_text_config(), "output_router_logits", False):
        return [
            f"{name}'s router load-balancing loss (output_router_logits) is taken over every layer's routing at "
            "once, which no pipeline stage holds; train it without (--output_router_logits false) or under ddp.yaml, "
            "fsdp.yaml, zero3.yaml or tp.yaml"
        ]
    if settings.num_stages > config.num_hidden_layers:
        return [
            f"{settings.num_stages} pipeline stages ({settings.size} ranks x {settings.stages_per_rank} under "
            f"{settings.schedule}) but the model has {config.num_hidden_layers} decoder layers: every stage before "
            "the last needs at least one (the last may hold the norm and head alone); lower "
            "parallelism_config_pp_size or use a one-stage-per-rank schedule (1F1B, GPipe)"
        ]
    return []


def splits(model_type: str) -> bool:
    """Whether a model of `model_type` is one the stages are cut from (SPLITS), its config class declaring the plan."""
    from transformers import CONFIG_MAPPING

    known = CONFIG_MAPPING[model_type] if model_type in SPLITS and model_type in CONFIG_MAPPING else None
    return known is not None and tuple(getattr(known, "base_model_pp_plan", None) or ()) == PLAN


def check_arguments(arguments: tuple) -> None:
    """What a pipeline-parallel run cannot do, refused before anything is built."""
    for args in arguments:
        if getattr(args, "scores_whole_rows", None):
            raise UsageError(
                f"pipeline parallelism (parallelism_config_pp_size) runs the next-token loss of causal_lm.py and "
                f"sft.py in its schedule, while this recipe scores {args.scores_whole_rows}: use ddp.yaml, fsdp.yaml "
                "or zero3.yaml"
            )
        for flag, why in {
            "use_peft": "LoRA's frozen base and adapters are not split into stages here",
            "adapter_name_or_path": "an adapter on top is not split into stages here; merge it first",
            "packing": "a packed row's per-example attention is not carried between stages; pass --packing false",
            "streaming": "a pipeline's ranks must read the same batches; leave out --streaming",
            "auto_find_batch_size": "its trial steps run outside the schedule; set --per_device_train_batch_size",
            "torch_compile": "the stages are not compiled here; leave out --torch_compile",
            "use_liger_kernel": "Liger patches the modules a stage replaces (the final norm, the head's loss); leave "
            "it out",
        }.items():
            value = getattr(args, flag, None)
            if value not in (None, False, "", "false"):
                raise UsageError(f"--{flag} under pipeline parallelism: {why}")
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp16":
        raise UsageError(
            "mixed_precision fp16 under pipeline parallelism: torch's schedule runs the backward, where "
            "accelerate's loss scaling does not reach; use bf16 (or no)"
        )
    settings = mesh.launched_pipeline()
    m = next(
        (args.gradient_accumulation_steps for args in arguments if hasattr(args, "gradient_accumulation_steps")), 1
    )
    if settings and settings.schedule == "Interleaved1F1B" and not whole_rounds(m, settings.size):
        runs = [n for n in range(max(1, m - settings.size), m + settings.size + 1) if whole_rounds(n, settings.size)]
        raise UsageError(
            f"--gradient_accumulation_steps {m} under Interleaved1F1B on {settings.size} stages: torch's schedule "
            f"runs whole rounds of micro-batches (a multiple of max(1, m // {settings.size})); use one of "
            f"{', '.join(map(str, runs))}, or the 1F1B schedule"
        )


def enabled(accelerator) -> bool:
    return isinstance(accelerator, PipelineAccelerator)


# the base model's parts a stage keeps or leaves (transformers' base_model_pp_plan names them: embeddings, layers, norm)
PLAN = ("embed_tokens", "layers", "norm")
HEAD = "lm_head"  # the causal LM's head, kept by the last stage
# the decoders whose stages run through their own forward, each split exactly in tests/test_pipeline.py: their base
# model's forward does nothing to the hidden states between the embeddings and the first layer (Granite scales them
# and Starcoder2 drops out there, which every later stage would repeat), and they declare the plan above
SPLITS = (
    "apertus", "arcee", "cohere", "ernie4_5", "exaone4", "gemma", "gemma2", "gemma3_text", "glm4", "helium", "llama",
    "ministral", "mistral", "mixtral", "olmo", "olmo2", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3",
)  # fmt: skip


def tied_embeddings(model) -> bool:
    """Whether the head is the embeddings' weight: seen where the model holds both, else its config's word."""
    head, embeddings = getattr(model, HEAD, None), getattr(model.base_model, PLAN[0])
    if head is not None and embeddings is not None:
        return head.weight is embeddings.weight
    return bool(getattr(model.config, "tie_word_embeddings", False))


class Skipped(torch.nn.Module):
    """A decoder layer another stage runs: the hidden states pass through it unchanged, so the model's own forward
    keeps each layer's index (Gemma's and Qwen3's pick a layer's mask by it)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class StageModule(torch.nn.Module):
    """One stage, run through the model's own forward: the base model's with the decoder layers of other stages
    passed through (`Skipped`), the embeddings on the first stage only (the others take hidden states as
    `inputs_embeds`) and the final norm on the last; the last stage runs the causal LM's forward (its head, and any
    logit soft-capping the model has) over it."""

    def __init__(self, model, layers: list[int], first: bool, last: bool):
        super().__init__()
        base, (embeddings, decoder, norm) = model.base_model, PLAN
        mine = set(layers)
        kept = torch.nn.ModuleList(
            [layer if index in mine else Skipped() for index, layer in enumerate(getattr(base, decoder))]
        )
        self.first, self.last = first, last
        self.base = module_view(
            base,
            **{
                embeddings: getattr(base, embeddings) if first else None,
                decoder: kept,
                norm: getattr(base, norm) if last else torch.nn.Identity(),
            },
        )
        self.causal = module_view(model, **{model.base_model_prefix: self.base}) if last else None

    def forward(self, hidden, attention_mask=None):
        inputs = {"input_ids" if self.first else "inputs_embeds": hidden}
        if self.last:
            return self.causal(**inputs, attention_mask=attention_mask, use_cache=False).logits
        return self.base(**inputs, attention_mask=attention_mask, use_cache=False).last_hidden_state


def keep_stages(model, layers_per_stage: list[list[int]], stages: list[int]) -> None:
    """Drop from `model` (in place) what the rank's `stages` do not run; what stays keeps its name."""
    base, (embeddings, decoder, norm) = model.base_model, PLAN
    kept = {index for stage in stages for index in layers_per_stage[stage]}
    layers = getattr(base, decoder)
    for index in range(len(layers)):
        if index not in kept:
            layers[index] = Skipped()
    if 0 not in stages:
        setattr(base, embeddings, None)
    if len(layers_per_stage) - 1 not in stages:
        setattr(base, norm, None)
        setattr(model, HEAD, None)


def rank_stages(settings: PipelineSettings, rank: int) -> list[int]:
    """The stages pipeline rank `rank` runs: one, or two under Interleaved1F1B (rank, rank + size)."""
    return [rank + settings.size * loop for loop in range(settings.stages_per_rank)]


def safetensors_names(folder: str) -> dict | None:
    """{tensor name: its safetensors file} of a local model folder; None where it has no safetensors files."""
    import json

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as handle:
            return json.load(handle)["weight_map"]
    single = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(single):
        return None
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), "model.safetensors")


def load_stages(auto_class, folder: str, dtype, overrides: dict):
    """Under pp.yaml and dp_pp.yaml, the pretrained model with only this rank's stages: built on the meta device,
    the stages' modules kept, and only their tensors read from the folder's safetensors files (the tied head's
    from the embeddings'). None where that cannot be done here (no pipeline launched, not a local folder of
    safetensors files, a model the pipeline does not split, a name the files lack): the whole model is loaded."""
    settings = mesh.launched_pipeline()
    files = safetensors_names(folder) if settings is not None and os.path.isdir(folder) else None
    if files is None:
        return None
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, **overrides)
    if getattr(config, "quantization_config", None) or (dtype == "auto" and getattr(config, "dtype", None) is None):
        return None  # quantized weights, or a dtype only the files say: transformers' loading knows them
    if dtype == "auto":  # the config's
        dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype
    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) built as usual
        model = auto_class.from_config(config, dtype=dtype)
    if model_problems(model, settings):
        return None  # prepare refuses it in one line
    tied = bool(getattr(config, "tie_word_embeddings", False))  # (a model built on meta is not tied yet)
    layers = stage_layers(config.num_hidden_layers, settings.num_stages)
    keep_stages(model, layers, rank_stages(settings, int(os.environ.get("RANK", "0")) % settings.size))
    buffers = {name for name, _ in model.named_buffers()}
    wanted = {name: name for name in model.state_dict() if name not in buffers}
    if tied and f"{HEAD}.weight" in files:
        return None  # a tied config whose files hold a head of their own: transformers decides whether to untie
    if tied and f"{HEAD}.weight" in wanted:
        wanted[f"{HEAD}.weight"] = f"{model.base_model_prefix}.{PLAN[0]}.weight"
    kept = {name.rsplit(".", 1)[0] for name in wanted}
    unread = [name for name in files if name.rsplit(".", 1)[0] in kept and name not in wanted.values()]
    if unread or any(source not in files for source in wanted.values()):
        return None  # names the model does not have (scales of quantized weights, another layout)
    state = {}
    for file in sorted({files[source] for source in wanted.values()}):
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            for name, source in wanted.items():
                if files[source] == file:
                    state[name] = handle.get_tensor(source).to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if os.path.isfile(os.path.join(folder, "generation_config.json")):  # as from_pretrained reads it
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    if tied and getattr(model, HEAD, None) is not None and getattr(model.base_model, PLAN[0]) is not None:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight  # one weight, as loaded whole
    model.stages_only = True  # run.json says how each rank's share was built (`describe`)
    return model


class PipelineModel(torch.nn.Module):
    """The rank's share of the model (`module`) and its stages, run by the schedule over each window."""

    def __init__(self, module, accelerator: PipelineAccelerator):
        super().__init__()
        settings = accelerator.pipeline
        self.module, self.accelerator, self.settings = module, accelerator, settings
        self.group, self.rank = accelerator.pipeline_group, accelerator.pipeline_rank
        self.layers_per_stage = layers = stage_layers(module.config.num_hidden_layers, settings.num_stages)
        self.tied = tied_embeddings(module)  # one weight on the first stage's rank and the last's
        self.stage_indices = rank_stages(settings, self.rank)
        keep_stages(module, layers, self.stage_indices)
        self.stages = [
            StageModule(module, layers[index], index == 0, index == settings.num_stages - 1)
            for index in self.stage_indices
        ]
        self.last_rank = (settings.num_stages - 1) % settings.size  # holds the last stage
        # tied embeddings: the first stage's copy and the last's each get the sum of both gradients (the same
        # update on both), and the clipping norm counts the weight once, on the first stage
        self.tied_group = accelerator.ends_group() if self.tied else None
        ends = {0, self.last_rank}
        self.tied_weight = (
            (getattr(module.base_model, PLAN[0]) or module.get_output_embeddings()).weight
            if self.tied and self.rank in ends
            else None
        )
        self.counted_once = {id(self.tied_weight)} if self.tied and self.rank == self.last_rank else set()
        self.schedules = {}  # (micro-batches, rows, length) -> its schedule: a stage's buffers have one shape
        self.window, self.losses, self.tokens = None, None, None

    def train(self, mode: bool = True):
        """Training or evaluation mode for the rank's share and its stages' views of it (a list, not submodules)."""
        super().train(mode)
        for stage in self.stages:
            stage.train(mode)
        return self

    def begin_window(self, batches: list, tokens) -> None:
        """The optimizer step's micro-batches, and the label tokens of the global batch counted over every rank."""
        self.window, self.losses = batches, None
        self.tokens = tokens.to(self.accelerator.device) / self.settings.size  # each pipeline's ranks counted it

    def forward(self, **batch):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if not self.training:
            return CausalLMOutputWithPast(logits=self._forward_only(batch))
        index = next((i for i, b in enumerate(self.window or []) if b["input_ids"] is batch["input_ids"]), None)
        if index is None:
            raise RuntimeError(
                "under pipeline parallelism the model trains on a window of micro-batches at a time: iterate "
                "common.training.loop.TrainBatches, which hands each window to the pipeline before its batches"
            )
        if index == 0:
            self._run_window()
        return CausalLMOutputWithPast(loss=self.losses[index])

    def _schedule(self, count: int, rows: int, length: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        key = (count, rows, length)
        if key not in self.schedules:
            if len(self.schedules) >= KEPT_SCHEDULES:  # padded batches of many lengths: drop the oldest's buffers
                self.schedules.pop(next(iter(self.schedules)))
            stages = [
                PipelineStage(stage, index, self.settings.num_stages, self.accelerator.device, group=self.group)
                for stage, index in zip(self.stages, self.stage_indices)
            ]
            kwargs = dict(n_microbatches=count, loss_fn=self._loss, scale_grads=False)
            if self.settings.schedule == "Interleaved1F1B":
                self.schedules[key] = ScheduleInterleaved1F1B(stages, **kwargs)
            else:
                # 1F1B with fewer micro-batches than stages has every forward in its warm-up: GPipe's order, which
                # torch's 1F1B refuses to run
                one_f_one_b = self.settings.schedule == "1F1B" and count >= self.settings.size
                self.schedules[key] = (Schedule1F1B if one_f_one_b else ScheduleGPipe)(stages[0], **kwargs)
        return self.schedules[key]

    def _loss(self, logits, labels):
        """The micro-batch's summed next-token loss over the global batch's label tokens (as transformers'
        ForCausalLMLoss computes it with num_items_in_batch, and accelerate's division by the accumulation)."""
        targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        return loss / self.tokens

    def _run_window(self) -> None:
        window = self.window
        rows = {batch["input_ids"].shape[0] for batch in window}
        if len(rows) > 1:
            raise RuntimeError(f"a window's micro-batches hold {sorted(rows)} rows; the schedule needs one size")
        length = max(batch["input_ids"].shape[1] for batch in window)
        inputs = torch.cat([_pad(batch["input_ids"], length, 0) for batch in window])
        labels = torch.cat([_pad(batch["labels"], length, -100) for batch in window])
        kwargs = {}
        if any("attention_mask" in batch for batch in window) or any(
            batch["input_ids"].shape[1] < length for batch in window
        ):
            kwargs["attention_mask"] = torch.cat(
                [_pad(batch.get("attention_mask", torch.ones_like(batch["input_ids"])), length, 0) for batch in window]
            )
        count = len(window)
        if self.settings.schedule == "Interleaved1F1B":  # an epoch's last window may hold a count torch refuses:
            while not whole_rounds(count, self.settings.size):  # add micro-batches with no label (no loss or
                count += 1  # gradient: every term exactly 0) up to the next count it runs
            filler = count - len(window)
            inputs = torch.cat([inputs, inputs[-rows_of(window) :].repeat(filler, 1)]) if filler else inputs
            labels = torch.cat([labels, torch.full_like(labels[: rows_of(window) * filler], -100)])
            if filler and "attention_mask" in kwargs:
                mask = kwargs["attention_mask"]
                kwargs["attention_mask"] = torch.cat([mask, mask[-rows_of(window) :].repeat(filler, 1)])
        schedule = self._schedule(count, rows.pop(), length)
        losses = []
        first = 0 in self.stage_indices
        if not schedule_keeps_outputs():  # the loss runs inside the schedule: its logits are not needed after it
            kwargs["return_outputs"] = False
        with self.accelerator.autocast():
            schedule.step(*([inputs] if first else []), target=labels, losses=losses, **kwargs)
        self.accelerator.sum_over_replicas(self.module)
        if self.tied_weight is not None and self.tied_weight.grad is not None:
            dist.all_reduce(self.tied_weight.grad, group=self.tied_group)
        # every rank records the micro-batches' losses as DDP's do (summed token loss / num_items_in_batch)
        reported = torch.zeros(len(window), device=self.accelerator.device)
        if self.rank == self.last_rank:
            reported = torch.stack([loss.detach().float() for loss in losses[: len(window)]]) * self.tokens
            reported = reported / torch.stack([torch.as_tensor(b["num_items_in_batch"]).float() for b in window]).to(
                reported.device
            )
        dist.broadcast(reported, group=self.group, group_src=self.last_rank)
        self.losses = list(reported)

    @torch.no_grad()
    def _forward_only(self, batch: dict) -> torch.Tensor:
        """The logits of a batch (an evaluation's), on every rank of the pipeline: each stage in turn, its input
        received from the rank before, the last stage's logits sent to all."""
        kwargs = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}
        hidden = batch["input_ids"]
        with self.accelerator.autocast():
            for index in range(self.settings.num_stages):
                owner, before = index % self.settings.size, (index - 1) % self.settings.size
                if owner != self.rank:
                    continue
                if index > 0 and before != self.rank:
                    hidden = _receive(self.group, before, self.accelerator.device)
                hidden = self.stages[self.stage_indices.index(index)](hidden, **kwargs)
                after = (index + 1) % self.settings.size
                if index < self.settings.num_stages - 1 and after != self.rank:
                    _send(hidden, self.group, after)
        return _broadcast(
            hidden if self.rank == self.last_rank else None, self.group, self.last_rank, self.accelerator.device
        )


def rows_of(window: list) -> int:
    return window[0]["input_ids"].shape[0]


def _pad(tensor: torch.Tensor, length: int, value) -> torch.Tensor:
    return F.pad(tensor, (0, length - tensor.shape[1]), value=value) if tensor.shape[1] < length else tensor


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def _send(tensor: torch.Tensor, group, to: int) -> None:
    header = torch.tensor([DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], dtype=torch.int64)
    dist.send(
        torch.cat([header, torch.zeros(8 - header.numel(), dtype=torch.int64)]).to(tensor.device),
        group=group,
        group_dst=to,
    )
    dist.send(tensor.contiguous(), group=group, group_dst=to)


def _receive(group, source: int, device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=source)
    dtype, dims = DTYPES[int(header[0])], int(header[1])
    tensor = torch.empty([int(size) for size in header[2 : 2 + dims]], dtype=dtype, device=device)
    dist.recv(tensor, group=group, group_src=source)
    return tensor


def _broadcast(tensor, group, source: int, device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.int64, device=device)
    if tensor is not None:
        header[: 2 + tensor.dim()] = torch.tensor([DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape])
    dist.broadcast(header, group=group, group_src=source)
    if tensor is None:
        dims = int(header[1])
        tensor = torch.empty([int(s) for s in header[2 : 2 + dims]], dtype=DTYPES[int(header[0])], device=device)
    dist.broadcast(tensor.contiguous(), group=group, group_src=source)
    return tensor


class PipelineAccelerator(Accelerator):
    """accelerate's Accelerator for a pipeline: the model prepared into its stages (`PipelineModel`), the data
    loaders split over the data-parallel replicas only (a pipeline's ranks read the same batches), `backward`
    left to the schedule, and clipping by the norm over every stage."""

    def __init__(self, pipeline: PipelineSettings | None = None, **kwargs):
        super().__init__(**kwargs)
        pipeline = pipeline or mesh.launched_pipeline()  # the launched config's, by default
        self.pipeline, self.pipeline_model, self.dropout_seeded = pipeline, None, False
        world, size = self.num_processes, pipeline.size
        if world % size:
            raise UsageError(f"parallelism_config_pp_size {size} does not divide the {world} processes launched")
        self.replicas = world // size
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.replicas, size), mesh_dim_names=("dp", "pp"))
        self.pipeline_group, self.replica_group = self.mesh["pp"].get_group(), self.mesh["dp"].get_group()
        self.pipeline_rank = self.process_index % size  # pp innermost: a pipeline's ranks are consecutive
        self.replica_rank = self.process_index // size

    def prepare(self, *objects, device_placement=None):
        """The model into its stages (the optimizers made on the whole model then keep the rank's share of its
        parameters), the rest as accelerate prepares them, in the order given."""
        prepared = []
        for item in objects:
            if isinstance(item, torch.nn.Module):
                problems = model_problems(item, self.pipeline)
                if problems:
                    raise UsageError(problems[0])
                self.pipeline_model = PipelineModel(item, self).to(self.device)
                kept = {id(parameter) for parameter in self.pipeline_model.parameters()}
                for optimizer in (o for o in objects if isinstance(o, torch.optim.Optimizer)):
                    for group in optimizer.param_groups:
                        group["params"] = [parameter for parameter in group["params"] if id(parameter) in kept]
                prepared.append(self.pipeline_model)
            else:
                prepared.append(super().prepare(item) if item is not None else None)
        if self.pipeline_model is not None and self.pipeline_rank and not self.dropout_seeded:
            # each stage its own dropout masks (torchtitan seeds pipeline ranks apart: one seed would repeat stage 0's
            # masks for a micro-batch on every stage): rank r of a pipeline draws from the run's seed + r from here
            # on, rank 0 as one process does. After the loaders: accelerate's sampler takes the seed as it is made
            torch.manual_seed(torch.initial_seed() + self.pipeline_rank)
            self.dropout_seeded = True
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def ends_group(self):
        """The process group of each pipeline's first rank and the rank of its last stage (every rank makes each)."""
        last = (self.pipeline.num_stages - 1) % self.pipeline.size
        mine = None
        for replica in range(self.replicas):
            group = dist.new_group([replica * self.pipeline.size, replica * self.pipeline.size + last])
            mine = group if replica == self.replica_rank else mine
        return mine

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """accelerate's prepared loader over the data-parallel replicas: every rank of a pipeline the same batches."""
        from accelerate.data_loader import prepare_data_loader

        return prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.replicas,
            process_index=self.replica_rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
        )

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        return model.module if isinstance(model, PipelineModel) else super().unwrap_model(model)

    def backward(self, loss, **kwargs) -> None:
        """Nothing: the schedule ran the window's backward when its first micro-batch went forward."""

    def sum_over_replicas(self, module) -> None:
        """Each stage's gradients summed over its data-parallel replicas (the loss is already over the global
        batch's tokens)."""
        if self.replicas == 1:
            return
        for parameter in module.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=self.replica_group)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The gradient norm over every stage (each rank's squared norm summed over the pipeline), the gradients
        scaled to at most `max_norm`; every rank returns the same norm."""
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        parameters = [parameter for parameter in parameters if parameter.grad is not None]
        once = self.pipeline_model.counted_once if self.pipeline_model is not None else set()
        grads = [parameter.grad for parameter in parameters if id(parameter) not in once]
        local = get_total_norm(grads, norm_type) if grads else torch.zeros((), device=self.device)
        squared = local.float().pow(2).reshape(1)
        dist.all_reduce(squared, group=self.pipeline_group)
        norm = squared.sqrt().reshape(())
        if grads:
            clip_grads_with_norm_(parameters, max_norm, norm)
        return norm


def describe(accelerator) -> dict:
    """run.json's `pipeline` under pp.yaml and dp_pp.yaml (nothing otherwise): the settings as read, the file they
    were read from, each stage's rank and decoder layers (the first holds the embeddings, the last the head), and the
    seed each rank of a pipeline draws dropout from. Every rank calls it."""
    model = getattr(accelerator, "pipeline_model", None)
    if model is None:
        return {}
    from accelerate.utils import gather_object

    settings, layers = model.settings, model.layers_per_stage
    seeds = gather_object([torch.initial_seed()])[: settings.size]  # one pipeline's ranks (every rank calls this)
    return {
        "pipeline": {
            "size": settings.size,
            "schedule": settings.schedule,
            "stages_per_rank": settings.stages_per_rank,
            "replicas": accelerator.replicas,
            "config_file": settings.config_file,
            # a pretrained folder of safetensors files: each rank read its stages' tensors alone; otherwise each
            # built the whole model (seeded from a config, or loaded) and kept its stages
            "built": "stages only" if getattr(model.module, "stages_only", False) else "whole, then its stages kept",
            "stages": [{"rank": index % settings.size, "layers": share} for index, share in enumerate(layers)],
            "dropout_seeds": seeds,  # by pipeline rank
        }
    }


def begin_window(accelerator, batches: list, tokens) -> None:
    """Hand an optimizer step's micro-batches to the pipeline (a no-op under every other config)."""
    if isinstance(accelerator, PipelineAccelerator):
        accelerator.pipeline_model.begin_window(batches, tokens)


def count_parameters(accelerator, model) -> dict:
    """run.json's parameter counts: the whole model's under pp.yaml (the stages' summed over a pipeline, a tied
    weight once), the model's own otherwise."""
    from common.parallel.shards import count_parameters as counted

    if not isinstance(model, PipelineModel):
        return counted(model)
    mine = [p for p in model.module.parameters() if id(p) not in model.counted_once]
    sums = torch.tensor(
        [sum(p.numel() for p in mine), sum(p.numel() for p in mine if p.requires_grad)], device=accelerator.device
    )
    dist.all_reduce(sums, group=model.group)
    return {"total_parameters": int(sums[0]), "trainable_parameters": int(sums[1])}


def whole_skeleton(accelerator, model):
    """The whole model's modules on the meta device under pp.yaml (what each rank counts FLOPs by, as a
    tensor-parallel rank counts the whole model's: the counts are summed over ranks, then divided by the ranks
    that share a batch); the model itself otherwise (unwrapped)."""
    if not isinstance(model, PipelineModel):
        from common.launch.accelerator import unwrap

        return unwrap(accelerator, model)
    from accelerate import init_empty_weights

    with init_empty_weights():
        return type(model.module)(model.module.config)


def _whole_on_meta(model):
    """The whole model's modules, its parameters on the meta device, with the run's generation config."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        whole = type(model.module)(model.module.config)
    whole.generation_config = model.module.generation_config
    if model.tied:
        whole.tie_weights()  # one tensor under both names: exported once, as one process's model writes it
    return whole


def whole_tensors(accelerator, model, whole=None, device=None):
    """(name, tensor) of the whole model's state dict, in its order, on every rank of the pipeline: each sent by the
    rank that holds it, one at a time (the export holds one beside its training state). `device`: where each lands
    (the accelerator's by default)."""
    from accelerate.utils import gather_object

    share = model.module.state_dict()
    owners = {}
    for rank, names in enumerate(gather_object([list(share)])):
        for name in names:
            owners.setdefault(name, rank % model.settings.size)
    for name in (whole or _whole_on_meta(model)).state_dict():
        mine = share.get(name) if owners[name] == model.rank else None
        tensor = _broadcast(mine, model.group, owners[name], accelerator.device)
        yield name, tensor if device is None else tensor.to(device)


def export_view(accelerator, model):
    """For the export under pp.yaml: the whole model on the meta device (its config, generation config and layout)
    and its tensors sent one at a time to the CPU, never the whole model on a device."""
    whole = _whole_on_meta(model)
    return whole, whole_tensors(accelerator, model, whole, device="cpu")


def whole_model(accelerator, model):
    """The whole model on every rank of the pipeline, on its device (sft.py's generation): each parameter and buffer
    sent by the rank that holds it; the model itself under any other config (unwrapped)."""
    if not isinstance(model, PipelineModel):
        from common.launch.accelerator import unwrap

        return unwrap(accelerator, model)
    whole = _whole_on_meta(model)
    whole.load_state_dict(dict(whole_tensors(accelerator, model, whole)), assign=True)
    if model.tied:
        whole.tie_weights()  # the head reads the embeddings' weight again, as in the model trained
    return whole.to(accelerator.device).eval()


TIED_HEAD, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"


def tied_head_alias(model) -> dict:
    """{the stage's name: one process's} for the last stage's copy of tied embeddings. One process and FSDP2 keep
    the one tensor's Adam state under the embeddings' name (and one process's whole-model files its weight too),
    where the last stage knows its copy as the head's: it saves and reads them under that name."""
    if isinstance(model, PipelineModel) and model.tied and model.rank == model.last_rank and model.rank != 0:
        return {TIED_HEAD: EMBEDDINGS}
    return {}


def _renamed(moments: dict, names: dict) -> dict:
    """An optimizer state dict (torch's, by parameter name) with parameters renamed."""
    return {
        "state": {names.get(name, name): value for name, value in moments["state"].items()},
        "param_groups": [
            {**group, "params": [names.get(name, name) for name in group["params"]]}
            for group in moments["param_groups"]
        ],
    }


def save_state(accelerator, model, optimizer, scheduler, folder: str) -> None:
    """Every rank: its stages' weights and Adam states (DCP, under the whole model's names, in the folders and keys
    FSDP2 writes), the schedule, and its RNG state. Each parameter group lists every stage's parameters, as one
    process's would (the groups are the same on every stage), so the checkpoint is the whole model's."""
    import torch.distributed.checkpoint as dcp
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import gather_object
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from common.launch.internals import innermost_optimizer

    weights, moments = get_state_dict(model.module, innermost_optimizer(optimizer))
    moments = _renamed(moments, tied_head_alias(model))  # a tied head's Adam state under the embeddings' name
    names = gather_object([[group["params"] for group in moments["param_groups"]]])
    for index, group in enumerate(moments["param_groups"]):
        group["params"] = list(dict.fromkeys(name for rank in names for name in rank[index]))
    dcp.save({"model": weights}, checkpoint_id=os.path.join(folder, "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": moments}, checkpoint_id=os.path.join(folder, "optimizer_0"))
    save_accelerator_state(
        folder, [], [], [scheduler], [], accelerator.process_index, accelerator.step, scaler=accelerator.scaler
    )


def load_state(accelerator, model, optimizer, scheduler, folder: str) -> None:
    """What `save_state` (or FSDP2, or tensor parallelism) wrote, into this rank's stages: each parameter group
    keeps the parameters this rank holds."""
    import torch.distributed.checkpoint as dcp
    from accelerate.checkpointing import load_accelerator_state
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from common.launch.internals import innermost_optimizer

    inner = innermost_optimizer(optimizer)
    weights, moments = get_state_dict(model.module, inner)
    aliases = tied_head_alias(model)
    optimizer_folder = os.path.join(folder, "optimizer_0")
    if (
        aliases
        and f"optimizer.state.{TIED_HEAD}.step"
        in dcp.FileSystemReader(optimizer_folder).read_metadata().state_dict_metadata
    ):
        aliases = {}  # written by an earlier pipeline run, under the head's name
    moments = _renamed(moments, aliases)
    mine = [list(group["params"]) for group in moments["param_groups"]]
    dcp.load({"model": weights}, checkpoint_id=os.path.join(folder, "pytorch_model_fsdp_0"))
    dcp.load({"optimizer": moments}, checkpoint_id=optimizer_folder)
    for group, names in zip(moments["param_groups"], mine):
        group["params"] = names
    moments = _renamed(moments, {checkpoint: name for name, checkpoint in aliases.items()})
    set_state_dict(model.module, inner, model_state_dict=weights, optim_state_dict=moments)
    load_accelerator_state(folder, [], [], [scheduler], [], accelerator.process_index, scaler=accelerator.scaler)
