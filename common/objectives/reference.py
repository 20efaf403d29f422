"""The reference model of preference tuning, held the way the policy is, under every config.

Its adapters switched off, a frozen copy sharded by the same strategy, or its log-probabilities
computed once before training:

    reference = build_reference(model_args, tokenizer, args, use_peft, precompute)   # before prepare
    reference.prepare(run, model, datasets, collate, batch_size)                    # after prepare
    reference.score_before_training()                                                # after run.begin
    chosen, rejected = reference.log_probs(batch, "train")

* `adapters_off` (--use_peft): the policy itself with its LoRA adapters disabled; no second copy.
  With --adapter_name_or_path (the policy trains that adapter on: DPO after a LoRA SFT) the reference
  is base + that adapter, frozen: a `model`.
* `model`: a second model loaded as the policy was (same weights, same seed), frozen, with no
  optimizer state: sharded with FSDP2 under FSDP, partitioned by DeepSpeed ZeRO-3 (with the
  config's parameter offload) under ZeRO-3, whole on every rank otherwise (DDP, ZeRO-1/2: as the
  policy's weights are there).
* `precomputed` (--precompute_ref_log_probs): before the first step the policy, which is then the
  reference, scores every train and held-out pair once; the table is written to
  output_dir/reference_log_probs.pt, and a resumed run reads it instead of computing it again.
"""

from __future__ import annotations

import copy
import hashlib
import os
import time

import numpy as np
import torch
from accelerate.utils import DistributedType, gather_object
from torch.utils.data import DataLoader

from common.launch import mesh
from common.launch.accelerator import unwrap
from common.launch.errors import UsageError
from common.launch.internals import context_parallel_hooks
from common.models.loading import load_model
from common.objectives.dpo import completion_log_probs
from common.outputs.run_dir import REFERENCE_TABLE
from common.parallel import expert_parallel, sequence_parallel
from common.parallel.shards import local_parameter_shards


