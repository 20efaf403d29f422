"""A run's curves as a picture, with no tracker or server: its metrics.jsonl drawn into a PNG.

    make plot RUN=outputs/sft_demo                  # writes outputs/sft_demo/curves.png
    python scripts/plot_run.py --run outputs/x --out x.png

Top: the training loss at each logged step and every evaluation's loss; below: the learning
rate. A run resumed from a checkpoint logs its steps once (metrics.jsonl drops the rows after
the checkpoint), so the curve is the run's as a whole.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common.launch.errors import UsageError, exits_on_usage_error  # noqa: E402


def read_rows(run: str) -> tuple[list[dict], list[dict]]:
    """(training rows, evaluation rows) of `run`/metrics.jsonl."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UsageError(
            f"{run} has no metrics.jsonl; pass the --output_dir of a run (it holds run.json and metrics.jsonl)"
        )
    with open(path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    train = [row for row in rows if "loss" in row]
    evaluations = [row for row in rows if "eval_loss" in row]
    if not train and not evaluations:
        raise UsageError(f"{path} holds no logged loss yet; plot it once the run has logged a step")
    return train, evaluations


@exits_on_usage_error
def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a run's output_dir")
    parser.add_argument("--out", help="the PNG to write (default: <run>/curves.png)")
    args = parser.parse_args(argv)
    train, evaluations = read_rows(args.run)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, lr_axis) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    if train:
        loss_axis.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", linewidth=1)
    if evaluations:
        loss_axis.plot(
            [r["step"] for r in evaluations], [r["eval_loss"] for r in evaluations], "o-", label="eval loss"
        )
    loss_axis.set_ylabel("loss")
    loss_axis.legend()
    loss_axis.set_title(os.path.basename(os.path.abspath(args.run)))
    lr_axis.plot([r["step"] for r in train if "lr" in r], [r["lr"] for r in train if "lr" in r], color="gray")
    lr_axis.set_ylabel("learning rate")
    lr_axis.set_xlabel("optimizer step")
    out = args.out or os.path.join(args.run, "curves.png")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    print(f"{len(train)} training and {len(evaluations)} evaluation rows of {args.run} drawn into {out}")
    return out


if __name__ == "__main__":
    main()
