"""Each speed option (common/training/speed.py) against the recipe's defaults, on one job, in one run.

The job is benchmarks/benchmark_peers.py's (recipes/causal_lm.py on a Llama built from a config,
the demo's Markov corpus in packed blocks, the accelerate config's precision). Each option is
the defaults plus that option's flags; every variant runs --rounds times, the order rotated
each round, timed after --warmup steps. The table gives tokens/s (median) and the peak memory of
the last logged window (the rank with the highest; resident set on a CPU host, the CUDA
allocator's peak on a GPU), each as a ratio to the defaults. An option the host cannot run is
listed with the recipe's own one-line refusal (Liger and flex_attention need a GPU; FP8, accelerate's
`--mixed_precision fp8 --fp8_backend ao` launcher flags, needs torchao, and is faster only on an Ada or Hopper GPU).

    make benchmark-options                                # ddp.yaml: 2 processes, bf16
    make benchmark-options ARGS="--options torch_compile adamw_torch --rounds 3"

With --docs the table goes to docs/benchmark-options.md (benchmarks/figures.py).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import yaml


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmark_peers import REPO, check_job, job_line, job_parser, launch, mfu, model_config  # noqa: E402
from figures import markdown_table, write_page  # noqa: E402

# benchmark_peers puts the repository on the path
from common.training.speed import fp8_host, fp8_problem  # noqa: E402


OPTIONS = {
    "defaults": [],
    "torch_compile": ["--torch_compile", "true"],
    "adamw_torch": ["--optim", "adamw_torch"],
    "checkpoint_every_layer": ["--gradient_checkpointing", "true"],
    "checkpoint_every_2nd_layer": ["--gradient_checkpointing", "true", "--gradient_checkpointing_every_n_layers", "2"],
    "attention_eager": ["--attn_implementation", "eager"],
    "attention_flash": ["--attn_implementation", "flash_attention_2"],
    "attention_flex": ["--attn_implementation", "flex_attention"],
    "liger": ["--use_liger_kernel", "true"],
    "compile_and_liger": ["--torch_compile", "true", "--use_liger_kernel", "true"],
    "fp8": [],
    "compile_and_fp8": ["--torch_compile", "true"],
}
# Options that are the launcher's, not the recipe's: accelerate's FP8 (torchao's float8 matmuls in the linear
# layers but the first and last; MFU against the bf16 peak)
FP8 = ["--mixed_precision", "fp8", "--fp8_backend", "ao"]
LAUNCHER = {"fp8": FP8, "compile_and_fp8": FP8}


def main(argv=None):
    parser = job_parser(__doc__)
    parser.add_argument(
        "--options",
        nargs="+",
        default=[name for name in OPTIONS if name != "defaults"],
        choices=[name for name in OPTIONS if name != "defaults"],
        help="the options to time",
    )
    args = parser.parse_args(argv)
    check_job(args)
    variants = ["defaults", *args.options]
    speeds, peaks, refused, flops = {name: [] for name in variants}, {}, {}, {}
    refusal = fp8_refusal()
    launcher_refusal = {name: refusal for name in variants if refusal and LAUNCHER.get(name) == FP8}
    with tempfile.TemporaryDirectory() as folder:
        config = model_config(args.hidden, args.layers, folder)
        for round_ in range(args.rounds):
            shift = round_ % len(variants)
            for name in variants[shift:] + variants[:shift]:
                if name in refused:
                    continue
                if name in launcher_refusal:
                    result = {"refused": launcher_refusal[name]}
                else:
                    result = launch(
                        "recipe",
                        args,
                        config,
                        folder,
                        round_,
                        recipe_args=OPTIONS[name],
                        name=name,
                        launcher_args=launcher_args(name, args.config),
                    )
                if "refused" in result:
                    refused[name] = result["refused"]
                    print(f"round {round_ + 1}: {name:28s} {result['refused']}", flush=True)
                    continue
                speeds[name].append(result["tokens"] / result["seconds"])
                peaks[name] = result["peak_mb"]  # the CUDA allocator's peak on a GPU, the resident set on a CPU host
                flops = flops or result  # FLOPs per token and the device's peak (MFU on a GPU): the same job for all
                print(
                    f"round {round_ + 1}: {name:28s} {speeds[name][-1]:10.0f} tokens/s, peak {peaks[name]:.0f} MB "
                    f"(loss {result['loss']:.3f})",
                    flush=True,
                )
                if args.docs and speeds["defaults"]:  # the page so far: a run cut short keeps what it measured
                    write_table(args, variants, speeds, peaks, refused, flops, quiet=True)
    if "defaults" in refused:
        raise SystemExit(f"error: the recipe's defaults did not run: {refused['defaults']}")
    write_table(args, variants, speeds, peaks, refused, flops)


def launcher_args(name: str, config: str) -> list[str]:
    """The option's launcher flags; FP8 under an FSDP config also loads without cpu_ram_efficient_loading, which
    accelerate refuses beside torchao (the shipped FSDP configs turn it on)."""
    flags = list(LAUNCHER.get(name, ()))
    if flags == FP8:
        with open(os.path.join(REPO, "accelerate_configs", config)) as handle:
            if yaml.safe_load(handle).get("distributed_type") == "FSDP":
                flags += ["--fsdp_cpu_ram_efficient_loading", "false"]
    return flags


def fp8_refusal() -> str | None:
    """The recipe's own line for FP8 where accelerate's launcher fails before the recipe can say it (no torchao:
    the launcher raises), else None (the recipe refuses what else this host lacks)."""
    capability, torchao = fp8_host()
    return None if torchao else "error: " + fp8_problem(capability, torchao, "ao", "ddp", False)


def write_table(args, variants: list, speeds: dict, peaks: dict, refused: dict, flops: dict, quiet=False) -> None:
    """The table of the variants measured so far, printed and (with --docs) written to the page."""
    base_speed, base_peak = statistics.median(speeds["defaults"]), peaks["defaults"]
    header = ["option", "flags", "tokens/s (median)", "vs defaults", "peak MB", "vs defaults", "each round's tokens/s"]
    rows = []
    for name in variants:
        flags = " ".join(OPTIONS[name]) or "(none)"
        if name in LAUNCHER:
            flags = f"launch {' '.join(launcher_args(name, args.config))}" + (f"` `{flags}" if OPTIONS[name] else "")
        if name in refused:
            rows.append([name, f"`{flags}`", "refused here:", refused[name].removeprefix("error: "), "", "", ""])
        elif speeds[name]:
            speed = statistics.median(speeds[name])
            rows.append(
                [
                    name,
                    f"`{flags}`",
                    f"{speed:.0f}",
                    f"{speed / base_speed:.2f}x",
                    f"{peaks[name]:.0f}",
                    f"{peaks[name] / base_peak:.2f}x",
                    ", ".join(f"{v:.0f}" for v in speeds[name]),
                ]
            )
    if flops.get("peak_tflops"):  # a GPU in common.training.flops' table
        header.insert(4, "MFU")
        for row in rows:
            row.insert(4, "" if row[2] == "refused here:" else f"{mfu(float(row[2]), args, flops):.1%}")
    table = markdown_table(header, rows)
    if not quiet:
        print(table)
    if args.docs:
        write_page(
            args.docs,
            "The speed options against the recipe's defaults",
            "\n\n".join(
                [
                    job_line(args),
                    table,
                    "Above 1x in tokens/s: faster than the defaults (fused AdamW, sdpa attention, no compile, no "
                    "activation checkpointing). Peak memory: the last logged window's, the rank with the highest; on a "
                    "CPU host the process's resident set (compile's own memory included), on a GPU the CUDA allocator's "
                    "peak. torch_compile's first steps compile; the timed steps come after --warmup.",
                ]
            ),
        )


if __name__ == "__main__":
    main()
