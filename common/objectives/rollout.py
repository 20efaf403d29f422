"""GRPO's rollouts: the prompts each step samples, their completions, the weights sampled from, the buffer.

The buffer is what a step trains on (saved in a checkpoint when a run stops inside --num_iterations).

Rollouts are a function of (seed, rollout, prompt), not of the number of processes, the config or a restart:
* the prompts: rollout r of an epoch takes the next `prompts per step` of the epoch's permutation (seeded by
  (seed, epoch), over the whole data set); each data-parallel rank takes a contiguous share of them;
* the completions: a rank samples all of its rollout's completions in one decoding call (G copies of each of its
  prompts, left-padded: `sample_rows`), token by token by the inverse of the distribution's CDF (in vocabulary
  order, after --temperature and --top_p) at uniforms drawn from a generator seeded by (seed, rollout, the
  prompt's row), each row its own: `InverseCdfSampler`;
* the weights: every rank samples from a whole, unsharded model: its own where the strategy keeps the weights
  whole (DDP, ZeRO-1/2, one process), else a copy gathered once per rollout (FSDP2, ZeRO-3, tensor parallelism:
  one all-gather per parameter, then generation without collectives, so ranks that stop at different lengths
  never wait on each other): `GenerationWeights`.
So in fp32 the same prompt gets the same completions under every config and on any number of processes, as long
as the weights are equal; where the logits differ by rounding (after steps trained under other strategies, or by
which rows share a decoding call and how much padding they need) a token can change only where the uniform falls
near a boundary of the CDF: each completion counts its draws within 1e-4 (in probability) of one
(`rollout/near_tie_ratio`: the share of completions with any; completions.jsonl has the counts), so a difference
can be told from a fault. In bf16 the rounding is far coarser than 1e-4: a prompt's completions there also depend
on the rows sampled beside it (as with TRL's generate), so on the number of processes.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed
from accelerate.utils import gather_object
from transformers import GenerationConfig, LogitsProcessor

from common.data.chat import as_messages
from common.launch import mesh
from common.launch.accelerator import unwrap
from common.launch.errors import UsageError
from common.launch.internals import attention_implementation, is_zero3_parameter, without_zero3_init
from common.launch.peers import main_process_alone
from common.objectives.rollout_stages import Stages, ring_generate
from common.outputs.run_dir import COMPLETIONS, write_atomically
from common.training import experts


NEAR_TIE = 1e-4  # a draw this close (in probability) to a boundary of the CDF could flip under other rounding


# ---- prompts ---------------------------------------------------------------------------------------------------
PROMPT_IDS = "_prompt_ids"  # the prompt's tokens, a column beside the data's own (which all go to the rewards)


def tokenize_prompts(
    raw,
    tokenizer,
    block_size: int,
    max_completion_length: int,
    accelerator,
    num_proc=None,
    option="--max_completion_length",
):
    """Each split's rows with PROMPT_IDS (a text prompt tokenized as text, BOS and all; a conversation rendered
    with the chat template and its generation prompt), the other columns kept as they are for the rewards. Prompts
    longer than --block_size - `option` (the recipe's name for the completion's length) are dropped, counted.
    Returns the datasets and the counts ({"train": {"prompt_too_long": 3}})."""
    room = block_size - max_completion_length
    if room < 1:
        raise UsageError(
            f"{option} {max_completion_length} leaves no room for a prompt in --block_size {block_size} (prompt + "
            f"completion): raise --block_size or lower {option}"
        )
    for split, dataset in raw.items():
        if "prompt" not in dataset.column_names:
            raise UsageError(
                f'prompt data needs a "prompt" column (text, or a conversation as a list of messages); the {split} '
                f"split has {dataset.column_names}: rename the column"
            )
    if not isinstance(raw["train"][0]["prompt"], str) and not tokenizer.chat_template:
        raise UsageError("the prompts are conversations and the tokenizer has no chat_template; pass --chat_template")

    def encode(example):
        prompt = example["prompt"]
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            text = tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return {PROMPT_IDS: ids}

    with accelerator.main_process_first(), main_process_alone(accelerator, "tokenizing"):
        encoded = raw.map(encode, num_proc=num_proc, desc="tokenizing prompts")
    kept, counts = {}, {}
    for split, dataset in encoded.items():
        kept[split] = dataset.filter(lambda ids: len(ids) <= room, input_columns=PROMPT_IDS).flatten_indices()
        dropped = len(dataset) - len(kept[split])
        counts[split] = {"prompt_too_long": dropped} if dropped else {}
        if dropped:
            accelerator.print(
                f"{split} prompts: {dropped} of {len(dataset)} longer than {room} tokens (--block_size {block_size} "
                f"- {option} {max_completion_length}) dropped"
            )
        if len(kept[split]) == 0:
            raise UsageError(f"no {split} prompt fits in {room} tokens: raise --block_size")
    return kept, counts


@dataclass
class PromptOrder:
    """Which rows each rollout samples: `prompts` per rollout over all data-parallel ranks, this rank's share."""

    rows: int
    prompts: int
    seed: int
    rank: int
    ranks: int

    @property
    def per_epoch(self) -> int:
        return self.rows // self.prompts

    def rollout(self, index: int) -> list[int]:
        epoch, within = divmod(index, self.per_epoch)
        order = torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed + 7919 * epoch))
        chosen = order[within * self.prompts : (within + 1) * self.prompts].tolist()
        share = self.prompts // self.ranks
        return chosen[self.rank * share : (self.rank + 1) * share]


