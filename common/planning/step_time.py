"""The step-time model: the shipped configs ranked for a job by estimated memory and step time.

The configs it ranks: on one device single.yaml and the three offload configs; on one node ddp, fsdp,
fsdp_shard_grad_op, fsdp_offload, zero1, zero2, zero2_offload, zero3, zero3_offload, the row-splitting
zero3_ulysses and fsdp_cp (not for dpo.py and reward_model.py, which refuse them), the tensor-parallel tp and fsdp_tp
(not with --use_peft, which they refuse), the pipelines pp and dp_pp (causal_lm.py and sft.py only, without LoRA, on
a model common.parallel.pipeline splits: a Llama with a layer for every stage) and ep (a mixture-of-experts model
whose experts the devices divide, without LoRA: its all-to-alls in the traffic, its experts never gathered); on
several nodes the five
multi_node_*.yaml (its TP template not with --use_peft). A config that cannot run the job is listed under the table
with why; asked for by --configs, it is refused in one line. Not ranked: zero2_json.yaml (zero2.yaml's twin).

For a model (a config.json, a model folder or a Hub name; read on the meta device), the devices
(how many, on how many nodes, their memory) and the job (the recipe, --use_peft, sequence length, global batch
in sequences (DPO: pairs) per optimizer step), each config is tried at every micro-batch that divides the
per-device batch, with activation checkpointing off and on, and at each of its layouts: zero3_ulysses.yaml at
every sp_size that divides the devices and the attention heads, fsdp_cp.yaml at every cp_size that divides the
devices (rows split over that many devices, for sequences whose activations fit no device whole); tp.yaml at
tp_size = the devices, fsdp_tp.yaml (multi_node_hsdp_tp.yaml) at every smaller tp_size that divides a node's
devices, where the heads divide by it; pp.yaml as one pipeline over the devices, dp_pp.yaml at every smaller
pp_size that divides them, each under 1F1B and Interleaved1F1B (GPipe: 1F1B's bubble, every micro-batch's
activations held). A group of ranks that trains one batch together (sp, cp, tp, or a pipeline's pp) reads the
global batch over processes / the group per step, so a rank computes the same tokens as under any other config
(a pipeline's rank: its stages' share of them); under a pipeline the micro-batches of a step are the accumulation:

* memory per device: `make estimate-memory`'s peak from the second step on (checked against measured
  memory for every config in docs/benchmark.md; under TP a rank's share of the plan's split and its split
  activations), within --headroom of the device's memory; with offload on a GPU, what lives in CPU RAM counts
  against the node's RAM (--host_memory_gb), as does the model's build (FSDP's on rank 0; every rank's whole
  fp32 copy under DDP, ZeRO-1/2, TP and pipelines). Under a pipeline, estimate-memory's rank that needs the most
  (estimate_stages: its stages' layers, the split of common.parallel.pipeline.stage_layers, with their gradients and
  AdamW
  moments, the receive buffers, and the activations of the micro-batches its schedule keeps in flight);
* step time: compute (the model's training FLOPs, 6 per matmul weight per token plus attention's,
  4/3 of that with activation checkpointing, at --mfu of the device's peak) + communication (the
  bytes each config's all_reduce, all_gather and reduce_scatter move per step, ring algorithms,
  each at its bus bandwidth: what `make doctor` reports as busbw, read from its --report with
  --doctor_report) + the optimizer step and autocast's weight casts (bytes through device memory)
  + offload traffic (the host link) and the CPU optimizer step (host memory); under sequence parallelism
  ZeRO-3's traffic for each micro-step and Ulysses' all-to-alls, at all_gather's busbw (context
  parallelism: FSDP2's for each micro-step and the ring's keys and values, the same way). On a GPU
  communication overlaps compute (NCCL runs on its own streams): the step is the larger of the two;
  on a CPU host they share the cores: the sum. What a step waits for is added on a GPU too: tensor
  parallelism's collectives inside the model (per layer and micro-batch 2 all-reduces of the activations
  forward, 5 backward, the embeddings' and the head's, and the logits gathered, over the tp group:
  `tensor_parallel_bytes`; FSDP2's over the shards beside them overlaps as above), and after a pipeline's
  schedule dp_pp's all-reduce of each stage's gradients over its replicas. A pipeline's compute is its busiest
  rank's stages' for the step's m micro-batches, stretched by the bubble: (v m + p - 1) / (v m) of it, the bubble
  (p - 1) / (v m + p - 1) of the step printed (p ranks, v stages a rank: 2 under Interleaved1F1B); each stage
  boundary passes a micro-batch's hidden state forward and its gradient back (micro-batch x sequence x hidden x
  bytes), overlapped, at all_gather's busbw. Steps within 2% of the fastest (TIE) are ties (a compute-bound
  step): they go to the config that needs less CPU RAM per node (the RAM it assumes is printed: the preset's,
  this host's available memory, or --host_memory_gb), then less traffic, then less device memory;
* the job: --use_peft trains LoRA's adapters only (their gradients and AdamW state; the frozen weights' own
  gradients not computed); --recipe dpo adds the frozen reference copy (none with --use_peft, unless the run
  starts from an adapter, as DPO after a LoRA SFT does: its reference, base + that adapter, is a frozen copy
  as without --use_peft), two rows a pair and the reference's forward.

The fastest config that fits is written as a ready accelerate YAML (num_processes, num_machines, the layout's
sizes and schedule, FSDP's activation checkpointing set; the recipe arguments it assumes in its header), and the
command to launch it is printed; an existing file is kept unless --overwrite. A device preset's
figures are data-sheet peaks and typical links: pass your own (--peak_tflops, --link_gbps, ...) or
`make doctor`'s measurement. With --device cpu (the default without a GPU) this host's matmul
rate and memory bandwidth are measured, and the link is make doctor's report. The estimates are
checked against measured runs by make benchmark-choice (docs/choose-config.md).

scripts/choose_config.py (make choose-config) prints the ranking and writes the chosen YAML.
"""

