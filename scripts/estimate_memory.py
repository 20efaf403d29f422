"""Memory per rank for a model under an accelerate config, by category, before launching (the model and its
formulas: common/planning/memory.py, which --help prints).

    python scripts/estimate_memory.py --model recipes/configs/llama_100m.json \\
        --config accelerate_configs/zero3.yaml --num_processes 2 --batch_size 1 --seq_len 64
    make estimate-memory MODEL=recipes/configs/llama_100m.json CONFIG=accelerate_configs/fsdp.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import sys


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
import common  # noqa: E402,F401  (quiets torchao's import lines on a CPU build of torch, as in a run)
from common.planning import memory  # noqa: E402  (its docstring: the model, for --help)
from common.planning.memory import MB, estimate, process_baseline_mb, read_model, read_strategy  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=f"{memory.__doc__}\n{__doc__}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a config.json, a model folder, or a Hub name")
    parser.add_argument(
        "--config", default=os.path.join(REPO, "accelerate_configs/ddp.yaml"), help="an accelerate config YAML"
    )
    parser.add_argument("--num_processes", type=int, help="world size (default: the config's)")
    parser.add_argument("--batch_size", type=int, default=1, help="per-device micro-batch")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16", "fp8"], help="default: the config's")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="activation checkpointing (also on when the config's FSDP settings turn it on)",
    )
    parser.add_argument("--vocab_size", type=int, help="override the config's (a model built for a tokenizer)")
    parser.add_argument(
        "--dpo_reference",
        action="store_true",
        help="add recipes/dpo.py's frozen reference copy (not with --use_peft or "
        "--precompute_ref_log_probs, which hold none); a DPO micro-batch of B pairs is 2B rows: "
        "pass --batch_size 2B",
    )
    parser.add_argument(
        "--distill_teacher",
        help="add recipes/distill.py's frozen teacher (a config.json, a model folder or a Hub name), held as DPO's "
        "reference copy; its on-policy samples: --grpo_generations 1",
    )
    parser.add_argument(
        "--use_peft", action="store_true", help="LoRA at the recipes' defaults: only the adapters train"
    )
    parser.add_argument(
        "--grpo_generations",
        type=int,
        help="add recipes/grpo.py's rollout of this many completions per prompt (--num_generations): the copy of "
        "the whole weights it samples from where the config shards them, and the KV cache of --seq_len tokens "
        "(prompt + --max_completion_length)",
    )
    parser.add_argument(
        "--rollout_stages",
        action="store_true",
        help="with --grpo_generations: the rollouts sample from a slice of the layers per process "
        "(recipes/grpo.py --rollout_weights stages), not a whole copy",
    )
    parser.add_argument("--json", help="also write the estimate here")
    args = parser.parse_args(argv)
    for path, what in ((args.config, "--config"),):
        if not os.path.isfile(path):
            raise SystemExit(
                f"error: {what} {path} is not a file; pass an accelerate config YAML (accelerate_configs/*.yaml)"
            )
    strategy = read_strategy(args.config, args.num_processes, args.mixed_precision)
    models = {}
    for flag, path in (("--model", args.model), ("--distill_teacher", args.distill_teacher)):
        if path is None:
            continue
        try:
            models[flag] = read_model(path, args.vocab_size)
        except (OSError, ValueError) as error:
            raise SystemExit(
                f"error: {flag} {path} gives no model config ({str(error).splitlines()[0]}); "
                "pass a config.json, a model folder or a Hub name reachable from here"
            )
    model = models["--model"]
    from common.launch.errors import UsageError

    try:
        result = estimate(
            model,
            strategy,
            args.batch_size,
            args.seq_len,
            args.gradient_checkpointing,
            args.gradient_accumulation_steps,
            args.dpo_reference,
            model["lora_parameters"] if args.use_peft else None,
            args.grpo_generations,
            args.rollout_stages,
            models.get("--distill_teacher"),
        )
    except (UsageError, ValueError) as error:  # what a pipeline cannot run
        raise SystemExit(f"error: {args.config}: {error}")
    import torch

    baseline = 0.0 if torch.cuda.is_available() else process_baseline_mb(strategy)
    result["process_baseline_mb"] = round(baseline, 1)
    result["peak_mb"] = round(result["tensors_peak"] / MB + baseline, 1)
    result["run_peak_mb"] = round(result["run_tensors_peak"] / MB + baseline, 1)
    for rank in result.get("stages", []):
        rank["peak_mb"] = round(rank["tensors_peak"] / MB + baseline, 1)
    print(
        f"{model['parameters']:,} parameters; {os.path.basename(args.config)} on {strategy['num_processes']} "
        f"process(es), {strategy['mixed_precision']}, batch {args.batch_size} x {args.seq_len} tokens"
        f"{f', accumulation {args.gradient_accumulation_steps}' if args.gradient_accumulation_steps > 1 else ''}"
        f"{', activation checkpointing' if result['activation_checkpointing'] else ''}; MB per rank:"
    )
    if "stages" in result:
        print_stages(result, strategy, args.gradient_accumulation_steps, baseline)
    else:
        print_categories(result, args, baseline)
    result.update(strategy=strategy, model=model)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return result


def print_stages(result: dict, strategy: dict, micro_batches: int, baseline: float) -> None:
    """One row per pipeline rank (its stages), the largest peak the per-device one."""
    size, replicas = strategy["pp_size"], strategy["num_processes"] // strategy["pp_size"]
    print(
        f"  {strategy['pp_schedule']} over {size * strategy['stages_per_rank']} stages, {micro_batches} micro-batch(es) "
        f"per step, {replicas} pipeline(s) (rank r holds what rank r mod {size} does)"
    )
    columns = {
        "parameters": "parameters",
        "gradients": "gradients",
        "optimizer_states": "optimizer",
        "communication_buffers": "buffers",
        "activations": "activations",
        "step_transient": "transient",
    }
    names = " ".join(f"{name:>11}" for name in columns.values())
    print(f"  {'rank: stages (layers)':30} {names}  in flight      peak")
    last = len(result["stages"]) * strategy["stages_per_rank"] - 1
    for rank in result["stages"]:
        parts = []
        for index, layers in zip(rank["stage_indices"], rank["layers"]):
            ends = (
                (["embeddings"] if index == 0 else [])
                + [f"{layers[0]}-{layers[-1]}"]
                + (["head"] if index == last else [])
            )
            parts.append(f"{index} ({', '.join(ends)})")
        print(
            f"  {str(rank['rank']) + ': ' + '; '.join(parts):30} "
            + " ".join(f"{rank[key] / MB:11.1f}" for key in columns)
            + f"  {rank['in_flight']:9d}  {rank['peak_mb']:8.1f}"
        )
    print(
        f"  {'loading_peak':22} {result['loading_peak'] / MB:10.1f}  (each rank builds the whole model, then keeps its stages)"
    )
    if baseline:
        print(f"  {'process (start-up)':22} {baseline:10.1f}  (in each peak)")
    print(f"  {'peak':22} {result['peak_mb']:10.1f}  (rank {result['rank']})")


def print_categories(result: dict, args, baseline: float) -> None:
    for key in (
        "parameters",
        "master_weights",
        "gradients",
        "optimizer_states",
        *(("reference_model",) if args.dpo_reference or args.distill_teacher else ()),
        *(("rollout_weights",) if args.grpo_generations else ()),
        "model_state",
        "communication_buffers",
        "activations",
        "step_transient",
        *(("sampling",) if args.grpo_generations else ()),
        "loading_peak",
    ):
        print(f"  {key:22} {result[key] / MB:10.1f}")
    if baseline:
        print(f"  {'process (start-up)':22} {baseline:10.1f}")
    print(f"  {'peak':22} {result['peak_mb']:10.1f}")
    if result["accumulation_transient"]:
        print(f"  {'peak from step 2':22} {result['run_peak_mb']:10.1f}  (gradients held whole between micro-batches)")


if __name__ == "__main__":
    sys.exit(main() and 0)
