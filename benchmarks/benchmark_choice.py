"""make choose-config against measurement on this host: at each memory cap per process, its choice
beside the fastest config measured to fit.

One invocation: `make doctor`'s bus bandwidths on 2 processes (all_reduce, all_gather, reduce_scatter:
the link choose-config is told about, --doctor_report), `make benchmark`'s runs of every config choose-config ranks for 2
devices (101M parameters, bf16, batch 1 x 64 tokens, accumulation 2; tp.yaml (and pp.yaml when asked), whose 2
ranks train one batch, at accumulation 4: the same global batch; or their --json from an earlier run with
--benchmark_json), this host's compute and memory bandwidth measured once, then
choose-config for the same job at a cap just above each measured peak. Written to --docs.

    python benchmarks/benchmark_choice.py --docs docs/choose-config.md
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))  # the tool it measures: make choose-config's
import choose_config  # noqa: E402

from common.planning import step_time  # noqa: E402
from common.planning.memory import read_model  # noqa: E402


JOB = {"num_devices": 2, "micro_batch": 1, "accumulation": 2, "seq_len": 64}
# tp.yaml's group (and pp.yaml's pipeline) span both devices and train one batch: run at accumulation x 2 (the same
# global batch, as choose-config's command for them says). pp.yaml is measured when asked (--configs), not by
# default: its run's account counts no activations, so its memory row is not the others' like for like
GROUPED = ["tp.yaml", "pp.yaml"]
# Published setups: choose-config's advice beside what their authors used (as read in their files).
SETUPS = [
    (
        "Llama-3-8B, 8 x H100 80 GB, 4096-token sequences, global batch 64",
        [
            "--model",
            "recipes/configs/llama3_8b.json",
            "--device",
            "h100",
            "--num_devices",
            "8",
            "--seq_len",
            "4096",
            "--global_batch",
            "64",
        ],
        "axolotl's `examples/llama-3/fft-8b.yaml`: 8192-token packed sequences, micro-batch 1, accumulation 8, "
        "gradient checkpointing, flash attention, paged 8-bit AdamW, its `deepspeed:` and `fsdp:` left for the "
        "user; torchtune's `llama3/8B_full`: FSDP full shard (`full_finetune_distributed`), launched on 4 devices.",
    ),
    (
        "Llama-3-70B, 8 x H100 80 GB in one node (2 TB of CPU RAM), 4096-token sequences, global batch 64",
        [
            "--model",
            "recipes/configs/llama3_70b.json",
            "--device",
            "h100",
            "--num_devices",
            "8",
            "--seq_len",
            "4096",
            "--global_batch",
            "64",
        ],
        "no full fine-tuning of 70B in one node that we found: its 16 bytes per parameter (1.1 TB) have to live "
        "outside the GPUs, as above. The one-node 70B recipe we found is QLoRA instead (The Kaitchup's \"Multi-GPU "
        'Fine-tuning for Llama 3.1 70B with FSDP and QLoRA", on 2 x 24 GB GPUs and a lot of CPU RAM).',
    ),
    (
        'Llama-2-70B as Hugging Face\'s blog "Fine-tuning Llama 2 70B using PyTorch FSDP" ran it: 8 nodes x 8 A100 '
        "80 GB, 1 TB of CPU RAM per node, 2048-token sequences, global batch 64",
        [
            "--model",
            "recipes/configs/llama3_70b.json",
            "--vocab_size",
            "32000",
            "--device",
            "a100",
            "--num_devices",
            "64",
            "--num_nodes",
            "8",
            "--host_memory_gb",
            "1000",
            "--seq_len",
            "2048",
            "--global_batch",
            "64",
        ],
        "FSDP full shard (`FULL_SHARD`, `SHARDED_STATE_DICT`, CPU-RAM-efficient loading), bf16, packed 2048-token "
        "sequences, micro-batch 1, accumulation 1, gradient checkpointing, flash attention 2 (the model: "
        "llama3_70b.json with Llama 2's 32000-token vocabulary, otherwise the same shape). The blog gives one node "
        "as the minimum; by these estimates one node of 8 x 80 GB fits 70B only with offload (the setup above).",
    ),
]


def measure(args, tmp: str) -> tuple[str, list[dict]]:
    """make doctor's report and make benchmark's results (the benchmark's own JSON when given)."""
    report = os.path.join(tmp, "doctor.json")
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "scripts", "doctor.py"),
            "--config_file",
            os.path.join(REPO, "accelerate_configs", "ddp.yaml"),
            "--max_size",
            "256M",
            "--report",
            report,
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    if args.benchmark_json:
        with open(args.benchmark_json) as handle:
            return report, json.load(handle)
    measured = []
    # a TP group or a pipeline (2 ranks) trains one batch: twice the accumulation makes the same global batch
    grouped = [c for c in args.configs if c in GROUPED]
    for configs, accumulation in (
        ([c for c in args.configs if c not in GROUPED], JOB["accumulation"]),
        (grouped, JOB["accumulation"] * JOB["num_devices"]),
    ):
        if not configs:
            continue
        results = os.path.join(tmp, "benchmark.json")
        subprocess.run(
            [
                sys.executable,
                os.path.join(REPO, "benchmarks", "benchmark_strategies.py"),
                "--model_config",
                args.model_config,
                "--steps",
                str(args.steps),
                "--batch_size",
                str(JOB["micro_batch"]),
                "--block_size",
                str(JOB["seq_len"]),
                "--accumulation",
                str(accumulation),
                "--configs",
                *configs,
                "--json",
                results,
                "--chart",
                "",
            ],
            cwd=REPO,
            check=True,
            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
        )
        with open(results) as handle:
            measured += json.load(handle)
    return report, measured