def data_parallel_position(accelerator) -> tuple[int, int]:
    """(this rank's place, the number of places) among the ranks that sample different prompts: a tensor-parallel
    group's ranks share one."""
    group = mesh.batch_sharers(accelerator)
    return accelerator.process_index // group, accelerator.num_processes // group


def prompt_order(accelerator, rows: int, prompts_per_rank: int, seed: int) -> PromptOrder:
    rank, ranks = data_parallel_position(accelerator)
    order = PromptOrder(rows, prompts_per_rank * ranks, seed, rank, ranks)
    if order.per_epoch < 1:
        raise UsageError(
            f"a step samples {order.prompts} prompts ({ranks} processes x {prompts_per_rank}) and the data has "
            f"{rows}: use more prompts, or a smaller --per_device_train_batch_size x --gradient_accumulation_steps"
        )
    return order


def row_seed(seed: int, rollout: int, row: int) -> int:
    digest = hashlib.sha256(f"{seed}/{rollout}/{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# ---- sampling --------------------------------------------------------------------------------------------------
class InverseCdfSampler(LogitsProcessor):
    """Picks each row's next token from its own uniforms (rows x max_new_tokens), then hands generate a score
    that only that token has (generate runs greedy over it): the sample depends on the row's logits and its
    uniform alone. Counts each row's draws within NEAR_TIE of a CDF boundary (`near_ties`), until the row ends, and
    keeps the log-probability each drawn token had in the distribution it was drawn from (`log_probs`: one
    (rows,) float64 tensor a position, on the device; at top_p 1 what training scores at the same temperature)."""

    def __init__(self, uniforms: torch.Tensor, prompt_length: int, temperature: float, top_p: float, stop_ids):
        self.uniforms, self.prompt_length = uniforms, prompt_length
        self.temperature, self.top_p, self.stop_ids = temperature, top_p, stop_ids
        self.near_ties = torch.zeros(uniforms.shape[0], dtype=torch.long)  # per row, while it is unfinished
        self.log_probs = []

    def __call__(self, input_ids, scores):
        position = input_ids.shape[1] - self.prompt_length
        unfinished = ~torch.isin(
            input_ids[:, self.prompt_length :], torch.tensor(self.stop_ids, device=input_ids.device)
        )
        unfinished = unfinished.all(1).cpu()
        logits = scores.double()
        if self.temperature == 0:
            top = logits.softmax(-1).topk(2, dim=-1).values
            self.near_ties += ((top[:, 0] - top[:, 1] < NEAR_TIE).cpu() & unfinished).long()
            token = logits.argmax(-1)
        else:
            probs = (logits / self.temperature).softmax(-1)
            if self.top_p < 1:
                ordered, where = probs.sort(dim=-1, descending=True)
                outside = ordered.cumsum(-1) - ordered > self.top_p  # the smallest set reaching top_p is kept
                probs = probs.scatter(-1, where, ordered.masked_fill(outside, 0.0))
            cdf = probs.cumsum(-1)
            target = self.uniforms[:, position].to(cdf.device).unsqueeze(1) * cdf[:, -1:]
            token = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)
            self.near_ties += (((cdf - target).abs().min(-1).values < NEAR_TIE).cpu() & unfinished).long()
            self.log_probs.append((probs.gather(-1, token.unsqueeze(1)).squeeze(1) / cdf[:, -1]).log())
        chosen = torch.full_like(scores, -math.inf)
        return chosen.scatter(-1, token.unsqueeze(1), 0.0)


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and the model's generation config's."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        ids.update(source if isinstance(source, list) else [source] if source is not None else [])
    return sorted(ids)


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of any lengths as one batch for `generate`: (input_ids, attention_mask), left-padded to the longest,
    so every row's next token is at the last column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    return input_ids, torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])