class Reference:
    def __init__(self, kind: str, model=None):
        self.kind, self.model = kind, model
        self.accelerator = self.policy = self.path = None
        self.loaders, self.tables, self.fingerprints, self.fsdp_units = {}, {}, {}, []

    @property
    def forwards_per_batch(self) -> int:
        """Forward passes of a reference model over each training batch: the FLOPs the train lines add."""
        return 0 if self.kind == "precomputed" else 1

    def prepare(self, run, policy, datasets: dict, collate, batch_size: int) -> None:
        """After the policy's `accelerator.prepare` (`run`: common.run.Run): shard the copy like the
        policy; or make the unshuffled loaders the precomputation reads (prepared in every run alike,
        so that a checkpoint's data-loader states line up) and, resuming, read the run's table, before
        anything of the run is touched: one computed for other pairs is refused in one line."""
        self.accelerator, self.policy = run.accelerator, policy
        if self.kind == "adapters_off":
            self.peft_model = unwrap(run.accelerator, policy)
        elif self.kind == "model":
            from torch.distributed.fsdp import FSDPModule

            self.model = shard_like_policy(run.accelerator, self.model)
            self.fsdp_units = [module for module in self.model.modules() if isinstance(module, FSDPModule)]
        else:
            self.loaders = {
                split: run.accelerator.prepare_data_loader(
                    DataLoader(dataset, batch_size=batch_size, collate_fn=collate)
                )
                for split, dataset in datasets.items()
            }
            self.path = os.path.join(run.args.output_dir, REFERENCE_TABLE)
            self.fingerprints = {split: fingerprint(dataset) for split, dataset in datasets.items()}
            if run.checkpoint is not None:
                self.tables = self._read(run.checkpoint)

    def _read(self, checkpoint: str) -> dict:
        if not os.path.exists(self.path):
            raise UsageError(
                f"the run resumes from {checkpoint} but its reference log-probs ({self.path}) are gone, "
                "and the model is no longer the reference; restore the file or start afresh with "
                "--overwrite_output_dir"
            )
        saved = torch.load(self.path)
        changed = [
            split
            for split in self.fingerprints
            if saved.get("fingerprints", {}).get(split) != self.fingerprints[split]
        ]
        if changed:
            raise UsageError(
                f"{self.path} holds the reference log-probs of other {' and '.join(changed)} pairs than "
                "this run's (the data, tokenizer or lengths changed since they were computed); resume "
                "with the run's own data, or start afresh with --overwrite_output_dir"
            )
        return {split: saved[split] for split in self.fingerprints}

    def record(self) -> dict:
        """What run.json says of it: the kind, and the bytes its weights take on each rank (every rank calls it)."""
        held = 0
        if self.kind == "model":
            held = sum(t.numel() * t.element_size() for t in local_parameter_shards(self.model))
        return {"kind": self.kind, "parameter_bytes_per_rank": gather_object([held])}

    def score_before_training(self) -> None:
        """--precompute_ref_log_probs in a fresh run, after run.begin: the policy scores every pair
        once and the table is written to output_dir (every rank calls it)."""
        if self.kind != "precomputed" or self.tables:
            return
        started = time.perf_counter()
        counts = " and ".join(f"{len(loader.dataset)} {split}" for split, loader in self.loaders.items())
        self.accelerator.print(f"scoring {counts} pairs with the reference once (--precompute_ref_log_probs)")
        self.tables = {split: self._score(loader) for split, loader in self.loaders.items()}
        self.accelerator.print(f"reference log-probs written to {self.path} in {time.perf_counter() - started:.1f} s")
        if self.accelerator.is_main_process:
            torch.save({**self.tables, "fingerprints": self.fingerprints}, self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)
        self.accelerator.wait_for_everyone()

    @torch.no_grad()
    def _score(self, loader) -> torch.Tensor:
        """(rows, 2) summed log-probs of chosen and rejected by the pair's index; NaN for a dropped row."""
        self.policy.eval()
        indices, scores = [], []
        for batch in loader:
            with self.accelerator.autocast():
                chosen, rejected = completion_log_probs(self.policy, batch)
            index, pair = mesh.gather_for_metrics(
                self.accelerator, (batch["index"], torch.stack([chosen, rejected], 1))
            )
            indices.append(index.cpu())
            scores.append(pair.float().cpu())
        self.policy.train()
        index, pair = torch.cat(indices), torch.cat(scores)
        table = torch.full((max(loader.dataset["index"]) + 1, 2), float("nan"))
        table[index] = pair
        return table

    def log_probs(self, batch: dict, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (chosen, rejected) summed log-probs for a batch of pairs, without gradients."""
        if self.kind == "precomputed":
            pair = self.tables[split][batch["index"].cpu()]
            if torch.isnan(pair).any():  # a row the table was not computed for: never trained on with NaN
                raise RuntimeError(
                    f"{self.path} has no reference log-probs for {split} rows "
                    f"{batch['index'][torch.isnan(pair[:, 0])].tolist()}"
                )
            pair = pair.to(batch["input_ids"].device)
            return pair[:, 0], pair[:, 1]
        return self.apply(completion_log_probs, batch)

    def apply(self, function, batch: dict):
        """`function(model, batch)` with the reference's weights, without gradients (GRPO's per-token log-probs)."""
        with torch.no_grad(), self.accelerator.autocast():
            if self.kind == "model":
                with sequence_parallel.exchanging(self.model, batch):  # a Ulysses slice: its train-mode forward
                    scores = function(self.model, batch)
                for unit in self.fsdp_units:  # FSDP2 keeps its last group (norm, lm_head) gathered after a forward
                    unit.reshard()
                return scores
            with self.peft_model.disable_adapter():
                return function(self.policy, batch)


def fingerprint(dataset) -> str:
    """A digest of a split's tokenized pairs (each row's index, tokens and labels), so that a table
    computed for other pairs is never read for these."""
    digest = hashlib.sha256(np.asarray(dataset["index"], dtype=np.int64).tobytes())  # the rows kept, as selected
    for column in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"):
        data = dataset.data.column(column).combine_chunks()
        values = data.flatten() if hasattr(data, "flatten") else data
        digest.update(column.encode())
        digest.update(values.to_numpy(zero_copy_only=False).tobytes())
        if hasattr(data, "offsets"):
            digest.update(data.offsets.to_numpy().tobytes())
    return digest.hexdigest()


def disable_dropout(model) -> None:
    """Dropout off everywhere: nn.Dropout modules (LoRA's too) and the attention dropout that models
    such as Llama keep as a probability. DPO's policy, which trains, then scores a pair as its
    frozen reference does, so that the two start equal (TRL's disable_dropout)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def build_reference(model_args, tokenizer, args, use_peft: bool, precompute: bool) -> Reference:
    """Before `accelerator.prepare`: the reference for this run (`Reference`'s kinds); a copy
    is loaded now, the same way and with the same seed as the policy, so that it starts equal to it."""
    if precompute:
        return Reference("precomputed")
    if use_peft and not model_args.adapter_name_or_path:
        return Reference("adapters_off")
    # without --use_peft, or with an adapter the policy trains on (DPO after a LoRA SFT): the reference is
    # what the policy starts from, base + that adapter, frozen (load_model loads it so); its adapters off
    # would be the bare base
    model = load_model(model_args, tokenizer, args.seed, args)
    model.requires_grad_(False)
    disable_dropout(model)  # frozen: never dropped out, also where a forward runs in train mode (exchanging)
    return Reference("model", model.eval())


def shard_like_policy(accelerator, model):
    """A frozen model placed as the policy is: FSDP2's shards, a ZeRO-3 partition (DeepSpeed
    without an optimizer, the stage-3 settings and parameter offload of the run's config; ZeRO-1/2
    shard only optimizer state and gradients, so their reference is whole: stage 0), or the device. Under
    mixed_precision fp8 its linear layers become float8 first, as accelerate's prepare made the policy's: the
    reference then scores as the policy computes (equal to it before the first step)."""
    handler = accelerator.ao_recipe_handler if accelerator.fp8_enabled else None
    if handler is not None:
        from accelerate.utils.ao import convert_model_to_fp8_ao

        convert_model_to_fp8_ao(model, config=handler.config, module_filter_func=handler.module_filter_func)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        import deepspeed

        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        # never trains: no optimizer, and no batch to check (accelerate's counts a Ulysses group as one rank, which a
        # second engine without the policy's sequence-parallel groups would not)
        for key in ("optimizer", "scheduler", "train_batch_size"):
            config.pop(key, None)
        zero = config.setdefault("zero_optimization", {})
        zero.pop("offload_optimizer", None)
        if zero.get("stage", 0) != 3:
            zero["stage"] = 0
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeed's returns None
        return engine
    if accelerator.distributed_type == DistributedType.FSDP:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        if mesh.context_shards(accelerator) > 1:  # fsdp_cp.yaml: its attention as the policy's (prepare's hooks)
            context_parallel_hooks(model)
        plugin = accelerator.state.fsdp_plugin  # frozen: no backward would reshard what a forward gathered
        kept, plugin.reshard_after_forward = plugin.reshard_after_forward, True
        try:
            prepared = fsdp2_prepare_model(accelerator, model).eval()
        finally:
            plugin.reshard_after_forward = kept
        expert_parallel.reshard_experts_after_forward(prepared)  # fsdp_ep.yaml's, sharded as the model loaded
        return prepared
    return model.to(accelerator.device)
