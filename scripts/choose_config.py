"""Choose the accelerate config for a job: the shipped configs ranked by estimated memory and step time (the model
and how it ranks: common/planning/step_time.py, which --help prints), the fastest that fits written as a ready
accelerate YAML.

    make choose-config MODEL=recipes/configs/llama3_8b.json ARGS="--num_devices 8 --device h100 --seq_len 4096 --global_batch 64"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from common.planning import step_time  # noqa: E402  (its docstring: the model, for --help)
from common.planning.memory import read_model  # noqa: E402
from common.planning.step_time import (  # noqa: E402
    COLLECTIVES,
    DEVICES,
    GB,
    PIPELINE_SCHEDULES,
    RECIPES,
    candidates,
    layout_name,
    measure_host,
    rank,
)


def write_yaml(choice: dict, args, path: str) -> None:
    """The chosen config's YAML with num_processes, num_machines and FSDP's activation checkpointing set,
    and the recipe arguments the choice assumes in its header."""
    with open(os.path.join(REPO, "accelerate_configs", choice["config"])) as handle:
        text = handle.read()
    text = re.sub(r"(?m)^num_processes: .*$", f"num_processes: {args.num_devices}", text)
    text = re.sub(r"(?m)^num_machines: .*$", f"num_machines: {args.num_nodes}", text)
    if args.num_nodes > 1:
        text = re.sub(
            r"(?m)^  parallelism_config_dp_replicate_size: .*$",
            f"  parallelism_config_dp_replicate_size: {args.num_nodes}",
            text,
        )
        text = re.sub(
            r"(?m)^  parallelism_config_dp_shard_size: .*$",
            f"  parallelism_config_dp_shard_size: {args.num_devices // args.num_nodes}",
            text,
        )
    text = re.sub(r"(?m)^mixed_precision: .*$", f"mixed_precision: '{args.mixed_precision}'", text)
    if choice["sp_size"] > 1:  # the chosen split, and the groups beside each other
        shard, key = args.num_devices // choice["sp_size"], "cp" if choice["strategy"].get("cp_size", 1) > 1 else "sp"
        text = re.sub(
            rf"(?m)^  parallelism_config_{key}_size: .*$",
            f"  parallelism_config_{key}_size: "
            f"{choice['sp_size']}" + (f"\n  parallelism_config_dp_shard_size: {shard}" if shard > 1 else ""),
            text,
        )
    if choice["strategy"].get("ep_size", 1) > 1:  # the experts over ep_size devices, FSDP2's shards over them all
        for key, size in (("ep", choice["strategy"]["ep_size"]), ("dp_shard", args.num_devices)):
            text = re.sub(
                rf"(?m)^  parallelism_config_{key}_size: .*$", f"  parallelism_config_{key}_size: {size}", text
            )
    if choice["tp_size"] > 1:  # the chosen groups, and FSDP2's shards of a node beside them (fsdp_tp.yaml)
        text = re.sub(
            r"(?m)^  parallelism_config_tp_size: .*$", f"  parallelism_config_tp_size: {choice['tp_size']}", text
        )
        text = re.sub(
            r"(?m)^  parallelism_config_dp_shard_size: .*$",
            f"  parallelism_config_dp_shard_size: {args.num_devices // args.num_nodes // choice['tp_size']}",
            text,
        )
    if choice["pp_size"] > 1:  # the chosen pipeline and schedule (num_processes / pp_size replicas beside)
        text = re.sub(
            r"(?m)^  parallelism_config_pp_size: .*$", f"  parallelism_config_pp_size: {choice['pp_size']}", text
        )
        text = re.sub(
            r"(?m)^  parallelism_config_pp_schedule: .*$",
            f"  parallelism_config_pp_schedule: {choice['schedule']}",
            text,
        )
    if choice["strategy"]["strategy"] == "fsdp":
        text = re.sub(
            r"(?m)^  fsdp_activation_checkpointing: .*$",
            f"  fsdp_activation_checkpointing: {str(choice['activation_checkpointing']).lower()}",
            text,
        )
    header = (
        f"# Chosen by make choose-config from {os.path.basename(choice['config'])} for {args.model} on "
        f"{args.num_devices} device(s) ({args.device}), {args.seq_len}-token sequences, global batch "
        f"{args.global_batch}, {args.mixed_precision}.\n# Launch with: {launch_line(choice, args, path)}\n"
    )
    if args.num_nodes > 1:
        header += "# On each node: fill main_process_ip below (node 0's address) and pass --machine_rank 0..N-1.\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(header + text)


def launch_line(choice: dict, args, path: str) -> str:
    checkpointing = (
        " --gradient_checkpointing true"
        if choice["activation_checkpointing"] and choice["strategy"]["strategy"] != "fsdp"
        else ""
    )
    node = " --machine_rank NODE_RANK --main_process_ip NODE0_ADDRESS" if args.num_nodes > 1 else ""
    # sft.py packs by default; a pipeline carries no packed row's per-example attention between stages
    unpacked = " --packing false" if args.recipe == "sft" and choice["strategy"].get("pp_size", 1) > 1 else ""
    if args.recipe == "grpo":
        unpacked += f" --num_generations {args.num_generations} --max_completion_length {args.max_completion_length}"
    return (
        f"accelerate launch --config_file {path}{node} recipes/{args.recipe}.py --per_device_train_batch_size "
        f"{choice['micro_batch']} --gradient_accumulation_steps {choice['accumulation']} --block_size "
        f"{args.seq_len}{checkpointing}{' --use_peft true' if args.use_peft else ''}{unpacked} ..."
    )


def parse(argv):
    parser = argparse.ArgumentParser(
        description=f"{step_time.__doc__}\n{__doc__}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a config.json, a model folder, or a Hub name")
    parser.add_argument("--num_devices", type=int, required=True, help="devices (processes) over all nodes")
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--device", choices=[*DEVICES, "cpu"], help="default: the GPU here, else cpu (measured)")
    parser.add_argument(
        "--device_memory_gb",
        type=float,
        help="memory per device (default: the preset's; on cpu this host's available memory / devices)",
    )
    parser.add_argument("--peak_tflops", type=float, help="the device's dense peak in the compute dtype")
    parser.add_argument(
        "--mfu",
        type=float,
        help="achieved fraction of the peak (default 0.37: the recipe's "
        "measured MFU at 1B on an H200, docs/gpu; on cpu 1.0 of the "
        "measured matmul rate)",
    )
    parser.add_argument("--link_gbps", type=float, help="intra-node busbw of every collective, GB/s")
    parser.add_argument("--memory_gbps", type=float, help="the device's memory bandwidth, GB/s (on cpu: measured)")
    parser.add_argument("--vocab_size", type=int, help="override the config's (a model built for a tokenizer)")
    parser.add_argument(
        "--doctor_report", help="make doctor's --report JSON: each collective's busbw at its largest size"
    )
    parser.add_argument(
        "--inter_node_gbps",
        type=float,
        default=50.0,
        help="busbw between nodes, GB/s (default: a 400 Gb/s NIC per device; a --doctor_report "
        "run over several nodes replaces it)",
    )
    parser.add_argument("--host_link_gbps", type=float, help="device to CPU RAM, GB/s (offload)")
    parser.add_argument(
        "--host_memory_gb",
        type=float,
        help="CPU RAM per node (default: the preset's, on cpu this host's available memory)",
    )
    parser.add_argument(
        "--host_memory_gbps",
        type=float,
        help="CPU memory bandwidth per node, GB/s, for the CPU optimizer (default 100; on cpu: measured)",
    )
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument(
        "--global_batch",
        type=int,
        required=True,
        help="sequences per optimizer step, all devices (dpo, reward_model: pairs, two rows each; grpo: completions, "
        "as TRL's batch counts them)",
    )
    parser.add_argument(
        "--recipe",
        choices=RECIPES,
        default="causal_lm",
        help="the recipe the command launches (dpo: its frozen reference copy, two rows a pair and the reference's "
        "forward are estimated; grpo: the rollout's copy of the whole weights where they are sharded, its KV cache "
        "and its decoding, as make estimate-memory --grpo_generations counts them; dpo, reward_model and grpo score "
        "whole rows: the pipelines are not ranked, nor for dpo and reward_model the row-splitting configs)",
    )
    parser.add_argument(
        "--num_generations", type=int, default=8, help="grpo: completions per prompt (G), sampled together"
    )
    parser.add_argument(
        "--max_completion_length", type=int, default=256, help="grpo: the longest completion, in tokens"
    )
    parser.add_argument(
        "--use_peft",
        action="store_true",
        help="LoRA at the recipes' defaults (rank 8, peft's modules): only the adapters have gradients and AdamW "
        "moments (and DPO holds no reference copy, unless it starts from an adapter: then a frozen copy)",
    )
    parser.add_argument(
        "--micro_batch",
        type=int,
        help="sequences per device per forward (default: the fastest "
        "that fits, among the divisors of the per-device batch)",
    )
    parser.add_argument(
        "--activation_checkpointing",
        choices=["auto", "off", "on"],
        default="auto",
        help="auto: whichever is faster among what fits (a config may turn it on itself)",
    )
    parser.add_argument("--mixed_precision", choices=["bf16", "fp16", "no"], default="bf16")
    parser.add_argument(
        "--headroom",
        type=float,
        help="fraction of device memory kept free (default 0.1: the "
        "estimate's gap to a run's measured peak, up to 14%% below "
        "it on a CPU host, docs/choose-config.md; on a GPU the CUDA "
        "context and fragmentation too)",
    )
    parser.add_argument("--configs", nargs="+", help="rank only these shipped configs (names in accelerate_configs/)")
    parser.add_argument(
        "--pp_schedules",
        nargs="+",
        choices=PIPELINE_SCHEDULES,
        default=list(PIPELINE_SCHEDULES),
        help="the pipeline schedules to try (GPipe: 1F1B's bubble with every micro-batch's activations held)",
    )
    parser.add_argument("--output", default=os.path.join("outputs", "chosen_config.yaml"))
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.add_argument("--json", help="also write the table here")
    return parser.parse_args(argv)


def read_doctor_report(path: str) -> dict:
    """Each collective's busbw at its largest size from make doctor's --report (an older one: all_reduce's)."""
    try:
        with open(path) as handle:
            report = json.load(handle)
        return {op: (report.get(op) or report["all_reduce"])[-1]["busbw_gbps"] for op in COLLECTIVES}
    except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
        raise SystemExit(
            f"error: --doctor_report {path} is not make doctor's report over 2 or more processes "
            f"({type(error).__name__}: {error}); run make doctor ARGS='--max_size 256M --report "
            f"{path}'"
        ) from None


def resolve_device(args, model: dict) -> dict:
    """The device figures: a preset or this host measured (cpu), then the user's overrides."""
    import torch

    if args.device is None:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        args.device = next((key for key in DEVICES if re.search(rf"\b{key}\b", name.lower())), "cpu")
        if args.device == "cpu" and name != "cpu":
            raise SystemExit(
                f"error: no preset for {name}; pass --device and --peak_tflops, --device_memory_gb, --link_gbps"
            )
    overrides = {
        "tflops": args.peak_tflops,
        "memory_gb": args.device_memory_gb,
        "memory_gbps": args.memory_gbps,
        "host_link_gbps": args.host_link_gbps,
        "inter_node_gbps": dict.fromkeys(COLLECTIVES, args.inter_node_gbps),
    }
    # a report's ring spans the nodes it ran on: on several nodes it measures the link between them
    measured = "inter_node_gbps" if args.num_nodes > 1 else "link_gbps"
    if args.link_gbps:
        overrides["link_gbps"] = dict.fromkeys(COLLECTIVES, args.link_gbps)
    if args.doctor_report:
        overrides[measured] = read_doctor_report(args.doctor_report)
    elif args.device == "cpu" and args.num_devices > 1 and not args.link_gbps:
        raise SystemExit(
            "error: on cpu the link between processes is measured, not assumed: run make doctor "
            "ARGS='--max_size 256M --report doctor.json' and pass --doctor_report doctor.json"
        )
    if args.device == "cpu":  # one process of the job on its share of the cores
        device = {"memory_gb": available_memory_gb() / args.num_devices}
        if args.peak_tflops is None or args.memory_gbps is None:
            threads = max(1, (os.cpu_count() or 1) // (args.num_devices // args.num_nodes))
            device.update(
                measure_host(
                    torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32,
                    threads,
                    model,
                    min(args.seq_len, 2048),
                )
            )
    else:
        device = dict(DEVICES[args.device])
        device["link_gbps"] = dict.fromkeys(COLLECTIVES, device["link_gbps"])
        if args.mixed_precision == "no":
            device["tflops"] = device["tflops_fp32"]
    device.update({key: value for key, value in overrides.items() if value is not None})
    if args.device == "cpu":  # offload, collectives and the CPU optimizer all go through this memory
        device.setdefault("link_gbps", dict.fromkeys(COLLECTIVES, 0.0))  # one process: nothing crosses a link
        device["host_link_gbps"] = device["memory_gbps"]
        args.host_memory_gbps = args.host_memory_gbps or device["memory_gbps"]
    args.host_memory_gbps = args.host_memory_gbps or 100.0
    args.mfu = args.mfu or (1.0 if args.device == "cpu" else 0.37)
    args.headroom = 0.1 if args.headroom is None else args.headroom
    args.host_memory_source = (
        "--host_memory_gb"
        if args.host_memory_gb
        else f"the {args.device} preset's; pass --host_memory_gb for yours"
        if device.get("host_memory_gb")
        else "this host's available memory; pass --host_memory_gb for yours"
    )
    args.host_memory_gb = args.host_memory_gb or device.get("host_memory_gb") or available_memory_gb()
    return device


def available_memory_gb() -> float:
    with open("/proc/meminfo") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("MemAvailable")) / GB


def main(argv=None) -> dict:
    args = parse(argv)
    if args.num_devices < 1 or args.num_nodes < 1 or args.num_devices % args.num_nodes:
        raise SystemExit(
            f"error: --num_devices {args.num_devices} is not a multiple of --num_nodes {args.num_nodes}; "
            "pass the total device count over all nodes"
        )
    if args.global_batch < 1 or args.seq_len < 2:
        raise SystemExit(
            f"error: --global_batch {args.global_batch} and --seq_len {args.seq_len}: pass at least 1 "
            "sequence and 2 tokens"
        )
    if args.recipe == "grpo" and (args.num_generations < 2 or args.max_completion_length >= args.seq_len):
        raise SystemExit(
            f"error: --num_generations {args.num_generations} and --max_completion_length "
            f"{args.max_completion_length} with --seq_len {args.seq_len}: GRPO needs 2 or more completions a prompt "
            "and room for a prompt (--seq_len is the recipe's --block_size, prompt and completion together)"
        )
    if args.global_batch % args.num_devices:
        raise SystemExit(
            f"error: --global_batch {args.global_batch} does not divide over {args.num_devices} devices; "
            "pass a multiple of --num_devices"
        )
    per_device = args.global_batch // args.num_devices
    if args.micro_batch is not None and (args.micro_batch < 1 or per_device % args.micro_batch):
        raise SystemExit(
            f"error: --micro_batch {args.micro_batch} does not divide the per-device batch {per_device} "
            f"(--global_batch {args.global_batch} over {args.num_devices} devices); pass a divisor of it"
        )
    for path, flag in ((args.output, "--output"), (args.json, "--json")):
        if path and os.path.exists(path) and not args.overwrite:
            raise SystemExit(f"error: {path} exists; pass another {flag} or --overwrite to replace it")
    try:
        model = read_model(args.model, args.vocab_size)
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"error: --model {args.model} gives no model config ({str(error).splitlines()[0]}); "
            "pass a config.json, a model folder or a Hub name reachable from here"
        )
    configs, not_ranked = candidates(args)
    device = resolve_device(args, model)
    rows = rank(args, model, device, configs)
    links = "; ".join(
        f"{where} " + ", ".join(f"{op} {bw:.3g}" for op, bw in device[key].items())
        for where, key in (("link busbw GB/s:", "link_gbps"), ("between nodes:", "inter_node_gbps"))
        if key == "link_gbps" or args.num_nodes > 1
    )
    print(
        f"{model['parameters']:,} parameters on {args.num_devices} x {args.device} in {args.num_nodes} node(s) "
        f"({device['memory_gb']:.1f} GB, {device['tflops']:.3g} TFLOP/s peak at {args.mfu:.2f}, {links}), "
        f"{args.seq_len}-token sequences, global batch {args.global_batch}, {args.mixed_precision}; "
        f"CPU RAM {args.host_memory_gb:.0f} GB per node ({args.host_memory_source}); recipes/{args.recipe}.py"
        f"{' with LoRA (--use_peft)' if args.use_peft else ''}"
    )
    print(
        f"{'config':34} {'micro x acc':>11} {'AC':>3} {'GB/device':>9} {'CPU GB/node':>11} {'compute s':>9} "
        f"{'comm s':>7} {'other s':>7} {'bubble':>6} {'step s':>7}  verdict"
    )
    for r in rows:
        bubble = f"{r['bubble']:.2f}" if r["pp_size"] > 1 else "-"
        print(
            f"{layout_name(r):34} {r['micro_batch']:>6} x {r['accumulation']:<3} "
            f"{'on' if r['activation_checkpointing'] else 'off':>3} {r['device_gb']:9.2f} {r['host_gb_per_node']:11.1f} "
            f"{r['compute_s']:9.3g} {r['comm_s']:7.3g} {r['other_s']:7.3g} "
            f"{bubble:>6} {r['step_s']:7.3g}  {r['verdict']}"
        )
    for name, why in not_ranked.items():
        print(f"not ranked: {name}: {why}")
    result = {
        "device": device,
        "model": model,
        "rows": [{k: v for k, v in r.items() if k != "strategy"} for r in rows],
        "not_ranked": not_ranked,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    choice = next((r for r in rows if r["verdict"] == "chosen"), None)
    if choice is None:
        raise SystemExit(
            f"error: no config fits: {rows[0]['config']} {rows[0]['verdict']}; use more devices or "
            "nodes, more CPU RAM for offload, a shorter --seq_len, or LoRA (--use_peft)"
        )
    write_yaml(choice, args, args.output)
    print(f"wrote {args.output}\n{launch_line(choice, args, args.output)}")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
