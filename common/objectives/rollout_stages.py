"""Rollouts where a whole copy of the weights does not fit on a rank: a slice of the layers each, decoded as a ring.

Under FSDP2 and ZeRO-3 the rollouts sample from a copy of the whole weights gathered once per rollout
(`common.objectives.rollout.GenerationWeights`). Where that copy does not fit beside the training state, each rank
instead gathers whole weights for a contiguous slice of the decoder layers (torchtitan's split: the embeddings and the
head counted as one layer's work each; about 1/N of the model per rank, as much as its shard), and the ranks generate
together as a pipeline: rank 0 embeds, each rank runs its layers with its own KV cache and sends the hidden states on,
the last rank samples the next token and sends it back to rank 0. Each rank's groups are the pipeline's micro-batches,
one per rank in flight at a time (a ring: rank s works on rank (t - s) mod N's group at tick t), so every rank computes
at every tick. What crosses between ranks per decoded token is a group's hidden states (G x hidden), not weights: no
per-token all-gather of every layer. A group ends for every rank at once (the last rank's verdict travels round the
ring with the next token), so ranks never wait on a peer that stopped.

The tokens are picked as `common.objectives.rollout` picks them (`InverseCdfSampler` from the row's uniforms, or
greedy), from the same modules' arithmetic, so a prompt's completions are those of the copy and of one process (fp32),
the near-tie count aside.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from common.launch.errors import UsageError


class Skipped(nn.Module):
    """A module another stage owns: the hidden states pass through unchanged (never called in the ring)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def stage_bounds(layers: int, stages: int) -> list[tuple[int, int]]:
    """Each stage's decoder layers [start, end): the embeddings and the head count as one layer each (torchtitan's
    rule), the layers + 2 units split as evenly as they go, the first stages taking the remainder."""
    units, bounds, start = layers + 2, [], 0
    for stage in range(stages):
        share = units // stages + (stage < units % stages)
        share -= (stage == 0) + (stage == stages - 1)
        bounds.append((start, start + max(share, 0)))
        start += max(share, 0)
    return bounds


def decoder_parts(model) -> tuple[nn.Module, nn.Module]:
    """(the decoder with embed_tokens, layers, norm and rotary_emb; the causal LM holding lm_head), or a one-line
    UsageError: the stages are cut along these attributes (Llama, Qwen2, Mistral, SmolLM and their kin)."""
    top = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(top, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not all(hasattr(decoder, name) for name in needed) or not hasattr(top, "lm_head"):
        raise UsageError(
            f"--rollout_weights stages: {type(top).__name__} is not cut into stages here (it needs "
            "model.embed_tokens, model.layers, model.norm, model.rotary_emb and lm_head, as Llama-style models "
            "have); use --rollout_weights copy"
        )
    return decoder, top


class Stages:
    """This rank's slice of a model built on the meta device (`model`: the policy's architecture, its LoRA adapters
    unmerged), materialised for the owned modules only; `parameters()` names what the gather must fill."""

    def __init__(self, model, rank: int, stages: int, device):
        decoder, top = decoder_parts(model)
        layers = len(decoder.layers)
        if layers < stages:
            raise UsageError(
                f"--rollout_weights stages: {layers} decoder layers cannot be cut into {stages} stages (one per "
                "process); use --rollout_weights copy"
            )
        self.rank, self.stages = rank, stages
        self.first, self.last = rank == 0, rank == stages - 1
        bounds = stage_bounds(layers, stages)
        self.layers_per_rank = [f"{start}-{end - 1}" if end > start else "none" for start, end in bounds]
        start, end = bounds[rank]
        self.owned = list(range(start, end))
        for index in range(layers):
            if index not in self.owned:
                decoder.layers[index] = Skipped()
        if not self.first:
            decoder.embed_tokens = Skipped()
        if not self.last:
            decoder.norm, top.lm_head = Skipped(), Skipped()
        buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
        model.to_empty(device=device)
        for name, buffer in buffers.items():
            model.get_buffer(name).copy_(buffer)
        self.model, self.decoder, self.top, self.device = model, decoder, top, device
        self.dtype = next(model.parameters()).dtype
        self.hidden = model.config.get_text_config().hidden_size
        # The ring's messages go through gloo (CPU tensors) whatever the run's backend: its sends complete without
        # waiting for the matching receive, which the ring's order relies on (NCCL's may wait: a deadlock).
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.message_device = torch.device("cpu")

    def forward(self, inputs, positions, mask, cache):
        """This stage's part of one forward: token ids (first stage) or hidden states in, hidden states out, or on
        the last stage the logits of each row's last position."""
        hidden = self.decoder.embed_tokens(inputs) if self.first else inputs
        rotary = self.decoder.rotary_emb(hidden, positions)
        for index in self.owned:
            hidden = self.decoder.layers[index](
                hidden,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=rotary,
            )
        if self.last:
            return self.top.lm_head(self.decoder.norm(hidden[:, -1:]))[:, -1]
        return hidden


class _Slot:
    """One micro-batch of the ring: rows of left-padded prompts, what the stages hold for it, what it generated."""

    def __init__(self, prompts: list[list[int]], pad_id: int, pick, device):
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        self.ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        self.valid = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device).bool()
        self.padded = not bool(self.valid.all())
        self.next_position = self.valid.long().sum(1)  # each row's position for its first generated token
        self.cache, self.pick, self.done = DynamicCache(), pick, False
        self.generated: list[torch.Tensor] = []

    def prefill(self):
        positions = (self.valid.long().cumsum(1) - 1).clamp(min=0)
        if not self.padded:
            return positions, None  # causal attention without a mask, as generate runs it
        width = self.valid.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.valid.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=self.valid.device)  # a pad row attends to itself alone
        return positions, ((causal & self.valid[:, None, None, :]) | eye)

    def decode(self, k: int):
        positions = (self.next_position + k - 1).unsqueeze(1)
        if not self.padded:
            return positions, None
        keys = torch.cat([self.valid, torch.ones(len(self.valid), k, dtype=torch.bool, device=self.valid.device)], 1)
        return positions, keys[:, None, None, :]


