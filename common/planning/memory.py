"""The memory model: memory per rank for a model under an accelerate config, by category, before launching.

The model is read on the meta device (a config file, a local folder or a Hub name: no
weights are loaded), the strategy from the accelerate config (its DeepSpeed JSON too).
Model-state bytes follow what each strategy keeps between steps, as the runs' own
memory account (`common.training.memory`, in run.json) counts them; Ψ parameters, N processes,
c bytes per element in the compute dtype (2 in bf16, 4 in fp32):

  config              parameters  master  gradients        optimizer  buckets
  single / DDP        4Ψ          -       4Ψ               8Ψ         - (DDP's: the gradients)
  FSDP2 (all three)   4Ψ/N        -       4Ψ/N             8Ψ/N       -
  ep.yaml (FSDP2)     4Ψ/N        -       4Ψ/N             8Ψ/N       -   the experts split by expert, the rest FSDP2
  tensor parallel     4Ψt         -       4Ψt              8Ψt        -   Ψt = Ψ split by the plan / T, + the rest
  FSDP2 x TP          4ΨtT/N      -       4ΨtT/N           8ΨtT/N     -
  ZeRO-1 / ZeRO-2     cΨ          4Ψ/N    cΨ/N + 4Ψ/N      8Ψ/N       -
   with offload       cΨ          4Ψ/N    4Ψ/N (+ cΨ/N)    8Ψ/N       cΨ/N
  ZeRO-3              cΨ/N        4Ψ/N    cΨ/N             8Ψ/N       c·h² (reduce)
   in fp32            4Ψ/N        -       4Ψ/N             8Ψ/N       4·h² (reduce)
   with offload       cΨ/N        4Ψ/N    cΨ/N + 4Ψ/N      8Ψ/N       c·h² (reduce)

(tp.yaml, fsdp_tp.yaml: T = tp_size ranks; a rank's activations inside attention and the MLP are split too.
zero3_ulysses.yaml: ZeRO-3's model state over all N ranks; each rank's activations are those of its
seq_len / sp_size tokens: after the exchange a rank attends for the whole row with 1/sp_size of the heads.
fsdp_cp.yaml: FSDP2's model state over all N ranks; each rank's activations those of its seq_len / cp_size
tokens, counted as Ulysses' are. pp.yaml, dp_pp.yaml: one row per rank of a pipeline, 16 bytes for each parameter of
its stages and the activations of the micro-batches (--gradient_accumulation_steps) its schedule holds in flight:
`estimate_stages`; the largest row is the per-device peak.)

--grpo_generations G adds recipes/grpo.py's rollout: under FSDP2, ZeRO-3 and tensor parallelism the whole-weights
copy it samples from (cΨ, the compute dtype: `rollout_bytes`; none where the weights are whole already; with
--rollout_stages the largest stage's slice of the layers and what lies outside them: `stage_bytes`), and, while
it samples, the KV cache of the completions a process samples in one call, its whole rollout (--batch_size x
--gradient_accumulation_steps, at least G) of --seq_len tokens (2 x layers x rows x seq_len x the key/value width
x c) and each decoding step's logits, one position a row, with the sampler's float64 copies. --dpo_reference adds recipes/dpo.py's frozen reference copy: 4Ψ on one process or DDP, 4Ψt under
TP, 4Ψ/N under FSDP2,
cΨ under ZeRO-1/2 and cΨ/N under ZeRO-3 (`reference_bytes`). --use_peft: the model frozen, LoRA's adapters (rank 8
on peft's default modules for the architecture, as the recipes' --use_peft) the only parameters with gradients,
master weights and AdamW moments: the table's gradient, master and optimizer columns with the adapters' count for Ψ.

(DeepSpeed keeps the model in the compute dtype and a separate fp32 master copy (ZeRO-3
in fp32: none, the model's own partitions are the master weights, common.launch.internals), and
makes an fp32 copy of each rank's gradient partition for the step: ZeRO-1/2 keep it,
ZeRO-3 makes it one optimizer sub-group at a time and frees it after the sub-group's step
(a transient of (c + 4) x the largest sub-group: the recipes set sub_group_size to 1e7
elements where a config leaves it unset), and ZeRO-3 with offload keeps it; with ZeRO-1/2
offload the updated weights come back through a cΨ/N buffer, the gradients reach the
fp32 partition through two buffers the size of the largest tensor, and with gradient
accumulation the micro-batches' sum waits in a further cΨ/N. Offload moves
the master copy and the optimizer to the CPU: on a GPU that leaves device memory, on a
CPU-only host it changes nothing. Under DDP with bf16, autocast's bf16 copy of every
weight, saved for backward, counts with the activations.) The peak adds one micro-batch's activations, the largest
transient (under FSDP2 with resharding, a layer gathered whole in the compute dtype (under ep.yaml without its
experts, which each rank holds whole and never gathers) and
the next one prefetched, and the root unit, embeddings and head, which FSDP2 keeps gathered
from forward to backward; without resharding, the whole unsharded model; the optimizer
step adds none, since the recipes' AdamW is torch's fused kernel, which updates in
place), and on a CPU host this
process's own size after the same imports (the run's start-up). FSDP2 with
fsdp_cpu_ram_efficient_loading (the shipped FSDP configs) builds the whole fp32 model on
rank 0 alone and broadcasts it into the shards at prepare, so rank 0 also peaks at 4Ψ +
4Ψ/N + one fp32 layer in flight: `peak` is the larger of the two (on 4 processes at 101M
this loading is rank 0's peak; on 2 the step is). DDP with accumulation peaks higher from the second step
on: the no_sync micro-batches' gradients are autograd's own tensors beside DDP's buckets until the
synchronising backward (+4Ψ); ZeRO-1 keeps each gradient whole until the boundary (+cΨ(N-1)/N):
`run_peak_mb`, which make choose-config counts.

scripts/estimate_memory.py (make estimate-memory) prints it; make choose-config ranks the configs by it.
"""

