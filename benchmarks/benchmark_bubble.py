"""The pipeline's bubble, measured: step time at 1, 2, 4 and 8 micro-batches per schedule, against (p-1)/(m+p-1).

Launches recipes/causal_lm.py under accelerate_configs/pp.yaml (2 stages, fp32) once per schedule and number of
micro-batches m (its --gradient_accumulation_steps, each micro-batch the same size), and reads each run's step
times from its metrics.jsonl (the median after the first steps). Beside them, the same steps on one process with
one thread (single.yaml, OMP_NUM_THREADS=1: one stage's core doing every stage's work), t1(m). A pipeline of p
stages that wasted nothing would take t1(m) / p a step; the measured idle share of a step is 1 - t1(m) / (p t(m)):
the bubble, the stages' messages and any imbalance between the stages, beside the schedule's bubble
(p - 1) / (m + p - 1) (Interleaved1F1B, v = 2 stages per rank: (p - 1) / (v m + p - 1)).

    python benchmarks/benchmark_bubble.py                          # writes docs/benchmark-bubble.md (about 6 minutes)
    python benchmarks/benchmark_bubble.py --micro_batches 1 4 --schedules 1F1B --docs /tmp/bubble.md
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

from common.launch.peers import free_port


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "benchmark-bubble.md")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
# A Llama deep enough for 4 stages (Interleaved1F1B on 2 ranks) and wide enough that a micro-batch's work is
# most of a step; vocabulary from the demo tokenizer.
MODEL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8, "num_attention_heads": 4}


def predicted(schedule: str, micro_batches: int, stages: int = 2) -> float:
    """The schedule's bubble. Interleaved1F1B's (p - 1) / (2m + p - 1) holds from m = p micro-batches; one
    micro-batch passes the ranks' stages in turn, each rank idle while the others work: (p - 1) / p."""
    interleaved = schedule == "Interleaved1F1B" and micro_batches > 1
    slots = (2 if interleaved else 1) * micro_batches
    return (stages - 1) / (slots + stages - 1)


def step_times(metrics: str, skip: int) -> list[float]:
    rows = [json.loads(line) for line in open(metrics)]
    elapsed = [row["elapsed_s"] for row in rows if "loss" in row]
    return [b - a for a, b in zip(elapsed, elapsed[1:])][skip:]