from __future__ import annotations

import functools
import os
import time

from common.planning.memory import REPO, estimate, process_baseline_mb, read_strategy


GB = 1e9
# Dense bf16 peak and fp32 peak without TF32, which the recipes leave off (data sheets), memory, HBM
# bandwidth, intra-node all_reduce busbw (nccl-tests on 8 GPUs over NVLink, typical), host link (PCIe,
# one direction), CPU RAM per node (DGX systems'), all in GB or GB/s.
DEVICES = {
    "h100": {
        "tflops": 989.4,
        "tflops_fp32": 66.9,
        "memory_gb": 80,
        "memory_gbps": 3350,
        "link_gbps": 360,
        "host_link_gbps": 50,
        "host_memory_gb": 2048,
    },
    "h200": {
        "tflops": 989.4,
        "tflops_fp32": 66.9,
        "memory_gb": 141,
        "memory_gbps": 4800,
        "link_gbps": 360,
        "host_link_gbps": 50,
        "host_memory_gb": 2048,
    },
    "a100": {
        "tflops": 312.0,
        "tflops_fp32": 19.5,
        "memory_gb": 80,
        "memory_gbps": 2039,
        "link_gbps": 230,
        "host_link_gbps": 25,
        "host_memory_gb": 1024,
    },
}
SINGLE_NODE = [
    "ddp.yaml",
    "fsdp.yaml",
    "fsdp_shard_grad_op.yaml",
    "fsdp_offload.yaml",
    "zero1.yaml",
    "zero2.yaml",
    "zero2_offload.yaml",
    "zero3.yaml",
    "zero3_offload.yaml",
]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# Step times within 2% of the fastest are a tie (well inside the estimate's own error, docs/choose-config.md): it
# goes to the config that needs less CPU RAM per node, then less traffic, then less device memory.
TIE = 0.02
ONE_DEVICE = ["single.yaml", "fsdp_offload.yaml", "zero2_offload.yaml", "zero3_offload.yaml"]
# rows split over sp_size (cp_size) devices: tried at every size that divides the devices (Ulysses: and the heads)
SEQUENCE_PARALLEL = ["zero3_ulysses.yaml", "fsdp_cp.yaml"]
# ep.yaml: a mixture-of-experts model's experts split over every device (ep_size = the devices), the rest FSDP2's;
# fsdp_ep.yaml: over groups of every ep_size below that divides the devices, each expert FSDP2-sharded over the groups
EXPERT_PARALLEL = ["ep.yaml", "fsdp_ep.yaml"]
# tp.yaml: one group of tp_size = the devices; fsdp_tp.yaml: groups of every tp_size that divides them (dp_shard the
# rest); multi_node_hsdp_tp.yaml: within a node. A group of tp ranks trains one batch; not with --use_peft
TENSOR_PARALLEL = ["tp.yaml", "fsdp_tp.yaml"]
MULTI_NODE = [
    "multi_node_ddp.yaml",
    "multi_node_fsdp.yaml",
    "multi_node_hsdp.yaml",
    "multi_node_zero3.yaml",
    "multi_node_hsdp_tp.yaml",
]
# pp.yaml: one pipeline over the devices; dp_pp.yaml: pipelines of every pp_size that divides them, data-parallel
# replicas beside. Each at 1F1B and Interleaved1F1B (GPipe: 1F1B's bubble with every micro-batch's activations held).
# Only causal_lm.py and sft.py, without LoRA, on a Llama-architecture model (common.parallel.pipeline)
PIPELINE = ["pp.yaml", "dp_pp.yaml"]
PIPELINE_SCHEDULES = ("1F1B", "Interleaved1F1B")
RECIPES = ("causal_lm", "sft", "dpo", "reward_model", "grpo")
# the recipes scoring whole rows (a pair, one reward per row, a completion's log-probabilities): no pipeline; no split
# rows either, except grpo.py's (it scores each rank's slice of its rows itself: common.parallel.sequence_parallel)
WHOLE_ROWS = ("dpo", "reward_model", "grpo")
UNSPLIT = ("dpo", "reward_model")