@torch.no_grad()
def sample_rows(model, prompts: list[list[int]], uniforms, settings: "SamplingSettings", accelerator):
    """One completion of each row's prompt (uniforms: a row each), every row in one `generate`, left-padded to the
    longest prompt: (each one's token ids, cut at its stop token, which is kept; whether each was cut by
    max_new_tokens instead; each one's draws near a tie). Each token is the row's own pick from its own uniforms, so
    a completion depends on its prompt and uniforms alone; the batch's shape (which rows share the call, how much
    padding) changes its logits by rounding only (the padding masked, each row's positions its own), which in fp32
    moves a pick only at a draw within NEAR_TIE of a boundary (counted), and in bf16 at coarser ones too."""
    input_ids, mask = left_padded(prompts, settings.pad_id)
    width = input_ids.shape[1]
    sampler = InverseCdfSampler(uniforms, width, settings.temperature, settings.top_p, settings.stop_ids)
    with accelerator.autocast(), experts.unrouted(model):  # a MoE: no router loss at each decoding step
        output = model.generate(
            input_ids=input_ids.to(accelerator.device),
            attention_mask=mask.to(accelerator.device),
            generation_config=settings.greedy_config(uniforms.shape[1]),
            logits_processor=[sampler],
        )
    completions, truncated = zip(*(settings.cut(row) for row in output[:, width:].tolist()))
    return list(completions), list(truncated), sampler.near_ties


def sample_group(model, prompt_ids: list[int], uniforms, settings: "SamplingSettings", accelerator):
    """G completions of one prompt (G = uniforms' rows), as `sample_rows` samples them."""
    return sample_rows(model, [prompt_ids] * uniforms.shape[0], uniforms, settings, accelerator)


@dataclass
class SamplingSettings:
    temperature: float
    top_p: float
    max_completion_length: int
    stop_ids: list[int]
    pad_id: int

    def greedy_config(self, max_new_tokens: int) -> GenerationConfig:
        """generate's settings: the next token its top score (the sampler's pick, or greedy), ending at a stop."""
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
        )

    def cut(self, generated: list[int]) -> tuple[list[int], bool]:
        """A generated row cut after its first stop token (kept), and whether it had none (cut by the length)."""
        end = next((i for i, token in enumerate(generated) if token in self.stop_ids), None)
        return (generated, True) if end is None else (generated[: end + 1], False)


