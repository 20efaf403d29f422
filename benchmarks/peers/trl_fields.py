"""The fields of TRL's configs the recipes are checked against (tests/data/trl_config_fields.json): each recipe's
TRL config class, its fields (TrainingArguments' included) as the installed trl has them. trl is installed by
`make benchmark-peers`; run this after changing the version it installs:

    .venv/bin/python benchmarks/peers/trl_fields.py --out tests/data/trl_config_fields.json
"""

import argparse
import dataclasses
import json

import trl
from trl import DPOConfig, GRPOConfig, RewardConfig, SFTConfig


CONFIGS = {"sft": SFTConfig, "dpo": DPOConfig, "reward_model": RewardConfig, "grpo": GRPOConfig}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fields = {
        recipe: sorted(f.name for f in dataclasses.fields(config) if f.init and not f.name.startswith("_"))
        for recipe, config in CONFIGS.items()
    }
    with open(args.out, "w") as handle:
        json.dump({"trl": trl.__version__, "fields": fields}, handle, indent=1)
        handle.write("\n")


if __name__ == "__main__":
    main()
