"""A measured prototype of pipeline parallelism: torch.distributed.pipelining over gloo, 2 stages, on CPU.

A LlamaForCausalLM built from a config (same seed on every process) is split by decoder layers into 2 stages, the
way torchtitan splits its models: stage 0 keeps the embeddings and the first half of the layers (final norm and
lm_head replaced by Identity), stage 1 keeps the other half, the final norm and lm_head (embeddings set to None);
both keep the rotary embedding. Each stage trains under ScheduleGPipe and under Schedule1F1B with AdamW, random
token data (seeded), a causal-LM loss that is a token mean over the global batch (each micro-batch's loss is its
token sum divided by the global batch's token count) and gradient clipping by the global norm across both stages.
The same model, data, init and clipping also train in one plain process; the script compares losses, gradient
norms and final weights (tiny_llama.json and llama_100m.json), and step time and peak resident memory (VmHWM)
at the 101M size. Every run starts its own processes (torch.multiprocessing spawn, gloo on a free port).

    python benchmarks/benchmark_pipeline.py          # writes docs/benchmark-pipeline.md (1.5 to 2.5 minutes here)
    make benchmark-pipeline ARGS="--models tiny_llama --docs /tmp/pipeline.md"   # parity only, the tiny model
"""

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "benchmark-pipeline.md")
CONFIGS = {"tiny_llama": "recipes/configs/tiny_llama.json", "llama_100m": "recipes/configs/llama_100m.json"}
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
# Global batch BATCH x SEQ tokens in MICRO micro-batches; STEPS steps; the same AdamW and clipping on both sides.
BATCH, SEQ, MICRO, STEPS, CLIP = 4, 64, 4, 6, 1.0
# The recipes set vocab_size to len(tokenizer): the demo tokenizer's 51 makes llama_100m.json 101,309,440 parameters.
VOCAB = 51
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def free_port() -> int:
    """A TCP port that was free on the loopback interface a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vm_hwm_mb() -> float:
    """This process's peak resident set (VmHWM) in MB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def build_model(config_path: str):
    """A LlamaForCausalLM from the config, seeded, fp32, and a map from parameter ids to their full-model names."""
    config = transformers.AutoConfig.from_pretrained(os.path.join(REPO, config_path), vocab_size=VOCAB)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, {id(p): name for name, p in model.named_parameters()}


class Stage(torch.nn.Module):
    """One pipeline stage: the LlamaForCausalLM with the other stage's modules removed."""

    def __init__(self, model, first: bool):
        super().__init__()
        self.model, self.first = model, first

    def forward(self, x):
        """Token ids (stage 0) or hidden states (stage 1) in; hidden states (stage 0) or logits (stage 1) out."""
        if self.first:
            return self.model(input_ids=x, use_cache=False).logits
        return self.model(inputs_embeds=x, use_cache=False).logits


def split(model, stage: int) -> Stage:
    """Keep stage 0's or stage 1's share of the decoder layers and end modules; the rotary embedding stays."""
    layers, half = model.model.layers, len(model.model.layers) // 2
    if stage == 0:
        model.model.layers = torch.nn.ModuleList(layers[:half])
        model.model.norm, model.lm_head = torch.nn.Identity(), torch.nn.Identity()
    else:
        model.model.layers = torch.nn.ModuleList(layers[half:])
        model.model.embed_tokens = None
    return Stage(model, first=stage == 0)


def make_data(vocab: int) -> torch.Tensor:
    """STEPS batches of BATCH random sequences of SEQ + 1 tokens, the same on every process."""
    return torch.randint(0, vocab, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1234))


def token_loss(global_tokens: int):
    """A loss function whose sum over micro-batches is the token mean over the global batch."""

    def loss_fn(logits, target):
        """Summed token cross-entropy of this micro-batch, divided by the global batch's token count."""
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / global_tokens

    return loss_fn


