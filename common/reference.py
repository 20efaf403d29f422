"""The reference model of preference tuning, held the way the policy is, under every config.

Its adapters switched off, a frozen copy sharded by the same strategy, or its log-probabilities
computed once before training:

    reference = build_reference(model_args, tokenizer, args, use_peft, precompute)   # before prepare
    reference.prepare(accelerator, model, datasets, collate, batch_size)            # after prepare
    reference.load_or_compute(output_dir, step)                                      # after run.begin
    chosen, rejected = reference.log_probs(batch, "train")

* `adapters_off` (--use_peft): the policy itself with its LoRA adapters disabled; no second copy.
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
import os

import torch
from accelerate.utils import DistributedType, gather_object
from torch.utils.data import DataLoader

from common.accelerator import unwrap
from common.dpo import completion_log_probs
from common.errors import UsageError
from common.model import load_model, local_parameter_shards
from common.run_dir import REFERENCE_TABLE


class Reference:
    def __init__(self, kind: str, model=None):
        self.kind, self.model = kind, model
        self.accelerator = self.policy = None
        self.loaders, self.tables = {}, {}

    def prepare(self, accelerator, policy, datasets: dict, collate, batch_size: int) -> None:
        """After the policy's `accelerator.prepare`: shard the copy like the policy, or make the
        unshuffled loaders the precomputation reads (prepared here in every run alike, so that a
        checkpoint's data-loader states line up)."""
        self.accelerator, self.policy = accelerator, policy
        if self.kind == "adapters_off":
            self.peft_model = unwrap(accelerator, policy)
        elif self.kind == "model":
            self.model = shard_like_policy(accelerator, self.model)
        else:
            self.loaders = {split: accelerator.prepare_data_loader(DataLoader(dataset, batch_size=batch_size,
                                                                              collate_fn=collate))
                            for split, dataset in datasets.items()}

    def record(self) -> dict:
        """What run.json says of it: the kind, and the memory its weights take per rank (every rank calls it)."""
        megabytes = 0.0
        if self.kind == "model":
            megabytes = sum(t.numel() * t.element_size() for t in local_parameter_shards(self.model)) / 2**20
        return {"kind": self.kind, "parameter_mb_per_rank": [round(mb, 1) for mb in gather_object([megabytes])]}

    def load_or_compute(self, output_dir: str, step: int) -> None:
        """--precompute_ref_log_probs: read the run's table, or compute it at step 0 (every rank calls it)."""
        if self.kind != "precomputed":
            return
        path = os.path.join(output_dir, REFERENCE_TABLE)
        if os.path.exists(path):
            self.tables = torch.load(path)
            for split, loader in self.loaders.items():
                if self.tables.get(split) is None or len(self.tables[split]) <= max(loader.dataset["index"]):
                    raise UsageError(f"{path} does not hold the reference log-probs of this run's {split} pairs (the "
                                     "data changed since it was computed); start the run afresh with "
                                     "--overwrite_output_dir")
            return
        if step > 0:
            raise UsageError(f"the run resumed at step {step} but its reference log-probs ({path}) are gone, and the "
                             "model is no longer the reference; restore the file or start afresh with "
                             "--overwrite_output_dir")
        self.tables = {split: self._score(loader) for split, loader in self.loaders.items()}
        if self.accelerator.is_main_process:
            torch.save(self.tables, path + ".tmp")
            os.replace(path + ".tmp", path)
        self.accelerator.wait_for_everyone()

    @torch.no_grad()
    def _score(self, loader) -> torch.Tensor:
        """(rows, 2) summed log-probs of chosen and rejected by the pair's index; NaN for a dropped row."""
        self.policy.eval()
        indices, scores = [], []
        for batch in loader:
            with self.accelerator.autocast():
                chosen, rejected = completion_log_probs(self.policy, batch)
            index, pair = self.accelerator.gather_for_metrics((batch["index"], torch.stack([chosen, rejected], 1)))
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
            pair = self.tables[split][batch["index"].cpu()].to(batch["input_ids"].device)
            return pair[:, 0], pair[:, 1]
        with torch.no_grad(), self.accelerator.autocast():
            if self.kind == "model":
                return completion_log_probs(self.model, batch)
            with self.peft_model.disable_adapter():
                return completion_log_probs(self.policy, batch)


def build_reference(model_args, tokenizer, args, use_peft: bool, precompute: bool) -> Reference:
    """Before `accelerator.prepare`: the reference for this run (`Reference`'s kinds); a copy
    is loaded now, the same way and with the same seed as the policy, so that it starts equal to it."""
    if precompute:
        return Reference("precomputed")
    if use_peft:
        return Reference("adapters_off")
    model = load_model(model_args, tokenizer, args.seed, args)
    model.requires_grad_(False)
    return Reference("model", model.eval())


def shard_like_policy(accelerator, model):
    """A frozen model placed as the policy is: FSDP2's shards, a ZeRO-3 partition (DeepSpeed
    without an optimizer, the stage-3 settings and parameter offload of the run's config; ZeRO-1/2
    shard only optimizer state and gradients, so their reference is whole: stage 0), or the device."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        import deepspeed

        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
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

        return fsdp2_prepare_model(accelerator, model).eval()
    return model.to(accelerator.device)
