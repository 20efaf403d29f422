"""Print the demo's final eval loss beside the corpus' entropy floor.

python scripts/demo_report.py --run outputs/causal_lm_demo --data outputs/data/markov
"""

import argparse
import json
import os
import sys


def final_eval(run_dir: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = [row for row in rows if "eval_loss" in row]
    if not evals:
        sys.exit(f"error: no eval line in {run_dir}/metrics.jsonl; did the run finish?")
    return evals[-1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", default="outputs/causal_lm_demo")
    parser.add_argument("--data", default="outputs/data/markov")
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed excess over the floor")
    args = parser.parse_args(argv)
    floor = json.load(open(os.path.join(args.data, "source.json")))["entropy_rate_nats"]
    run = json.load(open(os.path.join(args.run, "run.json")))
    loss = final_eval(args.run)["eval_loss"]
    excess = loss / floor - 1
    print(f"demo: {run['participating_processes']} processes ({run['distributed_type']}), {run['max_steps']} steps")
    print(f"demo: eval loss {loss:.4f} nats/token vs entropy floor {floor:.4f} ({excess:+.1%})")
    print(f"demo: model saved to {os.path.join(args.run, 'final')}")
    if excess > args.tolerance:
        sys.exit(f"error: eval loss is more than {args.tolerance:.0%} above the floor")


if __name__ == "__main__":
    main()