def clip_global(params, group_size: int) -> float:
    """Clip the gradients by the norm over every stage's gradients (as clip_grad_norm_ would); return that norm."""
    grads = [p.grad for p in params if p.grad is not None]
    squared = torch.stack([g.pow(2).sum() for g in grads]).sum()
    if group_size > 1:
        dist.all_reduce(squared)
    norm = squared.sqrt()
    factor = torch.clamp(CLIP / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(factor)
    return norm.item()


def worker(rank: int, world: int, schedule_name: str, config_path: str, out_dir: str):
    """Train STEPS steps, as one process (world 1) or as pipeline stage `rank`; save losses, times, memory, weights."""
    torch.set_num_threads(os.cpu_count() // world)
    model, names = build_model(config_path)
    data = make_data(model.config.vocab_size)
    loss_fn, losses, norms, times = token_loss(BATCH * SEQ), [], [], []
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        module = split(model, rank)
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        schedule = SCHEDULES[schedule_name](stage, n_microbatches=MICRO, loss_fn=loss_fn, scale_grads=False)
    else:
        module = model
    params = list(module.parameters())
    optimizer = torch.optim.AdamW(params, **ADAMW)
    for step in range(STEPS):
        inputs, target = data[step, :, :-1].contiguous(), data[step, :, 1:].contiguous()
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        if world == 1:
            loss = loss_fn(module(input_ids=inputs, use_cache=False).logits, target)
            loss.backward()
            losses.append(loss.item())
        elif rank == 0:
            schedule.step(inputs)
        else:
            micro_losses = []
            schedule.step(target=target, losses=micro_losses)
            losses.append(sum(m.item() for m in micro_losses))
        norms.append(clip_global(params, world))
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    hwm = vm_hwm_mb()
    state = {names[id(p)]: p.detach().clone() for p in params}
    torch.save(
        {
            "losses": losses,
            "norms": norms,
            "times": times,
            "hwm_mb": hwm,
            "state": state,
            "params": sum(p.numel() for p in params),
        },
        os.path.join(out_dir, f"{schedule_name}_{rank}.pt"),
    )
    if world > 1:
        dist.destroy_process_group()


def launch(schedule_name: str, config_path: str, out_dir: str) -> list:
    """Run one training in fresh processes (1 for "single", 2 for a schedule); return each rank's results."""
    world = 1 if schedule_name == "single" else 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(worker, args=(world, schedule_name, config_path, out_dir), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"{schedule_name}_{r}.pt")) for r in range(world)]


def compare(single: dict, ranks: list) -> dict:
    """Loss, gradient-norm and final-weight gaps of a pipeline run against the single process."""
    rel = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b))  # noqa: E731
    weights = {name: t for r in ranks for name, t in r["state"].items()}
    assert weights.keys() == single["state"].keys(), "the stages do not hold exactly the full model's parameters"
    return {
        "loss": rel(ranks[1]["losses"], single["losses"]),
        "norm": rel(ranks[0]["norms"], single["norms"]),
        "weight": max((weights[n] - t).abs().max().item() for n, t in single["state"].items()),
        "where": max(single["state"], key=lambda n: (weights[n] - single["state"][n]).abs().max().item()),
        "first": single["losses"][0],
        "last": single["losses"][-1],
        "clip": min(single["norms"]) > CLIP,
    }


def median_time(result: dict) -> float:
    """Median step time after the first step, s."""
    return statistics.median(result["times"][1:])