def measure_host(compute_dtype, threads: int, model: dict, rows: int) -> dict:
    """This host as one process of the job sees it: the matmul rate of the model's MLP on `rows` tokens
    in the compute dtype, and memory bandwidth (a large tensor add), on `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    h, i = model["hidden_size"], model["intermediate_size"]
    a, b = torch.randn(rows, h, dtype=compute_dtype), torch.randn(h, i, dtype=compute_dtype)
    rates, bandwidths = [], []
    x, y = torch.ones(2**25), torch.ones(2**25)  # 128 MB each
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        rates.append(4 * 2 * rows * h * i / (time.perf_counter() - start) / 1e12)
        start = time.perf_counter()
        torch.add(x, y, out=x)
        bandwidths.append(3 * x.numel() * 4 / (time.perf_counter() - start) / GB)
    return {"tflops": max(rates), "memory_gbps": max(bandwidths)}


def comm_and_memory_traffic(
    s: dict, model: dict, c: int, k: int, n_node: int, nodes: int, trainable: int | None = None, dpo: bool = False
) -> dict:
    """Bytes per device per optimizer step: over the links by collective (bus bytes, as busbw counts them:
    2(N-1)/N x size for an all_reduce, (N-1)/N x size for an all_gather or reduce_scatter), through
    device memory (optimizer step, autocast's casts) and over the host link (offload); and the CPU
    optimizer's parameters. k micro-batches per step. `trainable`: LoRA's adapters, when only they train (their
    gradients reduced, their optimizer stepped; the frozen weights still gathered where sharded). `dpo`: the
    reference model's forward gathers its weights once more per micro-batch under ZeRO-3 and FSDP."""
    psi, n = model["parameters"], s["num_processes"]
    t = psi if trainable is None else trainable
    f = (n - 1) / n
    kind, stage = s["strategy"], s["zero_stage"]
    where = "inter" if nodes > 1 else "intra"
    link = {}
    memory, host, cpu_optimizer = 0.0, 0.0, 0.0
    reference = 1 if dpo else 0  # the reference's forward: one gather more per micro-batch where weights are sharded
    if kind == "ddp":
        link[where, "all_reduce"] = 2 * f * 4 * t  # fp32 gradients, once per step (no_sync in accumulation)
        memory = 28 * t + (k * (4 + c) * psi if c < 4 else 0)  # AdamW over the trained; autocast's weight casts
    elif kind == "fsdp":
        gathers = 2 if s["fsdp_reshard_after_forward"] else 1
        # ep.yaml: each rank's experts are its own, never gathered nor reduce-scattered (stepped as the rest);
        # fsdp_ep.yaml: its ep group's 1/ep of them gathered and reduce-scattered over the n / ep groups
        experts = model["expert_parameters"] if s.get("ep_size", 1) > 1 else 0
        groups = n // s["ep_size"] if experts else 1
        if s["replicas"] > 1:  # HSDP: shard within a node, all-reduce the shards across nodes
            link["intra", "all_gather"] = k * (gathers + reference) * c * psi * (n_node - 1) / n_node
            link["intra", "reduce_scatter"] = k * c * t * (n_node - 1) / n_node
            link["inter", "all_reduce"] = k * 2 * (nodes - 1) / nodes * c * t / n_node
        else:  # all-gathers, and a reduce-scatter per micro-batch (common.launch.accelerator)
            link[where, "all_gather"] = k * (gathers + reference) * c * (psi - experts) * f
            link[where, "reduce_scatter"] = k * c * (t - experts) * f
            if groups > 1:  # fsdp_ep.yaml's expert shards, on one node (its ep groups within it)
                share = experts / s["ep_size"] * (groups - 1) / groups
                link[where, "all_gather"] += k * (gathers + reference) * c * share
                link[where, "reduce_scatter"] += k * c * share
        over = n_node if s["replicas"] > 1 else n  # the ranks a shard is cut over
        shard, trained = (psi - experts) / over, t / over
        memory = k * (gathers + reference) * (4 + c) * shard  # each gather casts the fp32 shard
        if groups > 1:
            memory += k * (gathers + reference) * (4 + c) * experts / n
        if s["offload_params"]:
            host = k * ((gathers + reference) * 4 * shard + c * trained)  # shards to the device, gradients back
            cpu_optimizer = trained
        else:
            memory += 28 * trained
    else:
        # ZeRO-3 gathers per micro-batch, ZeRO-1/2 the updated weights once; ZeRO-1 reduces at the boundary only
        link[where, "all_gather"] = (k * (2 + reference) * psi if stage == 3 else t) * c * f
        link[where, "reduce_scatter"] = (1 if stage == 1 else k) * c * t * f
        if s["offload"]:
            host = (k + 1) * c * t / n + ((2 + reference) * k * c * psi / n if s["offload_params"] else 0)
            cpu_optimizer = t / n
        else:
            memory = (28 + 8 + 2 * c) * t / n  # AdamW, and the copies between fp32 and compute dtype
    return {"link": link, "memory": memory, "host": host, "cpu_optimizer": cpu_optimizer}


def sequence_exchange_bytes(model: dict, tokens: int, sp: int, c: int, micro_steps: int, checkpointing: bool) -> float:
    """Bus bytes per device per optimizer step of Ulysses' all-to-alls: per layer and micro-step the slice's
    queries, keys and values go out and the attention output comes back (forward; the same again backward,
    and the forward once more with activation checkpointing), each (sp-1)/sp of `tokens` x its width."""
    width = 2 * model["hidden_size"] + 2 * model["kv_hidden_size"]
    passes = 3 if checkpointing else 2
    return micro_steps * passes * model["layers"] * tokens * width * c * (sp - 1) / sp


def expert_exchange_bytes(model: dict, tokens: int, ep: int, c: int, micro_steps: int, checkpointing: bool) -> float:
    """Bus bytes per device per optimizer step of ep.yaml's and fsdp_ep.yaml's all-to-alls over groups of ep ranks
    (common.parallel.expert_parallel's Traffic counts the same): per MoE layer and micro-step each of a rank's `tokens`
    goes to its top-k experts and comes back (forward), and both again as gradients (backward), the forward once more
    with activation checkpointing; the (ep-1)/ep of it whose expert another rank holds (an even routing), a hidden-size
    row in the compute dtype each."""
    passes = 6 if checkpointing else 4
    routed = tokens * model["experts_per_token"] * model["hidden_size"] * c
    return micro_steps * passes * model["moe_layers"] * routed * (ep - 1) / ep


def ring_exchange_bytes(model: dict, tokens: int, cp: int, c: int, micro_steps: int, checkpointing: bool) -> float:
    """Bus bytes per device per optimizer step of ring attention (torch's all-gather rotation): per layer and
    micro-step the keys and values of the whole rows (`tokens`) gathered forward, gathered again backward and their
    gradients passed back round the ring (and the forward once more with activation checkpointing), each
    (cp-1)/cp of it."""
    passes = 4 if checkpointing else 3
    return micro_steps * passes * model["layers"] * tokens * 2 * model["kv_hidden_size"] * c * (cp - 1) / cp


def tensor_parallel_bytes(
    model: dict, tokens: int, tp: int, c: int, micro_steps: int, checkpointing: bool, reference: bool = False
) -> dict:
    """Bus bytes per device per optimizer step of tensor parallelism's collectives inside the model, over a group of
    tp ranks, as transformers' plan runs them (common.parallel.tensor_parallel; Llama's plan as resolved,
    common.launch.internals):
    per micro-step, forward an all-reduce of each layer's attention output (o_proj, rowwise) and MLP output
    (down_proj), and of the embeddings' output (split by vocabulary rows); backward one of each colwise projection's
    input gradient (q, k, v, gate and up: 5 a layer) and of the head's; activation checkpointing runs the layers'
    forward 2 again, DPO's reference forward (`reference`) its 2 a layer and the embeddings' again; each 2(tp-1)/tp of
    `tokens` x hidden. And the logits gathered (the head is colwise, its output gathered; the reference's too),
    (tp-1)/tp of `tokens` x vocabulary. (Counted with torch's CommDebugMode on 2 processes, 2 layers: forward 5
    all-reduces and 1 all-gather, backward 11.) No sequence parallelism: the norms' inputs stay whole, as the configs
    run."""
    h, layers = model["hidden_size"], model["layers"]
    forwards = 1 + checkpointing + reference
    reduces = layers * (2 * forwards + 5) + 1 + (1 + reference)
    return {
        "all_reduce": micro_steps * reduces * 2 * (tp - 1) / tp * tokens * h * c,
        "all_gather": micro_steps * (1 + reference) * (tp - 1) / tp * tokens * model["vocab_size"] * c,
    }


def pipeline_ranks(model: dict, size: int, stages_per_rank: int) -> list[dict]:
    """Each pipeline rank's share of the work: its stages' decoder layers (common.parallel.pipeline.stage_layers, the
    embeddings and the head counted as a layer each, as make estimate-memory's estimate_stages splits them), the
    weights its tokens multiply (its layers' share of the model's, and the head's on the last stage's rank), its
    parameters, and the activations it sends a micro-batch (forward from each stage but the last, their gradients
    back from each but the first)."""
    from common.parallel.pipeline import stage_layers

    num_stages = size * stages_per_rank
    layers = stage_layers(model["layers"], num_stages)
    embeddings, head = model["embedding_parameters"], model["head_parameters"]
    final_norm = model["root_parameters"] - embeddings - (0 if model["tied_embeddings"] else head)
    per_layer_matmul = (model["matmul_parameters"] - head) / model["layers"]  # the head: a vocab x hidden matmul
    ranks = []
    for rank in range(size):
        stages = [rank + size * loop for loop in range(stages_per_rank)]
        count = sum(len(layers[stage]) for stage in stages)
        first, last = 0 in stages, num_stages - 1 in stages
        ranks.append(
            {
                "layers": count,
                "parameters": count * model["largest_layer"]
                + (embeddings if first else 0)
                + (final_norm + head if last else 0),
                "matmul_parameters": count * per_layer_matmul + (head if last else 0),
                "sends": sum((stage < num_stages - 1) + (stage > 0) for stage in stages),
            }
        )
    return ranks


def tensor_parallel_traffic(
    s: dict, model: dict, c: int, k: int, n_node: int, nodes: int, trainable, dpo: bool, tokens: int, est: dict
) -> dict:
    """comm_and_memory_traffic's bytes for the data-parallel side of a tensor-parallel config, on a TP rank's share of
    the parameters (the plan's split 1/tp, the rest whole): none under tp.yaml (one group), FSDP2's over the
    dp_shard ranks under fsdp_tp.yaml (and HSDP's across nodes); and under "serial" the group's own collectives
    (tensor_parallel_bytes, with DPO's reference forward), which a layer waits for: on the critical path."""
    tp = s["tp_size"]
    local = int(model["parameters"] - model["tp_split_parameters"] * (tp - 1) / tp)
    data = dict(s, strategy="ddp" if s["strategy"] == "tp" else s["strategy"], num_processes=s["num_processes"] // tp)
    traffic = comm_and_memory_traffic(data, dict(model, parameters=local), c, k, n_node // tp, nodes, trainable, dpo)
    group = tensor_parallel_bytes(model, tokens, tp, c, k, est["activation_checkpointing"], dpo)
    traffic["serial"] = {("intra", op): size for op, size in group.items()}
    return traffic


def pipeline_traffic_and_compute(
    model: dict, s: dict, micro: int, seq_len: int, micro_batches: int, n: int, c: int, checkpointing: bool
) -> tuple[dict, float, float]:
    """A pipeline rank's step (p ranks, v stages each, m micro-batches): its traffic, its FLOPs and the bubble.

    FLOPs: the busiest rank's (its stages' matmul weights and attention: `pipeline_ranks`) for each micro-batch,
    times m, stretched by the bubble: the schedule's step lasts (v m + p - 1) slots of a micro-batch's stage work,
    (p - 1) / (v m + p - 1) of it idle. Over the links (overlapped with compute on a GPU: torch's schedules post
    their sends and receives asynchronously): each stage boundary carries a micro-batch's hidden state forward and
    its gradient back (micro x seq_len x hidden x c each), the busiest rank sending its share, at all_gather's busbw.
    After the schedule (in "serial": on the critical path): with data-parallel replicas each stage's fp32 gradients
    all-reduced over them (common.parallel.pipeline's sum_over_replicas), and a tied weight's gradient between the
    first and the last stage's ranks. Through device memory: AdamW over the rank's parameters, and autocast's casts of
    its weights once (the window runs in one autocast context)."""
    p, v, m, h = s["pp_size"], s["stages_per_rank"], micro_batches, model["hidden_size"]
    ranks = pipeline_ranks(model, p, v)

    def flops_per_token(share: dict) -> float:
        forward = 2 * share["matmul_parameters"] + 4 * share["layers"] * h * seq_len
        return forward * (2 if checkpointing else 1) + 2 * forward

    bubble = (p - 1) / (v * m + p - 1)
    flops = m * micro * seq_len * max(flops_per_token(share) for share in ranks) / (1 - bubble)
    largest = max(share["parameters"] for share in ranks)
    link = {("intra", "p2p"): m * max(share["sends"] for share in ranks) * micro * seq_len * h * c}
    serial, replicas = {("intra", "all_reduce"): 0.0}, n // p
    if replicas > 1:
        serial["intra", "all_reduce"] += 2 * (replicas - 1) / replicas * 4 * largest
    if model["tied_embeddings"]:  # two ranks: 2 x 1/2 of the fp32 weight
        serial["intra", "all_reduce"] += 4 * model["embedding_parameters"]
    memory = 28 * largest + ((4 + c) * largest if c < 4 else 0)
    traffic = {"link": link, "serial": serial, "memory": memory, "host": 0.0, "cpu_optimizer": 0.0}
    return traffic, flops, bubble


def link_seconds(link: dict, device: dict) -> float:
    """Seconds of {(intra or inter, collective): bus bytes} at the device's busbw; all-to-alls and point-to-point
    sends at all_gather's."""
    return sum(
        size
        / (
            device["link_gbps" if where == "intra" else "inter_node_gbps"][
                "all_gather" if op in ("all_to_all", "p2p") else op
            ]
            * GB
        )
        for (where, op), size in link.items()
        if size
    )


def device_and_host_bytes(est: dict, s: dict, on_gpu: bool) -> tuple[float, float]:
    """Bytes per device, and per process in CPU RAM. On a CPU host it is all one memory (the estimate's
    peak, FSDP's whole-model loading included). On a GPU, offload moves the master copy and the
    optimizer (under parameter offload, the parameters and gradients; under ZeRO-1/2 offload, the fp32
    gradient partition) to CPU RAM."""
    if not on_gpu:
        return est["run_tensors_peak"], 0.0
    training = est["activations"] + est["step_transient"] + est["accumulation_transient"]
    # GRPO's sampling (its KV cache and logits) comes between the steps, not beside their activations
    live = est["model_state"] + est["communication_buffers"] + max(training, est["sampling"])
    moved = 0.0
    if s["offload"] or s["offload_params"]:
        moved = est["master_weights"] + est["optimizer_states"]
        if s["strategy"] == "fsdp" or s["offload_params"]:
            moved += est["parameters"] + est["gradients"]
        else:
            moved += est["optimizer_states"] / 2  # the fp32 gradient partition: one Adam moment's size
    return live - moved, moved


@functools.lru_cache
def process_baseline_bytes(deepspeed: bool) -> float:
    """A run's process after its imports (its start-up on a CPU host), as make estimate-memory measures it:
    this process, which has built the model on the meta device (asked without DeepSpeed first)."""
    return process_baseline_mb({"strategy": "deepspeed" if deepspeed else "ddp"}) * 2**20


@functools.lru_cache(maxsize=4)
def meta_model(name: str, vocab_size: int | None):
    """The model built on the meta device (no weights), for the splitting rules of common.parallel.tensor_parallel and
    common.parallel.pipeline."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(name, **({"vocab_size": vocab_size} if vocab_size else {}))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def pipeline_size(name: str) -> int:
    """A shipped config's parallelism_config_pp_size (1: no pipeline)."""
    import yaml

    with open(os.path.join(REPO, "accelerate_configs", name)) as handle:
        block = (yaml.safe_load(handle) or {}).get("parallelism_config") or {}
    return int(block.get("parallelism_config_pp_size", 1))


def config_strategy(name: str, args) -> dict:
    """read_strategy of a shipped config over --num_devices processes (a pipeline's read at its own world size, which
    its pp_size divides: layouts() picks the sizes that divide the devices)."""
    path = os.path.join(REPO, "accelerate_configs", name)
    pipeline = pipeline_size(name) > 1
    # (ep.yaml's ep_size read as the devices; fsdp_ep.yaml's set by each layout: device_layouts)
    strategy = read_strategy(path, None if pipeline else args.num_devices, args.mixed_precision)
    return dict(
        strategy,
        num_processes=args.num_devices,
    )


def layouts(name: str, s: dict, args) -> list[dict] | str:
    """`device_layouts`, and for recipes/grpo.py only those where a device's completions a step are whole groups of
    --num_generations (the recipe refuses the others at start: each process samples whole groups)."""
    ways = device_layouts(name, s, args)
    if args.recipe != "grpo" or isinstance(ways, str):
        return ways
    per_device = {id(way): args.global_batch * way["sp"] * way["tp"] * way["pp"] // args.num_devices for way in ways}
    whole = [way for way in ways if per_device[id(way)] % args.num_generations == 0]
    if not whole:
        return (
            f"a device's {min(per_device.values())} completions a step are not whole groups of --num_generations "
            f"{args.num_generations}: each process samples whole groups (use a --global_batch that is a multiple of "
            f"{args.num_generations} x the data-parallel ranks)"
        )
    return whole


def device_layouts(name: str, s: dict, args) -> list[dict] | str:
    """How a config can lay the devices out for this job, each {"sp", "tp", "pp", "schedule"} (their product: the
    ranks that train one batch together), or why it cannot run it (one line): sequence and context parallelism at
    every size that divides the devices (Ulysses: and the heads); tensor parallelism at tp_size = the devices (tp.yaml)
    or every size below that divides a node's devices (fsdp_tp.yaml, multi_node_hsdp_tp.yaml), where the model's plan
    splits; a pipeline over the devices (pp.yaml) or at every pp_size below that divides them (dp_pp.yaml), at each
    schedule of --pp_schedules, where common.parallel.pipeline splits the model into that many stages; a MoE's experts
    (an "ep" size, each rank still its own batch) over the devices (ep.yaml) or groups of every ep_size below that
    divides them (fsdp_ep.yaml), where the experts divide by it."""
    from common.launch.mesh import PipelineSettings
    from common.parallel import pipeline, tensor_parallel

    n, n_node = args.num_devices, args.num_devices // args.num_nodes
    whole = {"sp": 1, "tp": 1, "pp": 1, "schedule": None}
    if s.get("ep_size", 1) > 1:  # ep.yaml at ep = the devices; fsdp_ep.yaml at every ep below that divides them
        from common.parallel import expert_parallel

        if args.use_peft:
            return "--use_peft: LoRA's adapters on the experts' stacked weights are refused (common.parallel.expert_parallel)"
        model = meta_model(args.model, args.vocab_size)
        sizes = [n] if name == "ep.yaml" else [ep for ep in range(2, n) if n % ep == 0]
        problems = {ep: expert_parallel.model_problems(model, ep) for ep in sizes}
        fitting = [dict(whole, ep=ep) for ep in sizes if not problems[ep]]
        if fitting:
            return fitting
        return next(iter(problems.values()))[0] if sizes else f"no ep_size below {n} devices divides them"
    if s.get("sp_size", 1) > 1 or s.get("cp_size", 1) > 1:
        ring = s.get("cp_size", 1) > 1  # fsdp_cp.yaml's split, else zero3_ulysses.yaml's
        built = meta_model(args.model, args.vocab_size).config
        heads = (built.num_attention_heads, getattr(built, "num_key_value_heads", None) or built.num_attention_heads)
        sizes = [sp for sp in range(2, n + 1) if n % sp == 0 and (ring or all(h % sp == 0 for h in heads))]
        return [dict(whole, sp=sp) for sp in sizes] or f"no split of {n} devices divides the heads {heads}"
    if s["tp_size"] > 1:
        if args.use_peft:
            return (
                "--use_peft: LoRA's adapters would wrap projections the tensor-parallel plan splits "
                "(common.parallel.tensor_parallel)"
            )
        sizes = [n] if s["strategy"] == "tp" else [tp for tp in range(2, n_node) if n_node % tp == 0]
        if not sizes:
            return f"it needs 4 or more devices a node (tp_size and dp_shard_size of 2 or more; tp.yaml: one group of {n})"
        built = meta_model(args.model, args.vocab_size)
        problems = {tp: tensor_parallel.model_problems(built, tp) for tp in sizes}
        return [dict(whole, tp=tp) for tp in sizes if not problems[tp]] or problems[sizes[-1]][0]
    if pipeline_size(name) > 1:
        if args.recipe in WHOLE_ROWS:
            return (
                f"recipes/{args.recipe}.py scores whole rows, which pipeline parallelism does not run "
                "(common.parallel.pipeline)"
            )
        if args.use_peft:
            return (
                "--use_peft under pipeline parallelism: LoRA's frozen base and adapters are not split into stages here"
            )
        sizes = [n] if name == "pp.yaml" else [pp for pp in range(2, n) if n % pp == 0]
        if not sizes:
            return (
                f"it needs 4 or more devices (pipelines of 2 or more stages, 2 or more of them; pp.yaml: one of {n})"
            )
        built = meta_model(args.model, args.vocab_size)
        ways, problems = [], []
        for pp in sizes:
            for schedule in args.pp_schedules:
                problem = pipeline.model_problems(built, PipelineSettings(pp, schedule))
                problems += problem
                ways += [] if problem else [dict(whole, pp=pp, schedule=schedule)]
        return ways or problems[0]
    return [whole]


def candidates(args) -> tuple[dict, dict]:
    """The shipped configs for this many devices and nodes and this job, each with its layouts (--configs: only those
    of them), and those that cannot run it with why: on one device, single.yaml and the offload configs; on one node,
    SINGLE_NODE, SEQUENCE_PARALLEL (not for dpo.py and reward_model.py), TENSOR_PARALLEL (not with --use_peft), PIPELINE (causal_lm.py
    and sft.py without LoRA) and EXPERT_PARALLEL (a MoE whose experts the devices divide, without LoRA); on several, MULTI_NODE (its TP template not with --use_peft). A config asked by
    --configs that cannot run is refused in one line."""
    splits = (
        SEQUENCE_PARALLEL if args.recipe not in UNSPLIT else []
    )  # dpo.py and reward_model.py refuse split rows (common.parallel.sequence_parallel)
    shipped = (
        MULTI_NODE
        if args.num_nodes > 1
        else ONE_DEVICE
        if args.num_devices == 1
        else SINGLE_NODE + splits + TENSOR_PARALLEL + PIPELINE + EXPERT_PARALLEL
    )
    unknown = [name for name in args.configs or [] if name not in shipped]
    why = next(
        (
            f"{name} is ranked on one node only (sequence and context parallelism ship as single-node configs); choose from"
            if name in SEQUENCE_PARALLEL and args.num_nodes > 1
            else f"recipes/{args.recipe}.py does not run under {name} (it scores whole rows); choose from"
            if name in SEQUENCE_PARALLEL and args.recipe in UNSPLIT
            else f"{name} is ranked on one node only (a node's devices make its groups; several nodes: "
            "multi_node_hsdp_tp.yaml); choose from"
            if name in TENSOR_PARALLEL + PIPELINE and args.num_nodes > 1
            else None
            for name in unknown
        ),
        None,
    )
    if why:
        raise SystemExit(f"error: --configs {' '.join(unknown)}: {why} {' '.join(shipped)}")
    if unknown:
        raise SystemExit(
            f"error: --configs {' '.join(unknown)}: not among the configs for {args.num_devices} "
            f"device(s) on {args.num_nodes} node(s); choose from {' '.join(shipped)}"
        )
    ranked, not_ranked = {}, {}
    for name in (name for name in shipped if name in (args.configs or shipped)):
        ways = layouts(name, config_strategy(name, args), args)
        if isinstance(ways, str):
            not_ranked[name] = ways
        else:
            ranked[name] = ways
    if args.configs and not_ranked:
        name, why = next(iter(not_ranked.items()))
        raise SystemExit(f"error: --configs {name}: it cannot run this job: {why}")
    return ranked, not_ranked


def rank(args, model: dict, device: dict, configs: dict) -> list[dict]:
    """Each config (`configs`: its layouts) at its fastest (layout, micro-batch, checkpointing) that fits, or its
    smallest if none does; sorted fastest first, steps within TIE of the fastest counted as ties that go to less CPU
    RAM per node, then less traffic, then less device memory.

    A group of ranks that trains one batch together (sp ranks under sequence parallelism, cp under context
    parallelism, tp under tensor parallelism, a pipeline's pp: common.launch.mesh's data_parallel_size is processes /
    the group) reads the global batch over the devices times the group per step, so a rank computes the same tokens per
    step as under any other config; a pipeline's ranks each compute their stages' share of them, stretched by the
    bubble."""
    n, nodes = args.num_devices, args.num_nodes
    n_node = n // nodes
    on_gpu = args.device != "cpu"
    c = 2 if args.mixed_precision in ("bf16", "fp16") else 4
    dpo, lora, grpo = args.recipe == "dpo", args.use_peft, args.recipe == "grpo"
    generations = args.num_generations if grpo else None  # GRPO's rollout: the copy sampled from, the KV cache
    rows_per_example = 2 if args.recipe in ("dpo", "reward_model") else 1  # a pair is two rows, chosen and rejected
    trainable = model["lora_parameters"] if lora else None
    h = model["hidden_size"]
    # FLOPs per token: forward 2 per matmul weight plus attention's scores (4 L h s), backward twice the forward
    # (LoRA: the frozen weights' own gradients skipped, 2 per weight less); activation checkpointing runs the forward
    # again, and DPO's reference model (a frozen copy, or with LoRA the model without its adapters) once more
    attention = 4 * model["layers"] * h * args.seq_len
    forward = 2 * model["matmul_parameters"] + attention
    backward = (2 if lora else 4) * model["matmul_parameters"] + 2 * attention
    device_limit, host_limit = device["memory_gb"] * GB * (1 - args.headroom), args.host_memory_gb * GB
    if not on_gpu:
        process_baseline_bytes(False)  # before DeepSpeed's import, which the DeepSpeed configs' figure adds
    rows = []
    for name, ways in configs.items():
        s = config_strategy(name, args)
        if s["replicas"] > 1:
            s["replicas"] = nodes
        baseline = 0.0 if on_gpu else process_baseline_bytes(s["strategy"] == "deepspeed")
        options = []
        ring = s.get("cp_size", 1) > 1  # fsdp_cp.yaml's split, else zero3_ulysses.yaml's (1: rows whole)
        for way in ways:
            sp, tp, pp = way["sp"], way["tp"], way["pp"]
            stages_per_rank = 2 if way["schedule"] == "Interleaved1F1B" else 1
            group = sp * tp * pp
            per_device = args.global_batch * group // n  # the global batch over the data-parallel ranks, n / group
            for micro in [
                m for m in range(per_device, 0, -1) if per_device % m == 0 and args.micro_batch in (None, m)
            ]:
                k = per_device // micro  # micro-steps per optimizer step (under a pipeline: its micro-batches)
                if stages_per_rank > 1 and k % max(1, k // pp):  # torch's interleaved schedule needs whole rounds
                    continue
                for checkpointing in {"auto": (False, True), "off": (False,), "on": (True,)}[
                    args.activation_checkpointing
                ]:
                    s = dict(s, **{"cp_size" if ring else "sp_size": sp})
                    if "ep" in way:  # ep.yaml's and fsdp_ep.yaml's split of the experts
                        s["ep_size"] = way["ep"]
                    s.update(tp_size=tp, pp_size=pp, pp_schedule=way["schedule"], stages_per_rank=stages_per_rank)
                    sharding = dict(s, num_processes=n_node) if s["replicas"] > 1 else s
                    serial = {}  # bus bytes on the critical path: not overlapped with compute on a GPU either
                    if pp > 1:  # make estimate-memory's rank of the pipeline that needs the most (estimate_stages)
                        est = estimate(model, s, micro, args.seq_len, checkpointing, k)
                        traffic, flops, bubble = pipeline_traffic_and_compute(
                            model, s, micro, args.seq_len, k, n, c, est["activation_checkpointing"]
                        )
                        serial = traffic.pop("serial")
                        compute = flops / (device["tflops"] * 1e12 * args.mfu)
                    else:
                        est = estimate(
                            model,
                            sharding,
                            micro * rows_per_example,
                            args.seq_len,
                            checkpointing,
                            k,
                            dpo and not lora,
                            trainable,
                            generations,
                        )
                        traffic = (
                            tensor_parallel_traffic(
                                s,
                                model,
                                c,
                                k,
                                n_node,
                                nodes,
                                trainable,
                                dpo,
                                micro * rows_per_example * args.seq_len,
                                est,
                            )
                            if tp > 1
                            else comm_and_memory_traffic(s, model, c, k, n_node, nodes, trainable, dpo)
                        )
                        if tp > 1:
                            serial = traffic.pop("serial")
                        if s.get("ep_size", 1) > 1:  # the experts' dispatch and combine, at all_gather's busbw
                            traffic["link"][where_of(nodes), "all_to_all"] = expert_exchange_bytes(
                                model,
                                micro * rows_per_example * args.seq_len,
                                s["ep_size"],
                                c,
                                k,
                                est["activation_checkpointing"],
                            )
                        if sp > 1:  # at all_gather's busbw
                            traffic["link"][where_of(nodes), "all_to_all"] = (
                                ring_exchange_bytes(
                                    model, micro * args.seq_len, sp, c, k, est["activation_checkpointing"]
                                )
                                if ring
                                else sequence_exchange_bytes(
                                    model, micro * -(-args.seq_len // sp), sp, c, k, est["activation_checkpointing"]
                                )
                            )
                        flops_per_token = (
                            forward * (2 if est["activation_checkpointing"] else 1)
                            + backward
                            + (forward if dpo else 0)
                        )
                        tokens = per_device * rows_per_example * args.seq_len / group  # this rank's share
                        compute = tokens * flops_per_token / (device["tflops"] * 1e12 * args.mfu)
                        bubble = 0.0
                        if grpo:  # the rollout: decoding, and the copy's gather where the weights are sharded
                            compute += decoding_seconds(model, per_device, args, device, c)
                            gathers = traffic["link"].get((where_of(nodes), "all_gather"), 0)
                            traffic["link"][where_of(nodes), "all_gather"] = gathers + est["rollout_weights"]
                    device_bytes, host_bytes = device_and_host_bytes(est, sharding, on_gpu)
                    device_bytes += baseline
                    comm, serial_s = link_seconds(traffic["link"], device), link_seconds(serial, device)
                    other = (
                        traffic["memory"] / (device["memory_gbps"] * GB)
                        + traffic["host"] / (device["host_link_gbps"] * GB)
                        + 28 * traffic["cpu_optimizer"] * n_node / (args.host_memory_gbps * GB)
                    )
                    step = (max(compute, comm) if on_gpu else compute + comm) + serial_s + other
                    host_bytes *= n_node
                    if on_gpu:  # the build comes before training's offloaded state, except FSDP2's rank 0 sharding it
                        load = loading_bytes(est, s, model, n_node)
                        host_bytes = host_bytes + load if s["strategy"] == "fsdp" else max(host_bytes, load)
                    options.append(
                        {
                            "config": name,
                            "micro_batch": micro,
                            "accumulation": k,
                            "group": group,
                            "sp_size": sp,
                            "tp_size": tp,
                            "pp_size": pp,
                            "ep_size": s.get("ep_size", 1),
                            "schedule": way["schedule"],
                            "bubble": bubble,
                            "activation_checkpointing": est["activation_checkpointing"],
                            "fits": device_bytes <= device_limit and host_bytes <= host_limit,
                            "device_gb": device_bytes / GB,
                            "host_gb_per_node": host_bytes / GB,
                            "compute_s": compute,
                            "comm_s": comm + serial_s,
                            "other_s": other,
                            "step_s": step,
                            "strategy": s,
                        }
                    )
        if not options:  # (every micro-batch ruled out by --micro_batch for this layout)
            continue
        fitting = [o for o in options if o["fits"]]
        rows.append(
            min(fitting, key=lambda o: o["step_s"])
            if fitting
            else min(
                options,
                key=lambda o: (
                    (o["device_gb"] > device_limit / GB)
                    + (o["host_gb_per_node"] > host_limit / GB)
                    + o["device_gb"] / 1e6
                ),
            )
        )
    fastest = min((r["step_s"] for r in rows if r["fits"]), default=None)
    rows.sort(
        key=lambda r: (
            not r["fits"],
            (
                (1, r["step_s"], 0, 0)
                if r["step_s"] > fastest * (1 + TIE)
                else (0, r["host_gb_per_node"], r["comm_s"], r["device_gb"])
            )
            if r["fits"]
            else (r["device_gb"],),
        )
    )
    chosen = rows[0] if rows[0]["fits"] else None
    for r in rows:
        if not r["fits"]:
            needs = [f"{r['device_gb']:.1f} GB per device (of {device_limit / GB:.1f})"] * (
                r["device_gb"] > device_limit / GB
            )
            needs += [f"{r['host_gb_per_node']:.0f} GB of CPU RAM per node (of {args.host_memory_gb:.0f})"] * (
                r["host_gb_per_node"] > host_limit / GB
            )
            r["verdict"] = f"does not fit: needs {' and '.join(needs)} at micro-batch {r['micro_batch']}" + (
                " with activation checkpointing" if r["activation_checkpointing"] else ""
            )
        elif r is chosen:
            r["verdict"] = "chosen"
        elif r["step_s"] <= fastest * (1 + TIE):  # a tie: the same step, more CPU RAM, traffic or memory
            more = [
                what
                for what, key in (
                    ("CPU RAM", "host_gb_per_node"),
                    ("communication", "comm_s"),
                    ("memory", "device_gb"),
                )
                if r[key] > chosen[key] * (1 + 1e-9)
            ]
            listed = ", ".join(more[:-1]) + " and " + more[-1] if len(more) > 1 else "".join(more)
            r["verdict"] = "as fast" + (f", more {listed}" if more else "")
        else:
            r["verdict"] = f"slower: {r['step_s'] / chosen['step_s']:.2f}x the chosen"
    return rows


def layout_name(r: dict) -> str:
    """The config and the layout it was ranked at: its sp, cp, tp or pp size (and the pipeline's schedule)."""
    sizes = [
        f"{key} {r[size]}"
        for key, size in (
            ("cp" if r["config"] == "fsdp_cp.yaml" else "sp", "sp_size"),
            ("tp", "tp_size"),
            ("pp", "pp_size"),
            ("ep", "ep_size"),
        )
        if r.get(size, 1) > 1 and (size != "ep_size" or r["config"] == "fsdp_ep.yaml")
    ]
    return " ".join([r["config"], *sizes, *([r["schedule"]] if r["schedule"] else [])])


def decoding_seconds(model: dict, per_device: int, args, device: dict, c: int) -> float:
    """GRPO's decoding on a rank, once a step: its per_device / G prompts decoded one token at a time for
    --max_completion_length tokens, each token a read of the whole weights (cΨ) from device memory, the same under
    every config, since every config samples from whole weights (common.objectives.rollout)."""
    prompts = max(per_device // args.num_generations, 1)
    return prompts * args.max_completion_length * c * model["parameters"] / (device["memory_gbps"] * GB)


def where_of(nodes: int) -> str:
    return "inter" if nodes > 1 else "intra"


def loading_bytes(est: dict, s: dict, model: dict, n_node: int) -> float:
    """CPU RAM per node while the model is built, on a GPU host: FSDP2's whole model on rank 0 (the estimate's
    loading peak); under DDP, ZeRO-1/2, tensor parallelism, a pipeline and FSDP2 without its CPU-RAM-efficient
    loading (fsdp_tp.yaml) every rank builds it whole in fp32 before moving it to its device or keeping its share
    (common.models.loading); ZeRO-3 builds it partitioned (zero.Init)."""
    if s["strategy"] == "fsdp" and s.get("fsdp_cpu_ram_efficient_loading"):
        return est["loading_peak"]
    return 0.0 if s["strategy"] == "deepspeed" and s["zero_stage"] == 3 else n_node * 4.0 * model["parameters"]
