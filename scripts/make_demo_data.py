"""Generate the demo corpus: a seeded word-level Markov source with a known entropy floor.

    python scripts/make_demo_data.py --out outputs/data/markov
"""

import argparse
import json
import os

from common.synthetic import write_markov_corpus


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="outputs/data/markov")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train_docs", type=int, default=6000)
    parser.add_argument("--validation_docs", type=int, default=400)
    args = parser.parse_args(argv)
    marker = os.path.join(args.out, "source.json")
    if os.path.exists(marker):
        with open(marker) as handle:
            info = json.load(handle)
        if info.get("seed") == args.seed and info.get("train_docs") == args.train_docs:
            print(f"demo data already in {args.out}")
            return info
    info = write_markov_corpus(args.out, args.train_docs, args.validation_docs, args.seed)
    print(f"wrote {args.out}: entropy floor {info['entropy_rate_nats']:.4f} nats/token")
    return info


if __name__ == "__main__":
    main()