def ring_generate(stages: Stages, specs_per_rank: list[list[dict]], max_new_tokens: int, settings, autocast, picker):
    """Every rank calls it with every rank's micro-batches (dicts with `prompts`, lists of token ids; what else
    `picker` reads). `picker(spec)` makes the last stage's token picker: (input_ids so far, logits) -> a token per
    row, with `near_ties` per row or None. Returns this rank's micro-batches' (generated ids: rows x new tokens,
    uncut; near ties or None), in order."""
    world, rank, device = stages.stages, stages.rank, stages.device
    mine = []
    for wave in range(max(len(specs) for specs in specs_per_rank)):
        owners = [r for r in range(world) if wave < len(specs_per_rank[r])]
        slots = [
            _Slot(specs_per_rank[r][wave]["prompts"], settings.pad_id, picker(specs_per_rank[r][wave]), device)
            for r in owners
        ]
        with autocast():
            _run_wave(stages, slots, max_new_tokens, settings.stop_ids)
        box = [
            [(torch.stack(slot.generated, 1).cpu(), getattr(slot.pick, "near_ties", None)) for slot in slots]
            if stages.last
            else None
        ]
        dist.broadcast_object_list(box, src=world - 1, group=stages.group)
        mine += [result for owner, result in zip(owners, box[0]) if owner == rank]
    return mine


@torch.no_grad()
def _run_wave(stages: Stages, slots: list[_Slot], max_new_tokens: int, stop_ids: list[int]) -> None:
    previous, following, last = stages.rank - 1, stages.rank + 1, stages.stages - 1
    stops = torch.tensor(stop_ids, device=stages.device)
    sending = {}  # per slot and peer: (step, [(work, tensor)]) of its last step's messages, kept alive until sent

    def send(tensor, to, tag, k):
        step, works = sending.get((tag, to), (k, []))
        if step < k:  # the peer took the slot's earlier step before this rank got the slot's input for this one
            for work, _ in works:
                work.wait()
            works = []
        tensor = tensor.to(stages.message_device).contiguous()
        works.append((dist.isend(tensor, dst=to, tag=tag, group=stages.group), tensor))
        sending[(tag, to)] = (k, works)

    def receive(shape, dtype, source, tag):
        tensor = torch.empty(shape, dtype=dtype, device=stages.message_device)
        dist.recv(tensor, src=source, tag=tag, group=stages.group)
        return tensor.to(stages.device)

    for k in range(max_new_tokens):
        for tag, slot in enumerate(slots):
            if slot.done:
                continue
            rows = len(slot.ids)
            positions, mask = slot.prefill() if k == 0 else slot.decode(k)
            if stages.first:
                if k == 0:
                    inputs = slot.ids
                else:
                    message = receive((rows + 1,), torch.long, last, tag)
                    if message[-1]:
                        slot.done = True
                        send(torch.tensor([1, 0, 0]), following, tag, k)
                        continue
                    inputs = message[:rows, None]
            else:
                header = receive((3,), torch.long, previous, tag)
                if header[0]:
                    slot.done = True
                    if not stages.last:
                        send(header, following, tag, k)
                    continue
                inputs = receive((rows, int(header[2]), stages.hidden), stages.dtype, previous, tag)
            output = stages.forward(inputs, positions, mask, slot.cache)
            if not stages.last:
                send(torch.tensor([0, rows, output.shape[1]]), following, tag, k)
                send(output.to(stages.dtype), following, tag, k)
                continue
            so_far = torch.cat([slot.ids, *[t[:, None] for t in slot.generated]], 1)
            token = slot.pick(so_far, output)
            slot.generated.append(token)
            finished = torch.isin(torch.stack(slot.generated, 1), stops).any(1).all()
            if k + 1 < max_new_tokens:
                send(torch.cat([token, finished.long().view(1)]), 0, tag, k)
    for _, works in sending.values():
        for work, _ in works:
            work.wait()
