"""A checkpoint converted ahead of time for the accelerate config it will resume under, without launching.

What a resume under that config does before training, done here in one CPU process: a checkpoint
of another strategy family (DDP or one process, FSDP2, DeepSpeed ZeRO) is rewritten into
`step_N/portable`, every parameter's fp32 master weight and Adam moments by name
(common/outputs/portable.py); a ZeRO checkpoint for another number of processes becomes DeepSpeed's
universal form in `step_N/universal` (common/outputs/reshard.py). The checkpoint's own files are left as
they are, and the resume finds the conversion done.

    python scripts/convert_checkpoint.py --checkpoint outputs/run/checkpoints/step_200 \
        --config_file accelerate_configs/zero3_offload.yaml --num_processes 4
    make convert-checkpoint CHECKPOINT=outputs/run/checkpoints/step_200 CONFIG=accelerate_configs/fsdp.yaml
"""

from __future__ import annotations

import argparse
import os

from common.launch.errors import UsageError, exits_on_usage_error
from common.outputs.portable import FAMILY
from common.outputs.reshard import conversion_needed, convert
from common.outputs.run_dir import STATE_FILE
from common.planning.memory import read_strategy


@exits_on_usage_error
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a run's checkpoints/step_N folder")
    parser.add_argument("--config_file", required=True, help="the accelerate config the run will resume under")
    parser.add_argument(
        "--num_processes",
        type=int,
        default=None,
        help="the processes it will resume on (default: the config's num_processes)",
    )
    args = parser.parse_args(argv)
    checkpoint = os.path.normpath(args.checkpoint)
    if not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
        raise UsageError(
            f"--checkpoint {checkpoint} is not a complete checkpoint (no {STATE_FILE}); pass a "
            "checkpoints/step_N folder of a run"
        )
    if not os.path.isfile(args.config_file):
        raise UsageError(f"--config_file {args.config_file} does not exist; pass one of accelerate_configs/*.yaml")
    strategy = read_strategy(args.config_file, args.num_processes, None)
    zero_layout = (
        {key: strategy[key] for key in ("num_processes", "zero3_sub_group_size")}
        if strategy["strategy"] == "deepspeed"
        else None
    )
    conversion = conversion_needed(checkpoint, FAMILY[strategy["strategy"]], zero_layout)
    if conversion is None:
        print(f"{checkpoint}: nothing to convert; it loads under {args.config_file} as it is")
        return
    target = conversion[0]
    if os.path.isfile(os.path.join(target, STATE_FILE)):
        print(f"{checkpoint}: already converted into {target}; a resume under {args.config_file} loads it")
        return
    convert(checkpoint, conversion)
    print(f"{checkpoint}: converted into {target}; a resume under {args.config_file} loads it")


if __name__ == "__main__":
    main()
