"""Mixture-of-experts models: the router's load-balancing loss and the experts' load, as a run logs them.

A transformers MoE (Qwen3-MoE, Mixtral, OLMoE, gpt-oss, ...) adds its router's auxiliary loss to the
training loss when its config's `output_router_logits` is on (`--output_router_logits`, else the model
config's), weighted by `router_aux_loss_coef`, and returns the routers' logits beside it. `ExpertWatch`
reads them off each training forward of the model, whatever wraps it (DDP, FSDP2, DeepSpeed, tensor
parallelism): the aux loss of each micro-batch, and the tokens each layer sends to each expert (its top-k
of the router's logits, padding left out). Each logging step's line then carries `aux_loss` (its mean over
the window's micro-batches and ranks, as TRL logs it) and the experts' load over the window's tokens on
every rank: `expert_load_max_over_mean` and `expert_load_min_over_mean`, tokens per expert against their
mean, in the least balanced layer (1.0 is even; an expert no token reached gives a minimum of 0). The
models here route every token (no capacity), so no token is dropped.

The statistics the aux loss is taken over are the micro-batch's on each rank, as transformers computes it
in the model's forward; the loss the optimizer sees is the mean of those over the global batch's
micro-batches (docs/strategies.md: what this means for a run on another layout).
"""

from __future__ import annotations

import contextlib

import torch

from common.launch.errors import UsageError


def num_experts(config) -> int:
    """The routed experts of a MoE config (0 for a dense model), whatever the family names them."""
    config = config.get_text_config()
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def experts_per_token(config) -> int:
    config = config.get_text_config()
    return int(getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None) or 1)


def router_loss_on(model) -> bool:
    """Whether `model` returns its router's load-balancing loss (a MoE causal LM with output_router_logits on;
    transformers' MoE classifiers, the reward model's, take none)."""
    config = model.config
    return (
        num_experts(config) > 0
        and bool(getattr(config.get_text_config(), "output_router_logits", False))
        and getattr(model, "router_aux_loss_coef", None) is not None
    )


def config_overrides(args, config, causal_lm: bool = True) -> dict:
    """--output_router_logits for the model's config (nothing when unset); refused for a dense model, and on for a
    classifier (`causal_lm` False: transformers' MoE classifiers compute no router loss)."""
    wanted = getattr(args, "output_router_logits", None)
    if wanted is None:
        return {}
    if not num_experts(config):
        raise UsageError(
            f"--output_router_logits {str(wanted).lower()}: {config.model_type} is a dense model (no experts, no "
            "router); leave the option out, or pass a mixture-of-experts model (Qwen3-MoE, Mixtral, OLMoE, ...)"
        )
    if wanted and not causal_lm:
        raise UsageError(
            "--output_router_logits true: transformers' mixture-of-experts classifiers (the reward model's, "
            "sequence classification's) compute no router loss; leave the option out"
        )
    return {"output_router_logits": wanted}