def choose(args, report: str, host: dict, cap_mb: float, vocab_size: int, tmp: str) -> dict:
    """choose-config's table for the benchmark's job with a memory cap per process."""
    batch = JOB["num_devices"] * JOB["micro_batch"] * JOB["accumulation"]
    argv = [
        "--model",
        args.model_config,
        "--vocab_size",
        str(vocab_size),
        "--device",
        "cpu",
        "--num_devices",
        str(JOB["num_devices"]),
        "--global_batch",
        str(batch),
        "--seq_len",
        str(JOB["seq_len"]),
        "--micro_batch",
        str(JOB["micro_batch"]),
        "--activation_checkpointing",
        "off",
        "--pp_schedules",
        "1F1B",  # pp.yaml's, as measured
        "--configs",
        *args.configs,
        "--device_memory_gb",
        str(cap_mb * 2**20 / 1e9),
        "--doctor_report",
        report,
        "--peak_tflops",
        str(host["tflops"]),
        "--memory_gbps",
        str(host["memory_gbps"]),
        "--output",
        os.path.join(tmp, "chosen.yaml"),
        "--overwrite",
        "--json",
        os.path.join(tmp, "table.json"),
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            return choose_config.main(argv)
        except SystemExit:  # nothing fits: the table is still wanted
            return json.load(open(os.path.join(tmp, "table.json")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_config", default=os.path.join(REPO, "recipes/configs/llama_100m.json"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--configs", nargs="+", default=step_time.SINGLE_NODE + ["tp.yaml"], help="measure and rank these"
    )
    parser.add_argument("--benchmark_json", help="make benchmark's --json from a run of this job (skips the runs)")
    parser.add_argument("--docs", help="write the tables to this markdown page")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report, results = measure(args, tmp)
        vocab_size = results[0]["vocab_size"]  # the recipe sizes the model to the tokenizer
        model = read_model(args.model_config, vocab_size)
        host = step_time.measure_host(__import__("torch").bfloat16, 1, model, JOB["seq_len"])
        measured = {
            r["config"]: {"step_s": 1 / r["steps_per_s"], "peak_mb": max(r["peak_mb_per_rank"])} for r in results
        }
        caps = {}  # one cap per set of configs measured to fit under it
        for cap in sorted(m["peak_mb"] * 1.02 for m in measured.values()):
            caps.setdefault(frozenset(c for c, m in measured.items() if m["peak_mb"] <= cap), cap)
        caps = sorted(caps.values())
        rows = []
        for cap in caps:
            table = {r["config"]: r for r in choose(args, report, host, cap, vocab_size, tmp)["rows"]}
            fits = [c for c, m in measured.items() if m["peak_mb"] <= cap]
            fastest = min(fits, key=lambda c: measured[c]["step_s"])
            chosen = next((c for c, r in table.items() if r["verdict"] == "chosen"), None)
            rows.append(
                {
                    "cap_mb": cap,
                    "fits": fits,
                    "fastest": fastest,
                    "chosen": chosen,
                    "table": table,
                    "parameters": results[0]["parameters"],
                }
            )
            if chosen:
                rows[-1].update(
                    estimate_mb=table[chosen]["device_gb"] * 1e9 / 2**20,
                    fits_measured=chosen in fits,
                    measured_mb=measured[chosen]["peak_mb"],
                    chosen_vs_fastest=measured[fastest]["step_s"] / measured[chosen]["step_s"],
                )
        for row in rows:
            print(
                f"cap {row['cap_mb']:.0f} MB: fastest measured {row['fastest']}, chosen {row['chosen']}"
                + (
                    f" (speed {row['chosen_vs_fastest']:.2f}x the fastest), estimate {row['estimate_mb']:.0f} MB vs "
                    f"measured {row['measured_mb']:.0f} MB"
                    if row["chosen"]
                    else " (every estimate above the cap)"
                )
            )
        advice = [(title, published(argv, tmp), used) for title, argv, used in SETUPS]
        if args.docs:
            write_docs(args, rows, measured, host, report, advice)


def published(argv: list, tmp: str) -> list:
    """choose-config's table for a published setup (presets and the model's shape: nothing is measured)."""
    argv = [os.path.join(REPO, a) if a.startswith("recipes/") else a for a in argv]
    table = os.path.join(tmp, "published.json")
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            choose_config.main(
                [*argv, "--output", os.path.join(tmp, "published.yaml"), "--overwrite", "--json", table]
            )
        except SystemExit:  # nothing fits: the table says why
            pass
    return json.load(open(table))["rows"]


def write_docs(args, rows: list, measured: dict, host: dict, report: str, advice: list) -> None:
    from figures import markdown_table, write_page

    with open(report) as handle:
        measured_links = json.load(handle)
    links = ", ".join(f"{op} {measured_links[op][-1]['busbw_gbps']:.2f} GB/s" for op in step_time.COLLECTIVES)
    last = rows[-1]["table"]
    per_config = markdown_table(
        ["config", "measured s/step", "estimated s/step", "measured peak MB", "estimated peak MB"],
        [
            [
                f"`{c}`",
                f"{m['step_s']:.2f}",
                f"{last[c]['step_s']:.2f}",
                f"{m['peak_mb']:.0f}",
                f"{last[c]['device_gb'] * 1e9 / 2**20:.0f}",
            ]
            for c, m in sorted(measured.items(), key=lambda i: i[1]["step_s"])
        ],
    )
    caps = markdown_table(
        [
            "cap MB per process",
            "configs measured to fit",
            "fastest measured",
            "chosen",
            "chosen measured to fit",
            "chosen's speed vs fastest",
            "chosen's peak MB: estimated / measured",
        ],
        [
            [
                f"{r['cap_mb']:.0f}",
                len(r["fits"]),
                f"`{r['fastest']}`",
                f"`{r['chosen']}`",
                "yes" if r["fits_measured"] else "**no**",
                f"{r['chosen_vs_fastest']:.2f}",
                f"{r['estimate_mb']:.0f} / {r['measured_mb']:.0f} ({(r['estimate_mb'] / r['measured_mb'] - 1) * 100:+.0f}%)",
            ]
            if r["chosen"]
            else [
                f"{r['cap_mb']:.0f}",
                len(r["fits"]),
                f"`{r['fastest']}`",
                "none: every estimate is above the cap",
                "",
                "",
                "",
            ]
            for r in rows
        ],
    )
    hits = sum(r["chosen"] == r["fastest"] for r in rows)
    chosen = [r for r in rows if r["chosen"]]
    gaps = [r["estimate_mb"] / r["measured_mb"] - 1 for r in chosen]
    misses = [r for r in chosen if r["chosen"] != r["fastest"]]
    summary = (
        f"The chosen config measured to fit its cap in {sum(r['fits_measured'] for r in chosen)} of "
        f"{len(rows)} caps; its estimated peak was {min(gaps) * 100:+.0f}% to {max(gaps) * 100:+.0f}% off the "
        "measured one (estimates run below a CPU run's peak: the process's own memory beyond its imports, "
        "kernel caches, threads and the data, which the default --headroom of 10% absorbs)."
        + (
            " Where the choice was not the fastest measured config: "
            + "; ".join(
                f"at {r['cap_mb']:.0f} MB `{r['chosen']}`, at {r['chosen_vs_fastest']:.2f}x `{r['fastest']}`'s "
                "speed, "
                + (
                    "because that one's estimate plus the headroom was over the cap"
                    if not r["table"][r["fastest"]]["fits"]
                    else "estimated the faster"
                )
                for r in misses
            )
            + "."
            if misses
            else ""
        )
    )
    sections = []
    for title, table, used in advice:
        sections.append(
            f"### {title}\n\n"
            + markdown_table(
                [
                    "config",
                    "micro-batch x accumulation",
                    "activation checkpointing",
                    "GB per device",
                    "CPU GB per node",
                    "step s (estimated)",
                    "verdict",
                ],
                [
                    [
                        f"`{step_time.layout_name(r)}`",
                        f"{r['micro_batch']} x {r['accumulation']}",
                        "on" if r["activation_checkpointing"] else "off",
                        f"{r['device_gb']:.1f}",
                        f"{r['host_gb_per_node']:.0f}",
                        f"{r['step_s']:.2f}",
                        r["verdict"],
                    ]
                    for r in table
                ],
            )
            + f"\n\nWhat its authors used: {used}"
        )
    write_page(
        args.docs,
        "Choosing a config: make choose-config against measurement",
        (
            f"The job: {os.path.basename(args.model_config)} ({rows[0]['parameters']:,} parameters), bf16, 2 processes, batch "
            f"{JOB['micro_batch']} x {JOB['seq_len']} tokens, accumulation {JOB['accumulation']} (tp.yaml and pp.yaml, "
            f"whose 2 ranks train one batch: {JOB['accumulation'] * JOB['num_devices']}, the same global batch). "
            "Measured by "
            f"`make benchmark`'s runs ({args.steps} steps each, all in this invocation; peak = the highest rank's "
            "peak resident set over the run), and by `make doctor` (busbw at 256 MB: "
            f"{links}). This host measured by choose-config: "
            f"{host['tflops'] * 1e3:.0f} GFLOP/s bf16 matmul and {host['memory_gbps']:.1f} GB/s memory bandwidth per "
            "process.\n\nEach config, measured and as choose-config estimates it:\n\n"
            + per_config
            + "\n\nAt a memory cap per process just above each measured peak (2%), choose-config's choice beside the "
            f"fastest config measured to fit under that cap ({hits} of {len(rows)} the same):\n\n"
            + caps
            + "\n\n"
            + summary
            + "\n\n## Published setups\n\nchoose-config's advice from its device presets (data-sheet peaks, "
            "typical links; nothing measured there), beside what the setups' authors used. A config is shown at the "
            "layout it was ranked at: `sp`, `cp` or `tp` and the size of a group that trains one batch, `pp` and the "
            "stages of a pipeline with its schedule (its step stretched by the bubble, (p - 1) / (v m + p - 1) of it "
            "idle, v stages a rank, m micro-batches: the accumulation).\n\n" + "\n\n".join(sections)
        ),
    )


if __name__ == "__main__":
    main()