class Sampler:
    """This rank's rollouts: `rollout(index)` samples G completions of each of its prompts of that rollout."""

    def __init__(
        self,
        weights: "GenerationWeights",
        prompts,
        order: PromptOrder,
        group: int,
        seed: int,
        settings: SamplingSettings,
        accelerator,
    ):
        self.weights, self.prompts, self.order, self.group, self.seed = weights, prompts, order, group, seed
        self.settings, self.accelerator = settings, accelerator

    def rollout(self, index: int, step: int, show=None) -> Rollout:
        """Rollout `index` sampled from the policy of optimizer step `step` (gathered first where it is sharded:
        every rank calls it); `show(text)` is told this rank's prompts sampled so far."""
        self.weights.refresh(step)
        gathered = time.perf_counter()
        groups = []
        for row in self.order.rollout(index):
            generator = torch.Generator().manual_seed(row_seed(self.seed, index, row))
            uniforms = torch.rand(
                self.group, self.settings.max_completion_length, generator=generator, dtype=torch.float64
            )
            groups.append((self.prompts[row][PROMPT_IDS], uniforms))
        rows, done = [], None
        sharers = mesh.batch_sharers(self.accelerator) if self.weights.stages is None else 1
        if show is not None:
            share = len(groups[self.accelerator.process_index % sharers :: sharers])
            done = lambda count: show(f"sampled {count}/{share} prompts")  # noqa: E731
            done(0)
        for (prompt_ids, _), (completions, truncated, ties), row in zip(
            groups, self.shared_sample(groups, sharers, done), self.order.rollout(index)
        ):
            rows += [
                {"row": row, "prompt_ids": prompt_ids, "completion_ids": ids, "truncated": cut, "near_ties": int(n)}
                for ids, cut, n in zip(completions, truncated, ties)
            ]
        seconds = time.perf_counter() - gathered
        timing = {
            "gather_s": self.weights.gather_s,  # the gather of the weights sampled from
            "generate_s": seconds,
            "tokens_per_s": sum(len(r["completion_ids"]) for r in rows) / max(seconds, 1e-9),
        }
        return Rollout(index, rows, torch.zeros(len(rows)), timing=timing)

    def shared_sample(self, groups: list, sharers: int, done) -> list[tuple]:
        """Each group's completions (`GenerationWeights.sample`). The `sharers` consecutive ranks that hold one batch
        (a tensor-, context- or sequence-parallel group: mesh.batch_sharers) each sample every sharers-th group from
        their whole weights and take the others' from them (one gather over the ranks): in 1/sharers of the time, in
        fp32 the completions one rank sampling them all would draw (but at a near tie: `sample_rows`)."""
        if sharers == 1:
            return self.weights.sample(groups, self.settings, done)
        position = self.accelerator.process_index % sharers
        everyone = gather_object([self.weights.sample(groups[position::sharers], self.settings, done)])
        parts = everyone[self.accelerator.process_index - position :][:sharers]
        return [parts[j % sharers][j // sharers] for j in range(len(groups))]

    @torch.no_grad()
    def greedy(self, dataset, step: int, batch_size: int, limit: int | None) -> list[dict]:
        """Greedy completions of the first `limit` prompts of `dataset` (held-out), this rank's share of them,
        `batch_size` at a time, left-padded (every rank calls it: the copy is gathered first)."""
        self.weights.refresh(step)
        count = len(dataset) if limit is None else min(limit, len(dataset))
        mine = mesh.data_parallel_share(self.accelerator, list(range(count)), mesh.batch_sharers(self.accelerator))
        batches = [
            [dataset[i][PROMPT_IDS] for i in mine[start : start + batch_size]]
            for start in range(0, len(mine), batch_size)
        ]
        rows = []
        for index, prompt, generated in zip(
            mine, [p for batch in batches for p in batch], self.weights.greedy(batches, self.settings)
        ):
            ids, truncated = self.settings.cut(generated)
            rows.append({"row": index, "prompt_ids": prompt, "completion_ids": ids, "truncated": truncated})
        return rows


# ---- the weights sampled with ----------------------------------------------------------------------------------
ROLLOUT_WEIGHTS = ("auto", "copy", "stages")


class GenerationWeights:
    """The model the rollouts sample from, whole on every rank: the policy itself where the strategy keeps its
    weights whole, else a copy (the policy's architecture, its LoRA adapters unmerged) filled by `refresh` with
    the gathered weights, once per rollout; or, where that copy does not fit (`choice` "auto") or `choice` is
    "stages", a slice of the layers per rank, the ranks generating together (`common.objectives.rollout_stages`). In
    the dtype the run computes in (bf16 under bf16 mixed precision)."""

    def __init__(self, accelerator, model, choice: str = "auto", rows: int = 8, max_length: int = 256):
        self.accelerator, self.prepared = accelerator, model
        self.policy = unwrap(accelerator, model)
        self.gathered = any(hasattr(p, "full_tensor") or is_zero3_parameter(p) for p in self.policy.parameters())
        self.refreshed_at, self.gather_s = None, 0.0  # the last gather's seconds (an evaluation's, at the same step)
        self.dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(
            accelerator.mixed_precision, next(self.policy.parameters()).dtype
        )
        self.stages, self.reason = None, "the strategy keeps whole weights on every rank"
        if not self.gathered:
            if choice == "stages":
                raise UsageError(
                    "--rollout_weights stages: this config keeps whole weights on every process (ddp, ZeRO-1/2, one "
                    "process), so the policy samples itself; drop the flag or use a sharded config"
                )
            self.model, self.targets = self.policy, {}
            return
        whole = sum(full_numel(p) for p in self.policy.parameters()) * torch.finfo(self.dtype).bits // 8
        self.copy_bytes, self.cache_bytes = whole, kv_cache_bytes(self.policy, rows, max_length, self.dtype)
        cannot = stages_impossible(accelerator, self.policy)
        if choice == "stages" and cannot:
            raise UsageError(f"--rollout_weights stages: {cannot}; use --rollout_weights copy")
        if choice == "auto":
            choice, self.reason = self._decide(cannot)
        else:
            self.reason = f"--rollout_weights {choice}"
        model = self._meta_model(sdpa=choice == "stages")
        if choice == "stages":
            self.stages = Stages(model, accelerator.process_index, accelerator.num_processes, accelerator.device)
            model = self.stages.model
        else:
            buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
            model.to_empty(device=accelerator.device)
            for name, buffer in buffers.items():
                model.get_buffer(name).copy_(buffer)
            model.tie_weights()
        self.model = model.requires_grad_(False).eval()
        self.targets = self._targets()
        held = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.held_per_rank = everyones(held)  # each rank's (the stages' slices differ)

    def _decide(self, cannot: str | None) -> tuple[str, str]:
        """A whole copy where, on every rank, it and the KV cache of the rows sampled at once fit in the memory free now, less what
        training has yet to allocate (the rank's trainable parameters' gradients and Adam's two moments, fp32: 12
        bytes each) and a tenth for activations; else, where the ring can run, a slice of the layers per rank. Every
        rank calls it and all take the same verdict (the least room of any rank)."""
        free = free_memory(self.accelerator.device)
        later = 12 * sum(local_numel(p) for p in self.policy.parameters() if p.requires_grad)
        room = torch.tensor([0.9 * free - later], dtype=torch.float64, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(room, op=torch.distributed.ReduceOp.MIN)
        room = float(room)
        need = self.copy_bytes + self.cache_bytes
        fits = need <= room
        reason = (
            f"the copy and its KV cache ({need / 2**20:.0f} MB) {'fit' if fits else 'do not fit'} in the "
            f"{max(room, 0) / 2**20:.0f} MB left on the tightest rank after training's gradients and optimizer states"
        )
        if fits or cannot:
            return "copy", reason + (f"; the stages cannot run ({cannot})" if not fits else "")
        return "stages", reason

    def _meta_model(self, sdpa: bool = False):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        peft_config = getattr(self.policy, "peft_config", None)
        base = self.policy.get_base_model() if peft_config else self.policy
        config = copy.deepcopy(base.config)
        config.use_cache = True
        with without_zero3_init(), init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(  # the stages' masks are sdpa's (inference only: any kernel)
                config, dtype=self.dtype, attn_implementation="sdpa" if sdpa else attention_implementation(base)
            )
            if peft_config:
                from peft import get_peft_model

                model = get_peft_model(model, copy.deepcopy(peft_config["default"]))
        return model

    def _targets(self) -> dict:
        """The policy's parameter names (one per tensor, as named_parameters gives them) -> the tensors of
        `self.model` each fills (tied weights: the lm_head a stage holds without the embeddings, the same tensor)."""
        canonical, seen = {}, {}
        for name, parameter in self.policy.named_parameters(remove_duplicate=False):
            canonical[name] = seen.setdefault(id(parameter), name)
        targets = {}
        for name, parameter in self.model.named_parameters(remove_duplicate=False):
            if name not in canonical:
                raise RuntimeError(f"the rollouts' weights: {name} has no counterpart in the policy")
            targets.setdefault(canonical[name], []).append(parameter)
        return targets

    def record(self) -> dict:
        held = max(self.held_per_rank) if self.gathered else 0
        if self.stages is not None:
            how = "a slice of the layers per rank, generating as a ring"
        elif self.gathered:
            how = "a whole copy gathered once per rollout"
        else:
            how = "the policy's own weights (whole here)"
        record = {"weights": how, "copy_bytes_per_rank": held, "chosen": self.reason}
        if self.stages is not None:
            record.update(bytes_per_rank=self.held_per_rank, layers_per_rank=self.stages.layers_per_rank)
        return record

    @torch.no_grad()
    def refresh(self, step: int) -> None:
        """Every rank calls it (a collective per parameter where the weights are sharded): what the rollouts sample
        from takes the policy's weights of optimizer step `step`, unless it already has them."""
        if not self.gathered or self.refreshed_at == step:
            return
        started = time.perf_counter()
        optimizer = getattr(self.prepared, "optimizer", None)
        if hasattr(optimizer, "empty_partition_cache"):  # ZeRO-3: what its last forward left gathered (the engine's
            optimizer.empty_partition_cache()  # own call adds a gc.collect(): 50-190 ms a rollout, seen on CPU)
        for name, source in self.policy.named_parameters():
            targets = self.targets.get(name, [])
            if is_zero3_parameter(source):
                import deepspeed

                with deepspeed.zero.GatheredParameters([source]):
                    for target in targets:
                        target.copy_(source.data)
            else:
                whole = source.to(self.accelerator.device).full_tensor() if hasattr(source, "full_tensor") else source
                for target in targets:
                    target.copy_(whole)
        self.refreshed_at, self.gather_s = step, time.perf_counter() - started

    def sample(self, groups: list, settings: "SamplingSettings", done=None) -> list[tuple]:
        """Each (prompt ids, uniforms) group's completions (cut), whether each was truncated, their near ties;
        `done(count)` after each group where they are sampled one by one, once at the end in stages. Every rank
        calls it when the weights are in stages."""
        done = done or (lambda count: None)
        with evaluating(self.model):
            if self.stages is None:  # every group's G rows in one decoding call
                if not groups:
                    return []
                prompts = [prompt for prompt, uniforms in groups for _ in range(len(uniforms))]
                completions, truncated, ties = sample_rows(
                    self.model, prompts, torch.cat([u for _, u in groups]), settings, self.accelerator
                )
                out, start = [], 0
                for _, uniforms in groups:
                    end = start + len(uniforms)
                    out.append((completions[start:end], truncated[start:end], ties[start:end]))
                    start = end
                done(len(out))
                return out
            specs = [{"prompts": [p] * len(u), "uniforms": u} for p, u in groups]
            results = ring_generate(
                self.stages,
                everyones(specs, self.stages.group),
                settings.max_completion_length,
                settings,
                self.accelerator.autocast,
                lambda spec: Pick(spec["uniforms"], len(spec["prompts"][0]), settings),
            )
        out = []
        for generated, ties in results:
            completions, truncated = zip(*(settings.cut(row) for row in generated.tolist()))
            out.append((list(completions), list(truncated), ties))
        done(len(out))
        return out

    def sample_each(self, prompts: list[list[int]], uniforms, settings: "SamplingSettings") -> list[tuple]:
        """One completion of each prompt (a row of `uniforms` each): (its ids, cut; whether it was truncated).
        From whole weights the prompts are sampled as one batch (`sample_rows`); in stages, each alone through
        the ring. Every rank calls it when the weights are in stages."""
        if self.stages is None:
            with evaluating(self.model):
                completions, truncated, _ = sample_rows(self.model, prompts, uniforms, settings, self.accelerator)
                return list(zip(completions, truncated))
        sampled = self.sample([(prompt, row.unsqueeze(0)) for prompt, row in zip(prompts, uniforms)], settings)
        return [(completions[0], cut[0]) for completions, cut, _ in sampled]

    def greedy(self, batches: list[list[list[int]]], settings: "SamplingSettings") -> list[list[int]]:
        """The greedy continuation (uncut) of each prompt of `batches` (each batch left-padded to its longest)."""
        with evaluating(self.model):
            if self.stages is not None:
                results = ring_generate(
                    self.stages,
                    everyones([{"prompts": batch} for batch in batches], self.stages.group),
                    settings.max_completion_length,
                    settings,
                    self.accelerator.autocast,
                    lambda spec: Pick(None, 0, settings),
                )
                return [row for generated, _ in results for row in generated.tolist()]
            config, rows = settings.greedy_config(settings.max_completion_length), []
            for prompts in batches:
                input_ids, attention_mask = left_padded(prompts, settings.pad_id)
                width = input_ids.shape[1]
                with self.accelerator.autocast(), torch.no_grad(), experts.unrouted(self.model):
                    output = self.model.generate(
                        input_ids=input_ids.to(self.accelerator.device),
                        attention_mask=attention_mask.to(self.accelerator.device),
                        generation_config=config,
                    )
                rows += output[:, width:].tolist()
            return rows


class Pick:
    """The last stage's token picker in a ring: the sampler's pick from the row's uniforms, or greedy."""

    def __init__(self, uniforms, prompt_length: int, settings: "SamplingSettings"):
        self.sampler = (
            None
            if uniforms is None
            else InverseCdfSampler(uniforms, prompt_length, settings.temperature, settings.top_p, settings.stop_ids)
        )

    @property
    def near_ties(self):
        return None if self.sampler is None else self.sampler.near_ties

    def __call__(self, input_ids, logits):
        scores = logits.float()  # as generate hands the processors the last position's logits
        return (scores if self.sampler is None else self.sampler(input_ids, scores)).argmax(-1)


@contextlib.contextmanager
def evaluating(model):
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def everyones(item, group=None) -> list:
    """Every rank's `item`, by rank (every rank calls it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [item]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, item, group=group)
    return gathered


STAGED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # embeddings -> layers -> norm -> head, nothing else
STAGE_BLOCKERS = ("final_logit_softcapping", "logit_scale", "embedding_multiplier", "logits_scaling")


def stages_impossible(accelerator, policy) -> str | None:
    """Why the ring (`common.objectives.rollout_stages`) cannot run here, or None."""
    config = policy.config.get_text_config()
    processes, layers = accelerator.num_processes, config.num_hidden_layers
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if processes < 2:
        return "one process has nothing to pass round a ring"
    if mesh.data_parallel_size(accelerator) != processes:
        return (
            "the processes must each hold their own prompts (this config shares a batch, as tensor parallelism does)"
        )
    if config.model_type not in STAGED_MODEL_TYPES or any(getattr(config, a, None) for a in STAGE_BLOCKERS):
        return f"{config.model_type} models are not cut into stages here (only {', '.join(STAGED_MODEL_TYPES)})"
    if sliding or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return "sliding-window attention is not run by the stages"
    if layers < processes:
        return f"{layers} decoder layers cannot be cut into {processes} stages (one per process)"
    return None


def full_numel(parameter) -> int:
    return parameter.ds_numel if is_zero3_parameter(parameter) else parameter.numel()  # a DTensor's is global


def local_numel(parameter) -> int:
    if is_zero3_parameter(parameter):
        return parameter.ds_tensor.numel()
    return parameter.to_local().numel() if hasattr(parameter, "to_local") else parameter.numel()


def kv_cache_bytes(model, rows: int, length: int, dtype) -> int:
    """The KV cache of `rows` sequences of `length` tokens."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * rows * length * torch.finfo(dtype).bits // 8


def free_memory(device) -> int:
    """Bytes free for tensors on `device`: the GPU's free memory, or on a CPU host MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return int(fields["MemAvailable"].split()[0]) * 1024


# ---- the buffer a step trains on -------------------------------------------------------------------------------
@dataclass
class Rollout:
    """One rollout on this rank: its completions (grouped by prompt, G each, in prompt order), their
    advantages, and with --num_iterations > 1 the log-probabilities of the policy that sampled them."""

    index: int
    rows: list[dict]  # {"row", "prompt_ids", "completion_ids", "truncated"}
    advantages: torch.Tensor
    old_log_probs: list[list[float]] | None = None
    timing: dict = field(default_factory=dict)  # this rank's: gather_s, generate_s, tokens_per_s (completion tokens)

    def batch(self, rows: list[dict], pad_id: int, mask_truncated: bool) -> dict:
        """Right-padded prompt + completion rows: input_ids, attention_mask, labels (the completion's tokens),
        `mask` (the tokens the loss counts: none of a truncated completion under --mask_truncated_completions)."""
        width = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            prompt, completion = row["prompt_ids"], row["completion_ids"]
            ids = prompt + completion
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, len(prompt) : len(ids)] = torch.tensor(completion, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        mask = labels[:, 1:] != -100
        if mask_truncated:
            mask &= ~torch.tensor([r["truncated"] for r in rows]).unsqueeze(1)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "mask": mask}

    def micro_batches(self, size: int, pad_id: int, mask_truncated: bool, device):
        """This rank's micro-batches of `size` completions, each with its rows' advantages and old log-probs
        ((rows, length - 1), at the completion's positions)."""
        for start in range(0, len(self.rows), size):
            rows = self.rows[start : start + size]
            batch = self.batch(rows, pad_id, mask_truncated)
            batch["advantages"] = self.advantages[start : start + size]
            if self.old_log_probs is not None:
                old = torch.zeros(batch["mask"].shape, dtype=torch.float32)
                for i, row in enumerate(rows):
                    begin = len(row["prompt_ids"]) - 1
                    values = self.old_log_probs[start + i]
                    old[i, begin : begin + len(values)] = torch.tensor(values, dtype=torch.float32)
                batch["old_log_probs"] = old
            yield {key: value.to(device) for key, value in batch.items()}

    def state(self, accelerator, iteration: int) -> dict:
        """Every rank calls it: the rollout over all data-parallel ranks (rank order), for a checkpoint taken
        after `iteration` of its --num_iterations passes."""
        mine = {
            "rows": self.rows,
            "advantages": self.advantages.tolist(),
            "old_log_probs": self.old_log_probs,
        }
        group = mesh.batch_sharers(accelerator)
        shares = gather_object([mine])[::group]  # a tensor-parallel group's ranks hold the same one
        return {
            "index": self.index,
            "iteration": iteration,
            "shares": shares,
        }

    @classmethod
    def from_state(cls, state: dict, accelerator) -> Rollout:
        """This rank's share of a saved rollout, on any number of processes whose data-parallel ranks divide it."""
        rows = [row for share in state["shares"] for row in share["rows"]]
        advantages = [a for share in state["shares"] for a in share["advantages"]]
        old = None
        if state["shares"][0]["old_log_probs"] is not None:
            old = [values for share in state["shares"] for values in share["old_log_probs"]]
        rank, ranks = data_parallel_position(accelerator)
        per_rank = len(rows) // ranks
        take = slice(rank * per_rank, (rank + 1) * per_rank)
        return cls(
            state["index"],
            rows[take],
            torch.tensor(advantages[take], dtype=torch.float32),
            None if old is None else old[take],
        )


def loggable(value):
    """A log_extra value as completions.jsonl can hold it: JSON's own types as they are, anything else as its text."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


class CompletionLog:
    """--log_completions: every completion of each rollout (all ranks', in prompt order), and of each held-out
    evaluation, appended to output_dir/completions.jsonl, as TRL's completion table holds them: `split` (train or
    eval), the rollout (train) or step (eval), the prompt's row and the prompt as the data gives it, the data's
    columns the reward functions read, the completion's token ids and text, each function's score (None where it
    returned None), the reward (None: no function scored it), the advantage (train) and the functions' log_extra
    columns. A resumed run first drops the rows of the rollouts and evaluations it does again."""

    def __init__(self, accelerator, output_dir: str, tokenizer, start_step: int, num_iterations: int):
        """`start_step`: the optimizer steps already taken (a resumed run's; 0: a fresh run, whose file starts
        empty), each rollout trained on for `num_iterations` of them."""
        self.accelerator, self.tokenizer = accelerator, tokenizer
        self.path = os.path.join(output_dir, COMPLETIONS)
        if accelerator.is_main_process and os.path.exists(self.path):
            write_atomically(self.path, "".join(self._kept(start_step, num_iterations)) if start_step else "")

    def __call__(self, rollout: Rollout, rewards: torch.Tensor, table: torch.Tensor, scorer) -> None:
        """A rollout's completions (`rewards`, `table`: `scorer`'s last call on them, a
        common.objectives.rewards.Rewards)."""
        own = [{"split": "train", "rollout": rollout.index, "advantage": a} for a in rollout.advantages.tolist()]
        self._append(rollout.rows, rewards, table, scorer, own)

    def held_out(self, rows: list[dict], rewards: torch.Tensor, table: torch.Tensor, scorer, step: int) -> None:
        """An evaluation's greedy completions at optimizer step `step` (every rank calls it)."""
        self._append(rows, rewards, table, scorer, [{"split": "eval", "step": step} for _ in rows])

    def _append(self, rows, rewards, table, scorer, own: list[dict]) -> None:
        texts = self.tokenizer.batch_decode([row["completion_ids"] for row in rows], skip_special_tokens=True)
        prompts, columns = scorer.read
        mine = []
        for i, (row, text, reward, scores) in enumerate(zip(rows, texts, rewards.tolist(), table.tolist())):
            entry = {
                **own[i],
                "row": row["row"],
                "prompt": loggable(prompts[i]),
                "columns": {name: loggable(values[i]) for name, values in columns.items()},
                "completion_ids": row["completion_ids"],
                "completion": text,
                "truncated": row["truncated"],
                "near_ties": row.get("near_ties", 0),
                "rewards": {name: None if math.isnan(v) else float(v) for name, v in zip(scorer.names, scores)},
                "reward": None if math.isnan(reward) else float(reward),  # None: no function scored it
            }
            if scorer.extra:
                entry["extra"] = {
                    column: loggable(values[i] if i < len(values) else None) for column, values in scorer.extra.items()
                }
            mine.append(entry)
        every = gather_object([mine])[:: mesh.batch_sharers(self.accelerator)]
        if not self.accelerator.is_main_process:
            return
        written = set()  # an evaluation's last share is padded with its last prompt: each prompt once
        with open(self.path, "a") as handle:
            for share in every:
                for entry in share:
                    if entry["split"] == "eval" and entry["row"] in written:
                        continue
                    written.add(entry["row"])
                    handle.write(json.dumps(entry) + "\n")

    def _kept(self, step: int, num_iterations: int):
        """The file's complete lines a run resumed after `step` optimizer steps does not do again: the rollouts
        sampled before it (rollout r at step r x num_iterations; the one a resume inside --num_iterations trains
        on again is not sampled again) and the evaluations of the steps up to it (each runs before the checkpoint of
        its step)."""
        with open(self.path) as handle:
            for line in handle:
                if not line.endswith("\n"):
                    continue
                entry = json.loads(line)
                if entry.get("split", "train") == "train" and entry["rollout"] * num_iterations < step:
                    yield line
                elif entry.get("split") == "eval" and entry["step"] <= step:
                    yield line