from __future__ import annotations

import json
import os
import re


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where accelerate_configs/ is
LORA_RANK = 8  # common.models.lora's default --lora_r
MB = 2**20


def read_strategy(config_file: str, num_processes: int | None, mixed_precision: str | None) -> dict:
    """Strategy, world size and precision from an accelerate config YAML (and its DeepSpeed JSON)."""
    import yaml

    with open(config_file) as handle:
        config = yaml.safe_load(handle)
    kind = config.get("distributed_type", "NO")
    strategy = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp"}.get(kind, "ddp")
    parallelism = config.get("parallelism_config") or {}
    tp_size = int(parallelism.get("parallelism_config_tp_size", 1))
    if (
        tp_size > 1 and strategy == "ddp"
    ):  # tp.yaml: tensor parallel over every process (common.parallel.tensor_parallel)
        strategy = "tp"  # (fsdp_tp.yaml stays fsdp, with its tp_size)
    precision = mixed_precision or config.get("mixed_precision", "no")
    stage, offload, offload_params, sub_group_size = None, False, False, None
    if strategy == "deepspeed":
        deepspeed = config.get("deepspeed_config", {})
        if deepspeed.get("deepspeed_config_file"):
            path = deepspeed["deepspeed_config_file"]
            with open(path if os.path.isabs(path) else os.path.join(REPO, path)) as handle:
                ds = json.load(handle)
            zero = ds.get("zero_optimization", {})
            stage = zero.get("stage", 0)
            offload = zero.get("offload_optimizer", {}).get("device", "none") != "none"
            offload_params = zero.get("offload_param", {}).get("device", "none") != "none"
            sub_group_size = zero.get("sub_group_size")
            if mixed_precision is None:
                precision = (
                    "bf16"
                    if ds.get("bf16", {}).get("enabled")
                    else "fp16"
                    if ds.get("fp16", {}).get("enabled")
                    else "no"
                )
        else:
            stage = deepspeed.get("zero_stage", 0)
            offload = deepspeed.get("offload_optimizer_device", "none") != "none"
            offload_params = deepspeed.get("offload_param_device", "none") != "none"
    if stage == 3 and sub_group_size is None:  # what common.launch.accelerator sets
        from common.launch.accelerator import ZERO3_SUB_GROUP_SIZE

        sub_group_size = ZERO3_SUB_GROUP_SIZE
    processes = num_processes or (1 if kind == "NO" else config.get("num_processes", 1))
    fsdp = config.get("fsdp_config", {})
    offload_params = offload_params or str(fsdp.get("fsdp_offload_params", False)).lower() == "true"
    replicas = int(parallelism.get("parallelism_config_dp_replicate_size", 1))
    pipeline = read_pipeline(config_file, parallelism, processes)
    ep_size = int(parallelism.get("parallelism_config_ep_size", 1))
    if ep_size > 1 and ep_size == config.get("num_processes"):  # ep.yaml: the experts over every process
        ep_size = processes
    return {
        "strategy": strategy,
        "zero_stage": stage,
        "offload": offload,
        "offload_params": offload_params,
        "replicas": replicas,
        "tp_size": tp_size,
        "num_processes": processes,
        "sp_size": int(parallelism.get("parallelism_config_sp_size", 1)),
        "cp_size": int(parallelism.get("parallelism_config_cp_size", 1)),
        "ep_size": ep_size,
        "zero3_sub_group_size": None if sub_group_size is None else int(float(sub_group_size)),
        "mixed_precision": precision,
        "fsdp_reshard_after_forward": str(fsdp.get("fsdp_reshard_after_forward", True)).lower() == "true",
        "activation_checkpointing": str(fsdp.get("fsdp_activation_checkpointing", False)).lower() == "true",
        "fsdp_cpu_ram_efficient_loading": str(fsdp.get("fsdp_cpu_ram_efficient_loading", False)).lower() == "true",
        **pipeline,
    }


