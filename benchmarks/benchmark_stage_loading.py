"""Host memory at a pipeline's start: each rank reading only its stages' tensors, against a whole-model load.

Saves a model built from --model_config (118M parameters by default: recipes/configs/llama_100m.json with an
8192-token vocabulary) as a bf16 folder of safetensors files, as Hub models ship, then loads it in fp32 (the recipes'
master weights), each load in a fresh process with glibc returning freed blocks to the OS
(MALLOC_MMAP_THRESHOLD_=131072, so the resident set is live memory): once whole, as transformers' from_pretrained
does and as every rank did before, and once per rank of
a pipeline of each --stages size, as pp.yaml's ranks do (common.parallel.pipeline.load_stages: the model on the meta
device, its stages kept, their tensors read from the files). Each row: the rise of the resident set's high-water
mark over the process after its imports (the model's code included: a model built once on the meta device),
against the weights it holds in fp32 and `make estimate-memory`'s loading_peak for that rank.

    python benchmarks/benchmark_stage_loading.py --docs docs/benchmark-stage-loading.md      # about a minute
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIVE_RSS = {"MALLOC_MMAP_THRESHOLD_": "131072"}
MB = 2**20

# one load in a fresh process: argv folder, pipeline size (0: whole), rank; prints its figures as JSON
LOAD = """
import json, os, sys
import torch
from transformers import AutoModelForCausalLM
from common.launch import mesh
from common.launch.mesh import PipelineSettings
from common.parallel import pipeline

def status(key):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(key + ":"))

folder, size, rank = sys.argv[1], int(sys.argv[2]), sys.argv[3]
from accelerate import init_empty_weights  # the model's code imported first: the rise is the load's own
from safetensors import safe_open
from transformers import AutoConfig

with init_empty_weights():
    del AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).config
before = status("VmRSS")
if size:
    mesh.launched_pipeline = lambda: PipelineSettings(size, "1F1B")
    os.environ["RANK"] = rank
    model = pipeline.load_stages(AutoModelForCausalLM, folder, torch.float32, {})
else:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
held = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
print(json.dumps({"rise": status("VmHWM") - before, "held": held, "stages_only": getattr(model, "stages_only", False)}))
"""


def load(folder: str, size: int, rank: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", LOAD, folder, str(size), str(rank)],
        cwd=REPO,
        env={**os.environ, **LIVE_RSS, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"error: loading {folder} ({size} stages, rank {rank}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def estimated_loading(folder: str, size: int) -> list[int]:
    """make estimate-memory's loading_peak for each rank of a `size`-stage 1F1B pipeline (the whole load for 0)."""
    from common.planning.memory import estimate_stages, read_model

    model = read_model(folder)
    if not size:
        return [4 * model["parameters"]]
    strategy = {"strategy": "pp", "pp_size": size, "pp_schedule": "1F1B", "stages_per_rank": 1}
    strategy |= {"mixed_precision": "no", "num_processes": size}
    return [rank["loading_peak"] for rank in estimate_stages(model, strategy, batch_size=1, seq_len=64)]


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_config", default=os.path.join(REPO, "recipes/configs/llama_100m.json"))
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline sizes (1F1B)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--docs", help="write the table to this page (make benchmark-stage-loading does)")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, REPO)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    began = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "bf16")
        config = AutoConfig.from_pretrained(args.model_config, vocab_size=args.vocab_size)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
        del config
        for size in [0, *args.stages]:
            estimates = estimated_loading(folder, size)
            for rank in range(max(1, size)):
                figures = load(folder, size, rank)
                if size and not figures["stages_only"]:
                    raise SystemExit(f"error: {size} stages, rank {rank}: the whole model was loaded")
                rows.append({"stages": size, "rank": rank, **figures, "estimated": estimates[rank]})
                print(
                    f"{'whole model' if not size else f'{size} stages, rank {rank}'}: resident set rose "
                    f"{figures['rise'] / MB:.0f} MB holding {figures['held'] / MB:.0f} MB of weights (estimated "
                    f"{estimates[rank] / MB:.0f} MB)",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    if args.docs:
        write_docs(args, rows, time.perf_counter() - began)
    return rows


def write_docs(args, rows: list, seconds: float) -> None:
    from figures import markdown_table, write_page

    whole = rows[0]
    table = markdown_table(
        [
            "load",
            "rank",
            "weights held, MB (fp32)",
            "resident set rise, MB",
            "estimated (loading_peak), MB",
            "rise / whole load's",
        ],
        [
            [
                "whole model (from_pretrained)" if not row["stages"] else f"{row['stages']} stages, its own",
                "-" if not row["stages"] else row["rank"],
                f"{row['held'] / MB:.0f}",
                f"{row['rise'] / MB:.0f}",
                f"{row['estimated'] / MB:.0f}",
                f"{row['rise'] / whole['rise']:.2f}",
            ]
            for row in rows
        ],
    )
    write_page(
        args.docs,
        "Pipeline parallelism: host memory at the start, each rank reading its stages alone",
        f"`{os.path.relpath(args.model_config, REPO)}` with a vocabulary of {args.vocab_size} "
        f"({whole['held'] // 4:,} parameters), saved as a bf16 safetensors folder and loaded in fp32, each load in a "
        "fresh process with MALLOC_MMAP_THRESHOLD_=131072 (the resident set is live memory). The rise is the "
        "resident set's high-water mark over the process after its imports. The whole model is transformers' "
        "`from_pretrained`, which every pipeline rank did before; each pipeline rank is "
        "`common.parallel.pipeline.load_stages` (1F1B: one stage per rank). Estimated: `make estimate-memory`'s "
        "loading_peak for that rank: the fp32 weights it holds; the rise also holds the pages of the bf16 files read "
        f"(mapped by safetensors), about half as much again. The script took {seconds:.0f} s.\n\n" + table,
    )


if __name__ == "__main__":
    main()