def run(schedule: str | None, micro_batches: int, args, tmp: str, data: str, model: str) -> float:
    """The median step time of one launch (s): pp.yaml under `schedule`, or one process with one thread (None)."""
    if schedule is None:
        path = os.path.join(REPO, "accelerate_configs/single.yaml")
    else:
        config = yaml.safe_load(open(os.path.join(REPO, "accelerate_configs/pp.yaml")))
        config["parallelism_config"]["parallelism_config_pp_schedule"] = schedule
        path = os.path.join(tmp, f"{schedule}.yaml")
        with open(path, "w") as handle:
            yaml.safe_dump(config, handle)
    out = os.path.join(tmp, f"{schedule or 'single'}_{micro_batches}")
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"),
        "launch",
        "--config_file",
        path,
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(free_port()),
        os.path.join(REPO, "recipes/causal_lm.py"),
        *("--config", os.path.join(REPO, "recipes/configs/causal_lm_demo.yaml")),
        *("--tokenizer_name_or_path", os.path.join(data, "tokenizer")),
        *("--train_file", os.path.join(data, "train.jsonl")),
        *("--validation_file", os.path.join(data, "validation.jsonl")),
        *("--model_config", model, "--output_dir", out, "--overwrite_output_dir"),
        *("--block_size", str(args.block_size), "--per_device_train_batch_size", str(args.batch_size)),
        *("--gradient_accumulation_steps", str(micro_batches), "--max_steps", str(args.steps)),
        *("--logging_steps", "1", "--eval_steps", "0", "--save_steps", "0"),
        *("--report_to", "none"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if schedule is None:
        env["OMP_NUM_THREADS"] = "1"  # one stage's share of the host: pp.yaml's 2 processes get a core each
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(
            f"error: {schedule or 'one process'} at {micro_batches} micro-batches failed:\n{result.stderr[-3000:]}"
        )
    return statistics.median(step_times(os.path.join(out, "metrics.jsonl"), skip=2))


def idle_share(step: float, single: float, stages: int = 2) -> float:
    """The share of a pipelined step not spent on its stage's part of one process's work: 1 - t1 / (p t)."""
    return 1 - single / (stages * step)


def write_page(times: dict, single: dict, args, seconds: float, loads: list, doc: str) -> None:
    import torch
    import transformers

    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    lines = [
        "# The pipeline's bubble: step time against micro-batches, per schedule",
        "",
        f"*Written by `benchmarks/benchmark_bubble.py` on {datetime.date.today()}; {cpu}, {os.cpu_count()} cores, no "
        "GPU; "
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}. "
        "Do not edit by hand: run the command again.*",
        "",
        f"`accelerate_configs/pp.yaml` (2 stages over gloo, fp32), `recipes/causal_lm.py` on a Llama of "
        f"{MODEL['num_hidden_layers']} layers, hidden size {MODEL['hidden_size']}, each micro-batch "
        f"{args.batch_size} x {args.block_size} tokens; {args.steps} steps per run, the median step time after the "
        f"first two. The whole script took {seconds:.0f} s; the host's 1-minute load average was {loads[0]:.1f} at "
        f"its start and {loads[1]:.1f} at its end (its own 2 processes make about 2).",
        "",
        "One process: the same steps on single.yaml with one thread, t1(m), one core doing every stage's work. "
        "Idle share (measured): 1 - t1(m) / (p t(m)), p = 2, the part of each stage's step not spent on its half of "
        "that work (the bubble, the stages' messages, imbalance between the stages). Bubble: the schedule's "
        "(p - 1) / (m + p - 1) (Interleaved1F1B: (p - 1) / (2m + p - 1), but (p - 1) / p at m = 1, where the one "
        "micro-batch passes the ranks' stages in turn).",
        "",
        "| schedule | micro-batches m | step time, s | per micro-batch, s | one process, s | idle share (measured) "
        "| bubble (schedule) |",
        "|---|---|---|---|---|---|---|",
    ]
    for schedule, points in times.items():
        for m, t in points.items():
            lines.append(
                f"| {schedule} | {m} | {t:.3f} | {t / m:.3f} | {single[m]:.3f} | {idle_share(t, single[m]):.2f} "
                f"| {predicted(schedule, m):.2f} |"
            )
    lines += [
        "",
        "1F1B with fewer micro-batches than stages (m = 1) has every forward in its warm-up, GPipe's order, and "
        "runs as GPipe (torch's 1F1B refuses it). On this host each stage has one core and the stages' messages go "
        "through gloo's loopback, so a slot holds a stage's compute and its send; on GPUs the balance differs. The "
        "figures are these runs only.",
        "",
    ]
    with open(doc, "w") as page:
        page.write("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--micro_batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--docs", default=DOC, help="the page to write")
    args = parser.parse_args(argv)
    from common.data.synthetic import write_markov_corpus

    began, load = time.perf_counter(), os.getloadavg()[0]
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        data, model = os.path.join(tmp, "data"), os.path.join(tmp, "model.json")
        write_markov_corpus(data)
        config = json.load(open(os.path.join(REPO, "recipes/configs/tiny_llama.json")))
        with open(model, "w") as handle:
            json.dump({**config, **MODEL}, handle)
        single = {}
        for m in args.micro_batches:  # each m's one-process run beside its schedules', so they share the host's load
            single[m] = run(None, m, args, tmp, data, model)
            print(f"one process m={m}: {single[m]:.3f} s per step", flush=True)
            for schedule in args.schedules:
                times.setdefault(schedule, {})[m] = run(schedule, m, args, tmp, data, model)
                share = idle_share(times[schedule][m], single[m])
                print(f"{schedule} m={m}: {times[schedule][m]:.3f} s per step, idle share {share:.2f}", flush=True)
    write_page(times, single, args, time.perf_counter() - began, [load, os.getloadavg()[0]], args.docs)
    print("figures:", args.docs)


if __name__ == "__main__":
    sys.exit(main())