def write_page(parity: dict, cost: dict, cost_model: str, seconds: float, loads: list, doc: str):
    """Write docs/benchmark-pipeline.md from the measured figures."""
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    head = (
        f"*Written by `benchmarks/benchmark_pipeline.py` (`make benchmark-pipeline`) on "
        f"{datetime.date.today()}; {cpu}, {os.cpu_count()} cores, no GPU; python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}. "
        "Do not edit by hand: run the command again.*"
    )
    lines = [
        "# Pipeline parallelism on CPU: torch.distributed.pipelining, 2 stages over gloo",
        "",
        head,
        "",
        f"Each run: {STEPS} AdamW steps (lr {ADAMW['lr']}, betas {ADAMW['betas']}, weight decay "
        f"{ADAMW['weight_decay']}), global batch {BATCH} x {SEQ} random tokens (seeded) in {MICRO} micro-batches "
        f"for the pipeline and in one forward for the single process, clipping to global norm {CLIP}, fp32. "
        f"The whole script took {seconds:.0f} s; the host's 1-minute load average was "
        f"{loads[0]:.1f} at its start and {loads[1]:.1f} at its end (its own 2 processes make about 2).",
        "",
        "## Parity with one process",
        "",
        "| model | schedule | loss, step 1 -> last | max relative loss gap | max relative grad-norm gap "
        "| max abs final weight gap (in) | clipping active every step |",
        "|---|---|---|---|---|---|---|",
    ]
    for (config, name), g in parity.items():
        lines.append(
            f"| {config} | {name} | {g['first']:.4f} -> {g['last']:.4f} | {g['loss']:.2e} | "
            f"{g['norm']:.2e} | {g['weight']:.2e} (`{g['where']}`) | {'yes' if g['clip'] else 'no'} |"
        )
    lines += [
        "",
        f"## Cost at {cost_model} ({cost['single'][0]['params']:,} parameters)",
        "",
        f"Step time is the median of steps 2 to {STEPS} of each process (forward, backward, clipping, AdamW); "
        f"the single process uses {os.cpu_count()} threads, each pipeline stage {os.cpu_count() // 2}. "
        "Peak resident set is VmHWM from /proc/self/status at the end of the run (it includes the "
        "interpreter, torch and transformers, and the full model each process builds before the split).",
        "",
        "| run | process | parameters held | step time, s | peak resident set, MB |",
        "|---|---|---|---|---|",
    ]
    for name, results in cost.items():
        for rank, r in enumerate(results):
            who = "single process" if name == "single" else f"stage {rank}"
            lines.append(f"| {name} | {who} | {r['params']:,} | {median_time(r):.2f} | {r['hwm_mb']:.0f} |")
    lines += [
        "",
        "## What was manual",
        "",
        "torch.distributed.pipelining supplied the stages' send/receive and the GPipe and 1F1B schedules. "
        "The script did by hand: the split (each process builds the whole model, then stage 0 replaces the "
        "final norm and lm_head by Identity and stage 1 sets the embeddings to None, each keeping its half of "
        "the decoder layers and the rotary embedding, with a wrapper that feeds token ids or hidden states to "
        "the model's forward); the loss scaling (each micro-batch's loss is its token sum divided by the global "
        "batch's token count, with the schedule's own gradient scaling off, `scale_grads=False`); and the "
        "clipping across stages (each stage's squared gradient norm, all_reduce, one clipping factor applied on "
        "both). The gaps above are what these runs measured, nothing more: no other model, sequence length, "
        "number of stages or hardware was tried.",
        "",
    ]
    with open(doc, "w") as page:
        page.write("\n".join(lines))


def main(argv=None):
    """Run the single-process and pipeline trainings for each model config; write the page (the cost at the last)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--docs", default=DOC, help="the page to write")
    args = parser.parse_args(argv)
    began, load = time.perf_counter(), os.getloadavg()[0]
    parity, cost, cost_model = {}, {}, args.models[-1]
    for config in args.models:
        path = CONFIGS[config]
        with tempfile.TemporaryDirectory() as tmp:
            single = launch("single", path, tmp)
            if config == cost_model:
                cost["single"] = single
            for name in SCHEDULES:
                ranks = launch(name, path, tmp)
                parity[(config, name)] = compare(single[0], ranks)
                ranks[0].pop("state"), ranks[1].pop("state")
                if config == cost_model:
                    cost[name] = ranks
                print(config, name, parity[(config, name)], flush=True)
            single[0].pop("state")
    for name, results in cost.items():
        print(name, [(round(median_time(r), 3), round(r["hwm_mb"])) for r in results], flush=True)
    write_page(parity, cost, cost_model, time.perf_counter() - began, [load, os.getloadavg()[0]], args.docs)
    print("figures:", args.docs)


if __name__ == "__main__":
    sys.exit(main())