def read_pipeline(config_file: str, parallelism: dict, processes: int) -> dict:
    """pp.yaml's and dp_pp.yaml's keys, read as a run reads them (common.launch.mesh's
    pipeline_settings_in): strategy "pp", pp_size, pp_schedule, stages_per_rank; nothing for a config without a
    pipeline. Bad values: one line."""
    from common.launch.errors import UsageError
    from common.launch.mesh import pipeline_settings_in

    try:
        settings = pipeline_settings_in(parallelism)
    except UsageError as error:
        raise SystemExit(f"error: {config_file}: {error}")
    if settings is None:
        return {}
    if processes % settings.size:
        raise SystemExit(
            f"error: {config_file}: parallelism_config_pp_size {settings.size} does not divide {processes} processes; "
            "pass --num_processes a multiple of it"
        )
    return {
        "strategy": "pp",
        "pp_size": settings.size,
        "pp_schedule": settings.schedule,
        "stages_per_rank": settings.stages_per_rank,
    }


def read_model(model: str, vocab_size: int | None = None) -> dict:
    """Sizes from a model built on the meta device: no weights are read or allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    from common.training import experts
    from common.training.flops import matmul_weights_per_token

    overrides = {"vocab_size": vocab_size} if vocab_size else {}
    config = AutoConfig.from_pretrained(model, **overrides)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    parameters = list(built.parameters())
    # split by tensor parallelism: every parameter of a module (or the parameter) its TP plan names
    planned = re.compile("|".join(re.escape(name).replace(r"\*", r"\d+") + r"(\..+)?" for name in built.tp_plan))
    tp_split = sum(p.numel() for name, p in built.named_parameters() if built.tp_plan and planned.fullmatch(name))
    layers = next(
        (m for m in built.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == config.num_hidden_layers), []
    )
    total, largest_tensor = sum(p.numel() for p in parameters), max(p.numel() for p in parameters)
    # --use_peft's adapters at the recipes' defaults (common.models.lora: rank 8 on peft's default modules for the
    # architecture, all linear layers where peft has none): rank x (inputs + outputs) per adapted layer
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as LORA_TARGETS

    targets = LORA_TARGETS.get(config.model_type)
    adapted = [
        m
        for name, m in built.named_modules()
        if isinstance(m, (torch.nn.Linear, Conv1D))
        and (name.split(".")[-1] in targets if targets else m is not built.get_output_embeddings())
    ]
    layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    # a MoE's experts, by the model's expert-parallel plan (its stacked weights): what ep.yaml splits and never gathers
    from common.parallel.expert_parallel import dispatched, resolved_plan

    split = dispatched(resolved_plan(built, 2))
    layer_experts = [
        sum(
            p.numel()
            for name in split
            if name.startswith(f"{prefix}.")
            for p in built.get_submodule(name).parameters()
        )
        for prefix in (n for n, m in built.named_modules() if any(m is layer for layer in layers))
    ]
    embeddings, head = built.get_input_embeddings(), built.get_output_embeddings()
    from common.parallel.pipeline import safetensors_names

    return {
        "model_type": config.model_type,
        "safetensors_folder": os.path.isdir(model) and safetensors_names(model) is not None,
        # a pipeline's ends (common.parallel.pipeline): the embeddings on the first stage; the final norm and the head
        # on the
        # last (a tied head is the embeddings' weight, held again there)
        "embedding_parameters": embeddings.weight.numel(),
        "head_parameters": 0 if head is None else head.weight.numel(),
        "tied_embeddings": head is not None and head.weight is embeddings.weight,
        "parameters": total,
        "largest_tensor": largest_tensor,
        "largest_layer": max(layer_sizes, default=largest_tensor),
        # the largest layer without its experts (ep.yaml gathers that part only); the experts' parameters in all
        "largest_layer_without_experts": max(
            (size - experts for size, experts in zip(layer_sizes, layer_experts)), default=largest_tensor
        ),
        "expert_parameters": sum(layer_experts),
        "root_parameters": total - sum(layer_sizes),  # outside the decoder layers: FSDP2's root unit
        "lora_parameters": sum(LORA_RANK * sum(m.weight.shape) for m in adapted),
        "tp_split_parameters": tp_split,
        # the weights a token multiplies (GPT-2's Conv1D too; a MoE's experts by the share a token reaches: the
        # FLOPs of the train lines, common.training.flops)
        "matmul_parameters": matmul_weights_per_token(built),
        # a MoE's layers with experts, the experts a token goes to and each one's MLP width (the activations)
        "moe_layers": sum(1 for count in layer_experts if count),
        "num_experts": experts.num_experts(config.get_text_config()),
        "experts_per_token": experts.experts_per_token(config.get_text_config()),
        "expert_intermediate_size": getattr(config, "moe_intermediate_size", None)
        or getattr(config, "intermediate_size", 4 * config.hidden_size),
        "hidden_size": config.hidden_size,
        "intermediate_size": getattr(config, "intermediate_size", 4 * config.hidden_size),
        "layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "attention_heads": getattr(config, "num_attention_heads", 1),
        "key_value_heads": getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 1),
        # the queries' width (heads x head_dim: Qwen3's differs from the hidden size), and whether q and k are
        # normalised per head (Qwen3, OLMo2, Gemma 3: their norms keep activations too)
        "q_hidden_size": getattr(config, "num_attention_heads", 1)
        * (getattr(config, "head_dim", None) or config.hidden_size // getattr(config, "num_attention_heads", 1)),
        "qk_norm": any(name.endswith(".q_norm") for name, _ in built.named_modules()),
        # the key and value projections' width (grouped-query attention: fewer heads than the queries)
        "kv_hidden_size": (getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 1))
        * (getattr(config, "head_dim", None) or config.hidden_size // getattr(config, "num_attention_heads", 1)),
    }


def activation_bytes(
    model: dict,
    batch_size: int,
    seq_len: int,
    compute_bytes: int,
    checkpointing: bool,
    tp: int = 1,
    sp: int = 1,
    head: bool = True,
    weight_bytes: int = 4,
    residual_bytes: int | None = None,
) -> int:
    """Tensors one micro-batch's forward saves for backward, for a Llama-style decoder.

    `weight_bytes` (w): the dtype the layers' weights and the residual stream are in: 4 where fp32 weights compute
    under autocast (ddp, tp, one process) or in fp32, the compute dtype where the strategy hands the layers their
    weights in it (FSDP2's mixed precision, DeepSpeed's bf16 model). Llama- and Qwen3-style decoders (RMSNorm, separate
    q/k/v and gate/up projections); Gemma's four norms a layer and GPT-2's fused projections differ. Per layer and
    token: each of the two RMSNorms its input made fp32 (4h) and its normalised output in w (w h), and its inverse RMS;
    the q/k/v projections' input and the gate/up projections' in the compute dtype (c h each; under autocast with fp32
    weights each projection keeps its own cast: 3 c h and 2 c h); attention's q, k and v (the queries' width, the keys'
    and values' under grouped-query attention) and its output, the o projection's input (c(2 h_q + 2 kv)), and its log-
    sum-exp (4 bytes a head); where the model normalises q and k per head (Qwen3, OLMo2), those norms' fp32 input and
    output ((4 + c)(h_q + kv)); the MLP's gate, up, activation and down projection input (4ci); then the final norm,
    the head's input and the logits and their log-softmax in fp32 (8V). Checked with saved-tensor hooks on a Llama
    layer with grouped-query attention, a Qwen3 and a Qwen3-MoE layer in all three regimes (fp32, fp32 weights under
    bf16 autocast, bf16 weights): tests/test_memory.py. Not counted: with a padding mask transformers' SDPA path
    repeats the keys and values to every query head (about 8% more a layer under grouped-query attention, measured),
    and LoRA's frozen projections keep no input (an overcount). With activation checkpointing a layer keeps only its
    input (w h), and one layer's worth is rebuilt during backward (`residual_bytes`: the stream's dtype where it is not
    w). Under tensor parallelism (`tp` ranks) the tensors inside attention and the MLP are split by heads and columns,
    while the norms, the projections' inputs and the gathered logits stay whole. Under sequence parallelism (`sp`
    ranks, `seq_len` the rank's slice) the attention output is kept twice: for the whole row with the rank's heads
    (attention's own) and, exchanged back, for the slice with every head (the o projection's input), one c·h more per
    token and layer (measured at 101M: 4 MB of 97). `head=False`: the layers alone (a pipeline stage before the last).

    A mixture-of-experts layer (`moe_layers` of them) keeps, in place of the MLP's terms, the router's logits in the
    compute dtype and their softmax in fp32 (E(c + 4)), and for each of the k experts a token goes to its copy of the
    normed input and of the expert's output (2ch) and the expert's gate, up, activation and down projection input
    (4ci_e, i_e the expert's width), beside the normed input itself, and the routing's indices and weights (int64 and
    fp32, 40 bytes an expert a token: transformers' grouped_mm experts): c(h + 2kh + 4ki_e) + E(c + 4) + 40k, the
    experts' tensors in w rather than c under autocast with fp32 weights (autocast does not cover the grouped matmul:
    they compute in fp32)."""
    h, i, vocab, layers = model["hidden_size"], model["intermediate_size"], model["vocab_size"], model["layers"]
    tokens = batch_size * seq_len
    c, w = compute_bytes, weight_bytes
    queries, kv = model.get("q_hidden_size", h), model.get("kv_hidden_size", h)
    casts = w != c  # fp32 weights under autocast: each projection casts the normed input for itself
    norms = 2 * (4 * h + w * h) + 8
    attention = (
        norms
        + c * h * (3 if casts else 1)
        + (c * (2 * queries + 2 * kv) + 4 * model.get("attention_heads", 1)) / tp
        + ((4 + c) * (queries + kv) / tp if model.get("qk_norm") else 0)
        + (c * h if sp > 1 else 0)
    )
    moe = model.get("moe_layers", 0)
    mlp = c * h * (2 if casts else 1) + c * 4 * i / tp
    experts = moe_layer_bytes(model, c, tp, expert_bytes=w) if moe else 0
    per_layer = attention + ((layers - moe) * mlp + moe * experts) / layers
    logits = 8 * vocab + (4 + w) * h + c * h if head else 0
    if checkpointing:
        return tokens * (layers * (residual_bytes or w) * h + per_layer + logits)
    return tokens * (layers * per_layer + logits)


def moe_layer_bytes(model: dict, compute_bytes: int, tp: int = 1, expert_bytes: int | None = None) -> float:
    """What a mixture-of-experts layer's MLP keeps for backward per token (activation_bytes' text); `expert_bytes`:
    the experts' tensors' dtype where it is not the compute dtype (fp32 weights under autocast)."""
    h, k, c = model["hidden_size"], model["experts_per_token"], compute_bytes
    e = expert_bytes or c
    routed = (c * h + e * (2 * k * h + 4 * k * model["expert_intermediate_size"])) / tp
    return routed + model["num_experts"] * (c + 4) + 40 * k


def reference_bytes(psi: int, strategy: dict, c: int) -> float:
    """DPO's frozen reference copy on a rank (common.objectives.reference): whole in the load dtype (fp32) on a single
    process or DDP; DeepSpeed keeps it in the compute dtype, whole under ZeRO-1/2 (stage 0: no weights are
    sharded there) and partitioned under ZeRO-3; FSDP2 shards it in fp32, as the policy."""
    n = strategy["num_processes"]
    if strategy["strategy"] == "deepspeed":
        return c * psi / n if strategy["zero_stage"] == 3 else c * psi
    return 4 * psi / n if strategy["strategy"] == "fsdp" else 4 * psi


def rollout_bytes(psi: int, strategy: dict, c: int) -> float:
    """GRPO's copy of the whole weights on a rank (common.objectives.rollout.GenerationWeights): the compute dtype's cΨ
    where the strategy shards the weights (FSDP2, ZeRO-3, tensor parallelism), none where every rank holds them
    whole."""
    sharded = strategy["strategy"] in ("fsdp", "tp") or (
        strategy["strategy"] == "deepspeed" and strategy["zero_stage"] == 3
    )
    return c * psi if sharded else 0


def stage_bytes(model: dict, strategy: dict, c: int) -> float:
    """GRPO's weights with --rollout_weights stages (common.objectives.rollout_stages) on the rank holding the most, in
    the compute dtype: the first stage's embeddings and layers, the last's layers, final norm and head (the embeddings
    again where they are tied), those between their layers."""
    from common.objectives.rollout_stages import stage_bounds

    counts = [end - start for start, end in stage_bounds(model["layers"], strategy["num_processes"])]
    embeddings = model["vocab_size"] * model["hidden_size"]
    head = max(model["root_parameters"] - embeddings, embeddings)  # with the final norm; tied: the embeddings
    ends = {0: embeddings, len(counts) - 1: head}
    return c * max(count * model["largest_layer"] + ends.get(i, 0) for i, count in enumerate(counts))


def schedule_actions(rank: int, size: int, schedule: str, micro_batches: int) -> list[tuple[str, int]]:
    """The order in which pipeline rank `rank` of `size` runs one window's forwards ("F") and backwards ("B"), each
    with the rank's local stage it runs on (0; under Interleaved1F1B 0 or 1: stages rank and rank + size), as torch
    2.13's schedules order them (torch.distributed.pipelining.schedules) and common.parallel.pipeline runs them."""
    m = micro_batches
    if schedule == "GPipe" or (schedule == "1F1B" and m < size):  # common.parallel.pipeline runs GPipe's order there
        return [("F", 0)] * m + [("B", 0)] * m
    if schedule == "1F1B":  # Schedule1F1B: min(m, size - rank) warm-up forwards, then a backward before each forward
        warmup = min(m, size - rank)
        return [("F", 0)] * warmup + [("B", 0), ("F", 0)] * (m - warmup) + [("B", 0)] * warmup
    # ScheduleInterleaved1F1B, two stages per rank: _get_warmup_ops' warm-up, then _get_1f1b_rank_ops' forward and
    # backward per step, stages taken in rounds of m // max(1, m // size) micro-batches
    v, rounds = 2, max(1, m // size)
    if m % rounds:
        raise ValueError(
            f"Interleaved1F1B on {size} ranks runs {m} micro-batches (the accumulation) only in whole rounds of "
            f"{m // rounds}; pass a --gradient_accumulation_steps that {rounds} divides"
        )
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (size - 1 - rank), m * v)

    def forward(op):
        return (op // per_round) % v

    def backward(op):
        return v - 1 - ((op - warmup) // per_round) % v

    actions = [("F", forward(op)) for op in range(warmup)]
    for op in range(warmup, m * v):
        actions += [("F", forward(op)), ("B", backward(op))]
    return actions + [("B", backward(op)) for op in range(m * v, m * v + warmup)]


def estimate_stages(
    model: dict, strategy: dict, batch_size: int, seq_len: int, checkpointing: bool = False, accumulation: int = 1
) -> list[dict]:
    """Each rank of one pipeline (pp.yaml, dp_pp.yaml: read_strategy's pp_size, pp_schedule and stages_per_rank),
    rank 0 first, in estimate()'s keys, with its `stage_indices`, their decoder `layers` and the micro-batches it holds
    `in_flight` at most. The window's micro-batches are the accumulation steps. A rank holds
    (common.parallel.pipeline):

    * its stages' parameters (common.parallel.pipeline.stage_layers: the embeddings on the first stage, the final norm
    and
      head on the last; a tied head is the embeddings' weight, held again on the last stage's rank), their fp32
      gradients and AdamW's two moments: 16 bytes each, as one DDP process (a data-parallel replica of a pipeline,
      dp_pp.yaml, holds the same: its gradients are summed over the replicas in place, no buckets);
    * the activations of the micro-batches its schedule has run forward and not yet backward (`schedule_actions`:
      GPipe all m; 1F1B min(m, p - rank); Interleaved1F1B its warm-up + 1, over its two stages), each its layers'
      (`activation_bytes`), on a stage before the last the hidden state it sent (kept for its backward), on the last
      the loss's log-softmax in fp32 and the logits, which the schedule's forward cache keeps to the micro-batch's
      backward (a torch whose schedules lack `step(return_outputs=False)` also keeps every micro-batch's logits
      there to the window's end, then merges them into one more copy); autocast's low-precision copy of its
      weights, once (one autocast context runs the window), and with more than one micro-batch their gradients in
      that precision, held to the end of each backward after the first (`step_transient`: autograd runs the
      casts' backward, older nodes, last; measured at 101M, 2 micro-batches, one process: 93 MB of the 97
      predicted), and on the last stage the loss's fp32 copy of a micro-batch's logits and their gradient
      (`step_transient` too);
    * torch's receive buffers, made for every micro-batch of the window: the hidden state (fp32, b x s x h) into
      each stage but the first, its gradient into each but the last (`communication_buffers`);
    * while it starts (`loading_peak`): from a pretrained folder of safetensors files its stages' weights in fp32
      alone (each rank reads its tensors: `common.parallel.pipeline.load_stages`); otherwise the whole model in fp32,
      which each rank builds, then keeps its stages."""
    from common.parallel.pipeline import schedule_keeps_outputs, splits, stage_layers

    if not splits(model.get("model_type")):
        raise ValueError(
            f"pipeline parallelism splits the causal LMs checked here (common.parallel.pipeline.SPLITS), and this model "
            f"({model.get('model_type')!r}) is not one; estimate it under ddp.yaml, fsdp.yaml or zero3.yaml"
        )
    checkpointing = checkpointing or strategy.get("activation_checkpointing", False)
    size, per_rank, m = strategy["pp_size"], strategy["stages_per_rank"], accumulation
    num_stages = size * per_rank
    layers = stage_layers(model["layers"], num_stages)
    c = 2 if strategy["mixed_precision"] in ("bf16", "fp16", "fp8") else 4
    h, vocab, tokens = model["hidden_size"], model["vocab_size"], batch_size * seq_len
    embeddings, head = model["embedding_parameters"], model["head_parameters"]
    final_norm = model["root_parameters"] - embeddings - (0 if model["tied_embeddings"] else head)
    boundary = 4 * tokens * h  # the residual stream between stages stays in the fp32 weights' dtype under autocast
    ranks = []
    for rank in range(size):
        stages = [rank + size * local for local in range(per_rank)]
        parameters, buffers, one, held_outputs = 0, 0, [], 0
        for index in stages:
            first, last = index == 0, index == num_stages - 1
            count = len(layers[index])
            parameters += (
                count * model["largest_layer"] + (embeddings if first else 0) + (final_norm + head if last else 0)
            )
            shaped = dict(model, layers=count)
            # one micro-batch's tensors held for its backward: its layers', and the hidden state sent on (kept in
            # the schedule's forward cache) or, on the last stage, the log-softmax (fp32), the head's input and the
            # logits themselves (the schedule's forward cache keeps the stage's output to the micro-batch's backward)
            one.append(
                # counted as layers given their weights in c (one cast of each projection's input): what the stages'
                # measured peaks fit (SmolLM2 at 512 tokens, make test-all's tests/test_memory.py), not autocast's
                # per-projection casts that one process's layers keep; not yet explained
                activation_bytes(
                    shaped, batch_size, seq_len, c, checkpointing, head=False, weight_bytes=c, residual_bytes=4
                )
                + (tokens * (4 * vocab + c * vocab + c * h) if last else boundary)
            )
            if last and schedule_keeps_outputs():  # each micro-batch's logits, to the window's end
                held_outputs += m * tokens * c * vocab
            buffers += (0 if first else m * boundary) + (0 if last else m * boundary)
        outstanding, in_flight, peak = [0] * per_rank, 0, 0
        for kind, local in schedule_actions(rank, size, strategy["pp_schedule"], m):
            outstanding[local] += 1 if kind == "F" else -1
            in_flight = max(in_flight, sum(outstanding))
            peak = max(peak, sum(n * b for n, b in zip(outstanding, one)))
        activations = max(peak + held_outputs, 2 * held_outputs)  # the merge: every logit once more, none in flight
        transient = 0
        if c == 2:  # autocast's low-precision copy of each weight, saved for backward
            activations += c * parameters
            # the copies are cast once, in the first micro-batch's forward, so autograd runs their backward (older
            # nodes) last in every later micro-batch's: each weight's low-precision gradient waits to its end
            transient = c * parameters if m > 1 else 0
        if num_stages - 1 in stages:  # the loss: the fp32 copy of a micro-batch's logits, then their gradient
            transient += 8 * tokens * vocab
        state = 16 * parameters
        # a pretrained folder of safetensors files: the rank reads its stages' tensors alone (load_stages); a model
        # built from its config, or files of another kind: the whole model first
        loading = 4 * (parameters if model.get("safetensors_folder") else model["parameters"])
        tensors_peak = int(max(state + buffers + activations + transient, loading))
        ranks.append(
            {
                "rank": rank,
                "stage_indices": stages,
                "layers": [layers[index] for index in stages],
                "stage_parameters": parameters,
                "in_flight": in_flight,
                "parameters": 4 * parameters,
                "master_weights": 0,
                "gradients": 4 * parameters,
                "optimizer_states": 8 * parameters,
                "reference_model": 0,
                "rollout_weights": 0,
                "communication_buffers": buffers,
                "model_state": state,
                "activations": int(activations),
                "activation_checkpointing": checkpointing,
                "step_transient": transient,
                "sampling": 0,
                "loading_peak": loading,
                "tensors_peak": tensors_peak,
                "accumulation_transient": 0,
                "run_tensors_peak": tensors_peak,
            }
        )
    return ranks


def estimate(
    model: dict,
    strategy: dict,
    batch_size: int,
    seq_len: int,
    checkpointing: bool = False,
    accumulation: int = 1,
    dpo_reference: bool = False,
    trainable: int | None = None,
    grpo_generations: int | None = None,
    grpo_stages: bool = False,
    teacher: dict | None = None,
) -> dict:
    """Bytes per rank by category (the memory account's), and the peak. Activation checkpointing
    is on when asked or when the config turns it on (fsdp_activation_checkpointing). With
    `dpo_reference`, DPO's frozen reference copy (`reference_bytes`) joins the model state; with `teacher` (a
    `read_model` dict), distill.py's frozen teacher, held as that copy is, under `reference_model` too. `trainable`:
    the parameters that train, when not all do (--use_peft: LoRA's adapters, beside the frozen model):
    only they have gradients, master weights and AdamW moments, and the adapters' own weights join the model.
    Under a pipeline (strategy "pp"): the rank that needs the most (`estimate_stages`), with every rank's in
    `stages`."""
    if strategy["strategy"] == "pp":
        if dpo_reference or trainable is not None or grpo_generations or teacher is not None:
            raise ValueError(
                "pipeline parallelism runs causal_lm.py and sft.py without LoRA (common.parallel.pipeline refuses "
                "DPO, GRPO "
                "and --use_peft): estimate those under ddp.yaml, fsdp.yaml or zero3.yaml"
            )
        stages = estimate_stages(model, strategy, batch_size, seq_len, checkpointing, accumulation)
        return {**max(stages, key=lambda rank: rank["run_tensors_peak"]), "stages": stages}
    checkpointing = checkpointing or strategy.get("activation_checkpointing", False)
    psi, n, tp = model["parameters"], strategy["num_processes"], strategy.get("tp_size", 1)
    # t: the trained parameters (all of psi, or LoRA's adapters, which then add to the frozen psi)
    t = psi if trainable is None else trainable
    frozen_psi, psi = psi, psi + (0 if trainable is None else trainable)
    # fp8 (torchao) computes in bf16 autocast: costed as bf16, an upper bound (its float8 casts take 1 byte)
    c = 2 if strategy["mixed_precision"] in ("bf16", "fp16", "fp8") else 4
    kind, stage = strategy["strategy"], strategy["zero_stage"]
    buckets, loading, step_transient = 0, 0, 0  # fused AdamW: no temporaries in the step
    if kind == "deepspeed":
        parameters = c * psi / n if stage == 3 else c * psi
        master, gradients = 4 * t / n, c * t / n + 4 * t / n
        optimizer = 8 * t / n
        if stage == 3 and not strategy["offload"]:  # the fp32 gradients, one sub-group at a time in the step
            gradients = c * t / n
            if c == 4:  # an fp32 model's own partitions are the master weights (common.launch.internals)
                master = 0
            sub_group = min(t / n, strategy["zero3_sub_group_size"] + model["largest_tensor"] / n)
            step_transient = (4 + (c if c < 4 else 0)) * sub_group  # its flattened copy, then that in fp32
        # ZeRO-3's reduce bucket of h*h elements ("auto"); ZeRO-1/2's is empty again after the step
        buckets = c * model["hidden_size"] ** 2 if stage == 3 else 0
        if stage in (1, 2) and strategy["offload"]:  # DeepSpeed's CPU-offload buffers (see the docstring)
            gradients = 4 * t / n + 2 * c * model["largest_tensor"] + (c * t / n if accumulation > 1 else 0)
            buckets = c * t / n
    elif kind == "fsdp":  # with tp_size > 1 (fsdp_tp.yaml): a TP rank's part, sharded over the n / tp FSDP ranks
        local = (psi - model.get("tp_split_parameters", 0) * (tp - 1) / tp) * tp if tp > 1 else psi
        parameters, master, gradients, optimizer = 4 * local / n, 0, 4 * local * t / psi / n, 8 * local * t / psi / n
        # a layer gathered whole and the next prefetched, and the root unit (embeddings, final norm, head:
        # FSDP2 keeps the root gathered from forward to backward); without resharding, the whole model
        # ep.yaml: each rank's experts are its own, whole, never gathered: a layer's other tensors only;
        # fsdp_ep.yaml: and the layer's experts of the rank's ep group, gathered over the groups (1/ep of them)
        layer, unsplit = model["largest_layer"], psi
        if 1 < (ep := strategy.get("ep_size", 1)):
            gathered = 1 / ep if ep < n else 0
            layer = (
                model["largest_layer_without_experts"] + (layer - model["largest_layer_without_experts"]) * gathered
            )
            unsplit = psi - model["expert_parameters"] * (1 - gathered)
        step_transient = (
            2 * c * layer + c * model.get("root_parameters", 0)
            if strategy["fsdp_reshard_after_forward"]
            else c * unsplit
        ) / tp  # gathered: a TP rank's part
        if strategy.get("fsdp_cpu_ram_efficient_loading"):  # rank 0: the whole model, its shard, a layer
            loading = 4 * psi + 4 * psi / n + 4 * model["largest_layer"]
    else:
        # DDP's gradients are views into its all-reduce buckets (common.launch.accelerator): no second copy. Tensor
        # parallelism: each rank holds 1/tp of the parameters its plan splits, and the rest (norms) whole
        local = psi - model.get("tp_split_parameters", 0) * (tp - 1) / tp if kind == "tp" else psi
        parameters, master, gradients, optimizer = 4 * local, 0, 4 * local * t / psi, 8 * local * t / psi
    reference = (
        (4 * local * frozen_psi / psi if kind == "tp" else reference_bytes(frozen_psi, strategy, c))
        if dpo_reference
        else 0
    )
    if teacher is not None:  # another model, held as the reference copy (split by its own plan under TP)
        split = teacher.get("tp_split_parameters", 0) * (tp - 1) / tp
        reference += (
            4 * (teacher["parameters"] - split)
            if kind == "tp"
            else reference_bytes(teacher["parameters"], strategy, c)
        )
    rollout = (
        (stage_bytes(model, strategy, c) if grpo_stages else rollout_bytes(psi, strategy, c))
        if grpo_generations
        else 0
    )
    # while sampling: the KV cache of the completions a rank samples at once (its whole rollout, batch x accumulation
    # completions, in one decoding call; at least a group of G) of seq_len tokens, and each decoding step's last
    # logits (generate keeps one position's) with the sampler's float64 copies of them (probabilities, CDF: ~4)
    sampled_rows = max(grpo_generations or 0, batch_size * accumulation)
    sampling = (
        sampled_rows * (seq_len * 2 * model["layers"] * model["kv_hidden_size"] * c + 32 * model["vocab_size"])
        if grpo_generations
        else 0
    )
    categories = {
        "parameters": parameters,
        "master_weights": master,
        "gradients": gradients,
        "optimizer_states": optimizer,
        "reference_model": reference,
        "rollout_weights": rollout,
        "communication_buffers": buckets,
    }
    # sequence (context) parallelism: a rank holds its share of each row, -(-L // sp) tokens once padded
    sp = strategy.get("sp_size", 1) * strategy.get("cp_size", 1)
    weights = 4 if kind in ("ddp", "tp") else c  # fp32 weights under autocast, else the layers get them in c
    activations = activation_bytes(
        model, batch_size, -(-seq_len // sp), c, checkpointing, tp, sp, weight_bytes=weights
    )
    if kind in ("ddp", "tp") and c == 2:  # autocast's low-precision copy of each weight, saved for backward
        activations += c * parameters / 4
    model_state = parameters + master + gradients + optimizer + reference + rollout
    # Under accumulation: DDP's no_sync micro-batches' gradients are autograd's own tensors beside its buckets
    # until the synchronising backward copies them in (from the second step on, measured: +4Ψ); ZeRO-1 (without
    # overlap_comm) keeps every gradient whole until the boundary's reduction (cΨ, not cΨ/N)
    later = 0
    if accumulation > 1 and n > 1:
        later = 4 * t if kind == "ddp" else c * t * (n - 1) / n if kind == "deepspeed" and stage == 1 else 0
    return {
        **{k: int(v) for k, v in categories.items()},
        "model_state": int(model_state),
        "activations": int(activations),
        "activation_checkpointing": checkpointing,
        "step_transient": int(step_transient),
        "sampling": int(sampling),
        "loading_peak": int(loading),
        "tensors_peak": int(max(model_state + buckets + max(activations + step_transient, sampling), loading)),
        "accumulation_transient": int(later),
        "run_tensors_peak": int(
            max(model_state + buckets + max(activations + step_transient + later, sampling), loading)
        ),
    }


def process_baseline_mb(strategy: dict) -> float:
    """This process's resident set after the imports a run makes (its start-up on a CPU host)."""
    import accelerate  # noqa: F401
    import datasets  # noqa: F401

    if strategy["strategy"] == "deepspeed":  # as a run imports it (without mlflow: common.launch.accelerator)
        from common.launch.accelerator import import_deepspeed

        import_deepspeed()
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) / 1024 for line in handle if line.startswith("VmRSS"))
