"""Sparse upcycling: a dense Llama-family model made a mixture-of-experts model that computes the same function.

Komatsuzaki et al., "Sparse Upcycling" (2022): each decoder layer's MLP is copied into every expert of a Mixtral
layer (SwiGLU experts, as Llama's MLP), and a router is added. The router's top-k weights are normalised to sum to 1
(Mixtral's routing), so with identical experts each token's output is the dense MLP's whatever the router chooses:
the MoE's logits at step 0 equal the dense model's, and at step 0 the loss does not depend on the router either (its
gradient is 0 then): the experts' gradients differ with the tokens and weights the router gives each, so the first
steps move the experts apart, and the router learns from then on. The attention, norms, embeddings and head are the
dense model's own tensors; Mixtral's attention is Llama's (no biases, rotary embeddings as the config says), so a
Llama model with biases is refused.
"""

from __future__ import annotations

import torch

from common.launch.errors import UsageError


def mixtral_config(dense, num_experts: int, experts_per_token: int, router_aux_loss_coef: float = 0.01):
    """The Mixtral config of the upcycled `dense` model's config (a LlamaConfig: Llama, SmolLM2, ...)."""
    from transformers import MixtralConfig

    if dense.model_type != "llama":
        raise UsageError(
            f"upcycling takes a Llama-family model (Llama, SmolLM2, ...), not {dense.model_type}: its layers map onto "
            "Mixtral's (the same attention, SwiGLU experts)"
        )
    if getattr(dense, "attention_bias", False) or getattr(dense, "mlp_bias", False):
        raise UsageError("upcycling: the model's attention or MLP has biases, which Mixtral's layers do not hold")
    if not 1 < experts_per_token <= num_experts:
        raise UsageError(
            f"upcycling: --experts_per_token {experts_per_token} with --num_experts {num_experts}: route each token "
            "to 2 or more experts (a single expert's normalised weight is always 1, so its router would never learn "
            "from the loss) and at most to all of them"
        )
    shared = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
        "hidden_act max_position_embeddings initializer_range rms_norm_eps tie_word_embeddings attention_dropout "
        "bos_token_id eos_token_id pad_token_id rope_parameters"
    ).split()
    return MixtralConfig(
        **{key: getattr(dense, key) for key in shared if getattr(dense, key, None) is not None},
        num_local_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        router_aux_loss_coef=router_aux_loss_coef,
        output_router_logits=False,  # as MoE checkpoints ship; --output_router_logits true trains with it
        sliding_window=None,
    )


def upcycle(dense_model, num_experts: int, experts_per_token: int, seed: int = 0):
    """The Mixtral model whose experts are each a copy of `dense_model`'s MLP, its routers drawn from the model's own
    initialisation (seeded), every other tensor the dense model's."""
    from transformers import AutoModelForCausalLM

    config = mixtral_config(dense_model.config, num_experts, experts_per_token)
    torch.manual_seed(seed)
    moe = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense = dense_model.state_dict()
    state = {}
    for name, tensor in moe.state_dict().items():
        if name.endswith(".mlp.gate.weight"):  # the router: kept as initialised
            state[name] = tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            mlp = name.removesuffix("experts.gate_up_proj")
            pair = torch.cat([dense[f"{mlp}gate_proj.weight"], dense[f"{mlp}up_proj.weight"]])
            state[name] = pair.expand(num_experts, *pair.shape)
        elif name.endswith(".mlp.experts.down_proj"):
            down = dense[name.removesuffix("experts.down_proj") + "down_proj.weight"]
            state[name] = down.expand(num_experts, *down.shape)
        else:
            state[name] = dense[name]
    moe.load_state_dict({name: tensor.to(torch.float32).contiguous() for name, tensor in state.items()})
    moe.tie_weights()
    moe.generation_config = dense_model.generation_config
    return moe