@contextlib.contextmanager
def unrouted(model):
    """Generation without the router's logits: a MoE's forward would take its load-balancing loss at every
    decoding step, and with a padded batch fails on the mask's shape (transformers 5.23). A dense model: as is."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        yield
        return
    config.output_router_logits = False
    try:
        yield
    finally:
        config.output_router_logits = True


def describe(model) -> dict | None:
    """What run.json records of a MoE model (None for a dense one)."""
    experts = num_experts(model.config)
    if not experts:
        return None
    return {
        "num_experts": experts,
        "experts_per_token": experts_per_token(model.config),
        "router_aux_loss": router_loss_on(model),
        "router_aux_loss_coef": getattr(model.config.get_text_config(), "router_aux_loss_coef", None),
    }


class ExpertWatch:
    """Reads each training forward's aux loss and routing off `model`'s output (a forward hook on the model itself,
    so any wrapper around it calls it): `figures` gives the window's `aux_loss` and experts' load, every rank
    calling it together. Evaluation forwards (the model in eval mode) are left out.

    A forward without labels (DPO's and GRPO's: they take the logits) returns the aux loss without adding it to
    a loss: `pending_loss` hands it to the recipe's loss, weighted as the model adds it to its own."""

    def __init__(self, model):
        self.coefficient = float(model.router_aux_loss_coef)
        self.pending = []  # the weighted aux losses of the forwards since `pending_loss`, on the autograd graph
        self.experts, self.top_k = num_experts(model.config), experts_per_token(model.config)
        # sums over the window on this rank, kept on the model's device (read once a line, not once a micro-batch):
        self.aux = None  # [the micro-batches' aux loss, micro-batches]
        self.load = None  # tokens per expert, one row per MoE layer
        model.register_forward_hook(self._read, with_kwargs=True)

    def _read(self, module, args, kwargs, output) -> None:
        if not (module.training and torch.is_grad_enabled()) or getattr(output, "router_logits", None) is None:
            return  # an evaluation, a reference's or a rollout's forward
        aux = getattr(output, "aux_loss", None)
        if aux is not None:
            entry = torch.stack([aux.detach().double(), torch.ones((), dtype=torch.float64, device=aux.device)])
            self.aux = entry if self.aux is None else self.aux + entry
            if getattr(output, "loss", None) is None and aux.requires_grad:  # the model's own loss holds it otherwise
                self.pending.append(self.coefficient * aux)
        mask = kwargs.get("attention_mask")
        counts = torch.stack([self.routed(logits, mask) for logits in output.router_logits])
        self.load = counts if self.load is None else self.load + counts

    def pending_loss(self):
        """The weighted aux loss of the training forwards since the last call that took no labels (0.0 if none)."""
        pending, self.pending = self.pending, []
        return sum(pending) if pending else 0.0

    def routed(self, logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Tokens each expert receives from one layer's router logits (tokens x experts), padding left out."""
        logits = logits.detach().reshape(-1, logits.shape[-1]).float()
        chosen = logits.topk(self.top_k, dim=-1).indices  # the softmax keeps the order: the router's own choice
        weights = torch.ones_like(chosen, dtype=torch.float64)
        if mask is not None and mask.numel() == logits.shape[0]:  # a split row's slice has no mask of its own
            weights = weights * mask.reshape(-1, 1).to(weights.device, torch.float64)
        return torch.zeros(self.experts, dtype=torch.float64, device=logits.device).index_add_(
            0, chosen.reshape(-1), weights.reshape(-1)
        )

    def figures(self, accelerator) -> dict:
        """The window's figures over every rank (all ranks call it: one reduce), then a fresh window."""
        device = accelerator.device
        load = self.load if self.load is not None else torch.zeros(0, self.experts, dtype=torch.float64)
        aux = self.aux if self.aux is not None else torch.zeros(2, dtype=torch.float64)
        layers = torch.tensor([float(load.shape[0])], dtype=torch.float64, device=aux.device)
        most = accelerator.reduce(torch.cat([aux, layers]).to(device), reduction="sum").cpu()  # the same shape
        rows = int(most[2].item()) // accelerator.num_processes
        if rows != load.shape[0]:  # a rank had no training forward in the window (not in the recipes' loops)
            load = torch.zeros(rows, self.experts, dtype=torch.float64)
        total = accelerator.reduce(load.to(device), reduction="sum").cpu() if rows else load
        self.aux = self.load = None
        self.pending = []  # a forward whose router loss no loss took (none in the recipes) is not carried on
        out = {"aux_loss": float(most[0] / most[1]) if most[1] else None}
        if rows and float(total.sum()):
            ratio = total / total.mean(dim=1, keepdim=True).clamp(min=1e-12)
            out["expert_load_max_over_mean"] = float(ratio.max(dim=1).values.max())
            out["expert_load_min_over_mean"] = float(ratio.min(dim=1).values.min())
        return out


def watch(model) -> ExpertWatch | None:
    """An ExpertWatch on `model` (unwrapped) where it routes and reports its routing; None otherwise."""
    return ExpertWatch(model) if router_loss_on(model) else None
