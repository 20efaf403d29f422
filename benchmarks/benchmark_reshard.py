"""What a DeepSpeed ZeRO-3 checkpoint's conversion for another world size, and the final export's
gather, cost: time and host memory, at a model size where model state dominates.

Trains --steps steps of a causal LM under zero3.yaml on 2 processes (bf16 as shipped) with a
checkpoint at the last step, reads the final export's gather cost from run.json
("final_export": the main process's resident set before and at its highest during the export),
then converts the checkpoint for 1 process (common/outputs/reshard.py, DeepSpeed's ds_to_universal) in
a process of its own and measures its wall time and the peak resident set of it and its children.

    make benchmark-reshard                      # 101M parameters; writes docs/benchmark-reshard.md
    make benchmark-reshard ARGS="--model_config recipes/configs/tiny_llama.json --docs ''"
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common.launch.peers import free_port


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 2**20
# The conversion in a process of its own; prints the larger peak resident set (MB) of itself and of
# the ds_to_universal process it waits for (ru_maxrss is in KB on Linux).
CONVERT = (
    "import resource, sys\n"
    "from common.outputs.reshard import convert_to_universal\n"
    "convert_to_universal(sys.argv[1], sys.argv[2])\n"
    "print(max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024)"
)


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names) / MB


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_config", default=os.path.join(REPO, "recipes/configs/llama_100m.json"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--docs", default="", help="write the figures to this markdown page")
    args = parser.parse_args(argv)
    from common.data.synthetic import write_markov_corpus

    with tempfile.TemporaryDirectory() as tmp:
        data, out = os.path.join(tmp, "data"), os.path.join(tmp, "run")
        write_markov_corpus(data)
        command = [
            os.path.join(os.path.dirname(sys.executable), "accelerate"),
            "launch",
            "--config_file",
            os.path.join(REPO, "accelerate_configs/zero3.yaml"),
            "--num_processes",
            "2",
            "--main_process_port",
            str(free_port()),
            os.path.join(REPO, "recipes/causal_lm.py"),
            "--config",
            os.path.join(REPO, "recipes/configs/causal_lm_demo.yaml"),
            "--model_config",
            args.model_config,
            "--tokenizer_name_or_path",
            os.path.join(data, "tokenizer"),
            "--train_file",
            os.path.join(data, "train.jsonl"),
            "--validation_file",
            os.path.join(data, "validation.jsonl"),
            "--output_dir",
            out,
            "--max_steps",
            str(args.steps),
            "--save_steps",
            str(args.steps),
            "--logging_steps",
            "1",
            "--eval_steps",
            "0",
            "--per_device_train_batch_size",
            "1",
            "--per_device_eval_batch_size",
            "1",
            "--block_size",
            "16",
            "--max_eval_samples",
            "4",
            "--report_to",
            "none",
            "--overwrite_output_dir",
        ]
        result = subprocess.run(
            command,
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )
        if result.returncode != 0:
            raise SystemExit(f"error: the zero3 run failed:\n{result.stderr[-3000:]}")
        with open(os.path.join(out, "run.json")) as handle:
            run = json.load(handle)
        parameters, export = run["total_parameters"], run["final_export"]
        checkpoint = os.path.join(out, "checkpoints", f"step_{args.steps}")
        target = os.path.join(checkpoint, "universal")
        started = time.perf_counter()
        converted = subprocess.run(
            [sys.executable, "-c", CONVERT, checkpoint, target], check=True, cwd=REPO, capture_output=True, text=True
        )
        seconds = time.perf_counter() - started
        peak_mb = float(converted.stdout.strip().splitlines()[-1])
        checkpoint_mb, universal_mb = folder_mb(os.path.join(checkpoint, "pytorch_model")), folder_mb(target)
    gathered_mb = export["rss_peak_mb"] - export["rss_before_mb"]
    rows = [
        ("parameters", f"{parameters:,}"),
        ("ZeRO-3 checkpoint (2 processes), MB on disk", f"{checkpoint_mb:.0f}"),
        ("conversion for 1 process: wall time, s", f"{seconds:.1f}"),
        ("conversion: universal folder, MB on disk", f"{universal_mb:.0f}"),
        ("conversion: peak resident set (its process and DeepSpeed's, the larger), MB", f"{peak_mb:.0f}"),
        ("final export: gather time on 2 processes, s", f"{export['gather_s']:.1f}"),
        (
            "final export: main process's resident set before / at its highest during the export, MB",
            f"{export['rss_before_mb']:.0f} / {export['rss_peak_mb']:.0f}",
        ),
        ("final export: host memory the export adds, bytes per parameter", f"{gathered_mb * MB / parameters:.2f}"),
    ]
    for name, value in rows:
        print(f"{name}: {value}")
    if args.docs:
        from figures import markdown_table, write_page

        write_page(
            args.docs,
            "Converting a ZeRO-3 checkpoint for another world size, and the final export",
            (
                f"A causal LM ({os.path.relpath(args.model_config, REPO)}) trained {args.steps} steps under "
                "`zero3.yaml` on 2 processes (bf16 as shipped), its checkpoint converted for 1 process by "
                "`common/outputs/reshard.py` (DeepSpeed's `ds_to_universal`, one extract and one merge worker) before "
                "any "
                "process group starts.\n\n" + markdown_table(["measure", "value"], [list(row) for row in rows])
            ),
        )


if __name__ == "__main__":
    main()
