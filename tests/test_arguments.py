import dataclasses
import json
import re

import pytest
from conftest import HOST_BF16, REPO, load_script

from common.launch.errors import UsageError
from common.models.lora import LoraArguments, apply_lora
from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
from common.options.parsing import _parse, parse_args


TYPES = (ModelArguments, DataArguments, TrainingArguments)


@pytest.fixture
def recipe_yaml(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a b"}\n')
    model_config = tmp_path / "model.json"
    model_config.write_text('{"model_type": "llama"}')
    config = tmp_path / "recipe.yaml"
    config.write_text(
        f"model_config: {model_config}\ntokenizer_name_or_path: tok\ntrain_file: {data}\n"
        "learning_rate: 0.01\nmax_steps: 7\ngradient_checkpointing: true\n"
    )
    return config


def test_yaml_values_then_command_line_overrides(recipe_yaml):
    model, data, train = _parse(TYPES, ["--config", str(recipe_yaml), "--learning_rate", "0.5"])
    assert train.learning_rate == 0.5  # command line wins
    assert train.max_steps == 7  # from the YAML
    assert train.gradient_checkpointing is True
    assert train.per_device_train_batch_size == 8  # dataclass default
    assert model.tokenizer_name_or_path == "tok"


def test_equals_form_and_bool_override(recipe_yaml):
    _, _, train = _parse(TYPES, [f"--config={recipe_yaml}", "--gradient_checkpointing", "false"])
    assert train.gradient_checkpointing is False


@pytest.mark.parametrize(
    "line, expected",
    [
        ("bogus_key: 1", "unknown key 'bogus_key'"),
        ("learning_rate: fast", "invalid float value: 'fast'"),
        ("max_steps: 1.5", "invalid int value: '1.5'"),
    ],
)
def test_bad_yaml_names_the_key_and_file(recipe_yaml, line, expected):
    recipe_yaml.write_text(recipe_yaml.read_text() + line + "\n")
    with pytest.raises(UsageError, match=expected) as error:
        _parse(TYPES, ["--config", str(recipe_yaml)])
    assert str(recipe_yaml) in str(error.value)


def test_trainer_options_set_elsewhere_say_where(recipe_yaml):
    """Trainer's --bf16, --deepspeed, --eval_strategy ... are the launcher's or another option's
    here: the one line says which, on the command line and in the recipe YAML."""
    expected = (
        r"unknown argument\(s\) --bf16 true --deepspeed ds.json --lr 1; .*--bf16: mixed precision comes from "
        r"the accelerate config.*; --deepspeed: the strategy comes from the accelerate config: accelerate "
        r"launch --config_file"
    )
    with pytest.raises(UsageError, match=expected) as error:
        _parse(TYPES, ["--config", str(recipe_yaml), "--bf16", "true", "--deepspeed", "ds.json", "--lr", "1"])
    assert "--lr:" not in str(error.value)  # no advice for an option that is not Trainer's
    with pytest.raises(UsageError, match=r"--local_rank: accelerate launch gives each process its rank"):
        _parse(TYPES, ["--config", str(recipe_yaml), "--local-rank=0"])
    recipe_yaml.write_text(recipe_yaml.read_text() + "eval_strategy: steps\n")
    with pytest.raises(UsageError, match=r"recipe.yaml: unknown key 'eval_strategy'.*every --eval_steps N"):
        _parse(TYPES, ["--config", str(recipe_yaml)])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--no_such_flag", "1"], "unknown argument"),
        (["--per_device_train_batch_size", "many"], "invalid int value"),
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be >= 1, got 0"),
        (["--report_to", "comet_ml"], "--report_to must be tensorboard, wandb, trackio, mlflow or none"),
        (["--train_file", "/nonexistent/x.jsonl"], "does not exist"),
        (["--learning_rat", "0.1"], "unknown argument.s. --learning_rat"),  # no prefix matching
        (["--learning_rate", "-0.1"], "--learning_rate must be >= 0"),
        (["--learning_rate", "0"], "nothing would train"),
        (["--adam_beta2", "1.5"], r"--adam_beta2 must be in \[0, 1\)"),
        (["--lr_scheduler_type", "cosin"], "'cosin' is not a scheduler; use one of linear, cosine"),
        (["--max_grad_norm", "-1"], "--max_grad_norm must be >= 0"),
        (
            ["--tokenizer_name_or_path", "./no/such/tokenizer"],
            "tokenizer_name_or_path ./no/such/tokenizer does not exist",
        ),
        (
            ["--model_config", "", "--model_name_or_path", "/no/such/model"],
            "model_name_or_path /no/such/model does not exist",
        ),
        # ranges declared beside each option (common.options.arguments.Range), checked before anything else
        (["--seed", "-1"], re.escape("--seed must be in [0, 4294967295] (numpy's seeds are 32-bit), got -1")),
        (["--seed", str(2**32)], r"--seed must be in \[0, 4294967295\]"),
        (["--learning_rate", "inf"], "--learning_rate must be a finite number, got inf"),
        (
            ["--save_total_limit", "0"],
            re.escape("--save_total_limit must be >= 1 (unset keeps every checkpoint), got 0"),
        ),
        (["--peak_tflops", "0"], "--peak_tflops must be > 0, got 0.0"),
        (["--ddp_timeout", str(10**14)], re.escape("--ddp_timeout must be in [1, 1000000000] (seconds)")),
        (["--max_eval_samples", "0"], "--max_eval_samples must be >= 1"),
        (["--validation_split_percentage", "100"], re.escape("--validation_split_percentage must be in (0, 100)")),
        (["--preprocessing_num_workers", "-1"], "--preprocessing_num_workers must be >= 0, got -1"),
    ],
)
def test_bad_command_line(recipe_yaml, argv, expected):
    with pytest.raises(UsageError, match=expected):
        _parse(TYPES, ["--config", str(recipe_yaml)] + argv)


@pytest.mark.parametrize(
    "yaml_line, argv, expected",
    [
        # before: the type error was reported, the unknown argument only on the next try
        ("", ["--per_device_train_batch_size", "many", "--no_such_flag", "1"], "unknown argument(s) --no_such_flag 1"),
        ("", ["--max_steps=x", "--lr", "1", "--warmup", "--seed", "-1"], "unknown argument(s) --lr 1 --warmup;"),
        ("", ["--learning_rate", "-1", "--bogus-flag=3"], "unknown argument(s) --bogus-flag=3;"),
        # the YAML's bad value was reported before the command line's unknown argument
        ("learning_rate: fast", ["--lr", "1"], "unknown argument(s) --lr 1;"),
        # the YAML's unknown key and the command line's unknown argument: one message, both named
        ("bogus_key: 1", ["--bf16", "true"], "unknown key 'bogus_key'; unknown argument(s) --bf16 true;"),
    ],
)
def test_unknown_arguments_are_reported_first_and_all_at_once(recipe_yaml, yaml_line, argv, expected):
    """Issue 54, item 13: every unknown key and argument, from the YAML and the command line, in one message
    before any value is checked (a type, a range, a missing file), so one edit fixes them all."""
    recipe_yaml.write_text(recipe_yaml.read_text() + yaml_line + "\n")
    with pytest.raises(UsageError) as error:
        _parse(TYPES, ["--config", str(recipe_yaml)] + argv)
    assert expected in str(error.value), str(error.value)
    assert "invalid" not in str(error.value) and "must be" not in str(error.value)


def test_a_bool_option_defaulting_to_true_is_taken_in_each_spelling(recipe_yaml):
    """A bool that defaults to true has two options on one dest (--x and transformers' --no_x): the
    unknown-arguments check took --x for unknown (seen: `--packing false` refused)."""

    @dataclasses.dataclass
    class RecipeArguments:
        packing: bool = True

    for argv, expected in ((["--packing", "false"], False), (["--no_packing"], False), (["--packing"], True)):
        *_, own = _parse((*TYPES, RecipeArguments), ["--config", str(recipe_yaml), *argv])
        assert own.packing is expected, argv


def test_a_recipes_own_options_have_their_declared_ranges_checked(recipe_yaml):
    """A recipe's own dataclass declares a bound in the annotation, as common's do; parsing checks
    it, with no __post_init__ of its own."""
    from typing import Annotated, Optional

    from common.options.ranges import Range

    @dataclasses.dataclass
    class RecipeArguments:
        max_generation_samples: Annotated[Optional[int], Range(low=1, why="unset: all of them")] = None

    *_, own = _parse((*TYPES, RecipeArguments), ["--config", str(recipe_yaml), "--max_generation_samples", "3"])
    assert own.max_generation_samples == 3
    with pytest.raises(
        UsageError, match=re.escape("--max_generation_samples must be >= 1 (unset: all of them), got 0")
    ):
        _parse((*TYPES, RecipeArguments), ["--config", str(recipe_yaml), "--max_generation_samples", "0"])


@pytest.mark.parametrize(
    "recipe, option, value, said",
    [
        ("sft.py", "max_generation_samples", "0", "must be >= 1 (unset: all of them), got 0"),
        (
            "sequence_classification.py",
            "early_stopping_patience",
            "-1",
            "must be >= 1 (unset: never stop early), got -1",
        ),
        (
            "sequence_classification.py",
            "f1_average",
            "bogus",
            "invalid choice: 'bogus' (choose from 'binary', 'macro'",
        ),
    ],
)
def test_the_recipes_own_options_out_of_range_are_one_line(recipe, option, value, said, recipe_yaml, capsys):
    """Before, --early_stopping_patience -1 stopped at the first evaluation, --max_generation_samples 0
    scored no question, and --f1_average bogus was a traceback at the first evaluation."""
    main = load_script(f"recipes/{recipe}").main
    types = tuple(annotation for annotation in main.__annotations__.values() if isinstance(annotation, type))
    with pytest.raises((UsageError, SystemExit)) as refused:
        _parse(types, ["--config", str(recipe_yaml), f"--{option}", value])
    message = str(refused.value) if refused.type is UsageError else capsys.readouterr().err  # argparse's choices
    assert said in message and (refused.type is UsageError or refused.value.code == 2), message


def test_a_file_for_a_model_or_tokenizer_folder(recipe_yaml):
    with pytest.raises(
        UsageError,
        match=r"--tokenizer_name_or_path .*recipe.yaml is a file; pass the folder that "
        r"holds it",
    ):
        _parse(TYPES, ["--config", str(recipe_yaml), "--tokenizer_name_or_path", str(recipe_yaml)])


def test_output_dir_that_is_a_file(recipe_yaml, tmp_path):
    (tmp_path / "taken").write_text("the user's file")
    with pytest.raises(UsageError, match="is a file; pass a folder"):
        _parse(TYPES, ["--config", str(recipe_yaml), "--output_dir", str(tmp_path / "taken")])
    assert (tmp_path / "taken").read_text() == "the user's file"


@pytest.mark.parametrize(
    "content, expected",
    [("not json", "not a readable JSON model config"), ('{"hidden_size": 64}', 'has no "model_type"')],
)
def test_model_config_that_is_not_a_model_config(recipe_yaml, tmp_path, content, expected):
    (tmp_path / "model.json").write_text(content)
    with pytest.raises(UsageError, match=expected):
        _parse(TYPES, ["--config", str(recipe_yaml)])


def test_missing_config_file():
    with pytest.raises(UsageError, match="does not exist"):
        _parse(TYPES, ["--config", "/nonexistent/recipe.yaml"])


def test_parse_args_exits_with_one_line(recipe_yaml, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TYPES, ["--config", str(recipe_yaml), "--nope", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unknown argument")


def test_every_training_field_is_settable_from_yaml(tmp_path, recipe_yaml):
    """Each dataclass field round-trips through the YAML path with its own type."""
    fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    assert {
        "output_dir",
        "max_steps",
        "num_train_epochs",
        "seed",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "learning_rate",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "resume_from_checkpoint",
        "report_to",
        "gradient_checkpointing",
    } <= set(fields)
    recipe_yaml.write_text(recipe_yaml.read_text() + "seed: 3\nnum_train_epochs: 2\nreport_to: none\n")
    _, _, train = _parse(TYPES, ["--config", str(recipe_yaml)])
    assert (train.seed, train.num_train_epochs, train.report_to) == (3, 2, "none")


LORA_TYPES = (*TYPES[:2], LoraArguments, TYPES[2])


def test_use_peft_and_the_lora_options_parse_as_trl_spells_them(recipe_yaml):
    _, _, lora, _ = _parse(
        LORA_TYPES,
        ["--config", str(recipe_yaml), "--use_peft", "--lora_r", "16", "--lora_target_modules", "q_proj", "v_proj"],
    )
    assert lora.use_peft is True and lora.lora_r == 16 and lora.lora_target_modules == ["q_proj", "v_proj"]
    assert _parse(LORA_TYPES, ["--config", str(recipe_yaml)])[2].use_peft is False


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--lora_r", "16"], "--lora_r shape(s) LoRA adapters, which train only with --use_peft; add --use_peft"),
        (["--save_merged_model", "true"], "--save_merged_model shape(s) LoRA adapters"),
        (["--use_peft", "--lora_r", "0"], "--lora_r must be >= 1, got 0"),
        (["--use_peft", "--lora_dropout", "1"], "--lora_dropout must be in [0, 1), got 1.0"),
    ],
)
def test_lora_options_without_use_peft_or_out_of_range_are_refused(recipe_yaml, argv, expected):
    with pytest.raises(UsageError, match=re.escape(expected)):
        _parse(LORA_TYPES, ["--config", str(recipe_yaml), *argv])


def test_a_merged_export_needs_a_pretrained_base():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(UsageError, match="--save_merged_model reloads the base model from --model_name_or_path"):
        apply_lora(model, LoraArguments(use_peft=True, save_merged_model=True))
    from transformers import AutoConfig

    # as common.models.loading.load_model builds from --model_config: transformers names the config file in
    # name_or_path
    built = LlamaForCausalLM(AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_llama.json", vocab_size=32))
    assert built.config.name_or_path.endswith("tiny_llama.json")
    with pytest.raises(UsageError, match="--save_merged_model reloads the base model from --model_name_or_path"):
        apply_lora(built, LoraArguments(use_peft=True, save_merged_model=True))
    wrapped = apply_lora(model, LoraArguments(use_peft=True, lora_target_modules=["all-linear"]))
    assert {n.split(".")[-4] for n, p in wrapped.named_parameters() if p.requires_grad} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


HANDBOOK_SFT = REPO / "tests/data/handbook/zephyr-7b-beta-sft-config_full.yaml"
# what the one message says to write instead of each of the handbook's keys these recipes do not take
HANDBOOK_REPLACED = {
    "model_revision": None,
    "bf16": None,
    "do_eval": None,
    "eval_strategy": None,
    "logging_strategy": None,
    "save_strategy": None,
    "gradient_checkpointing_kwargs": None,
    "hub_model_id": None,
    "hub_strategy": None,
    "push_to_hub": None,
    "log_level": None,
    "remove_unused_columns": None,
    "dataset_num_proc": "preprocessing_num_workers",
    "max_seq_length": "block_size",
}


def handbook_message(recipe: str, config) -> tuple[str, list[str]]:
    """The one message a recipe gives for a handbook YAML as published, and the keys it names."""
    main = load_script(f"recipes/{recipe}").main
    types = tuple(annotation for annotation in main.__annotations__.values() if isinstance(annotation, type))
    with pytest.raises(UsageError) as refused:
        _parse(types, ["--config", str(config)])
    message = str(refused.value)
    named = re.search(r"unknown keys (.*?); run the recipe", message)[1]
    return message, sorted(key.strip("' ") for key in named.split(","))


def rewritten_as_told(config, replaced: dict, tmp_path, **changes):
    """The handbook YAML with each refused key dropped or renamed as the message says, and `changes`."""
    import yaml

    values = yaml.safe_load(config.read_text())
    for key, instead in replaced.items():
        value = values.pop(key)
        if instead:
            values[instead] = value
    values.update(changes)
    path = tmp_path / "config_full.yaml"
    path.write_text(yaml.safe_dump(values))
    return path, values


@pytest.mark.slow  # 2 steps in this process, as the DPO handbook test below
def test_a_handbook_recipe_yaml_names_every_key_it_cannot_take_in_one_message_and_then_runs(
    small_chat_model, counting_data, tmp_path, monkeypatch
):
    """The alignment-handbook's zephyr-7b-beta SFT config as published: one message lists all 14 keys
    taken otherwise here, each with what to write instead (before: one key per run, 16 runs; its
    warmup_ratio and dataset_mixture now work as in the handbook). Rewritten as the message says, with
    the model swapped for a small one with the real chat model's tokenizer and template (the subject is the
    config, not the weights: the real model's 2 steps took a minute on a 2-core CPU), the mixture's source for a
    local file (its held-out 2000 rows for 40 of its 400), flash-attention (GPU only) for sdpa and its torch_dtype bfloat16 kept
    where the CPU has bf16 instructions (float32 elsewhere, where torch emulates bf16 ~50x slower), it trains 2
    steps in this process on 1 rank, warming up over ceil(0.1 x 2) = 1 step."""
    from conftest import run_in_process

    message, named = handbook_message("sft.py", HANDBOOK_SFT)
    assert named == sorted(HANDBOOK_REPLACED)
    for key, instead in HANDBOOK_REPLACED.items():
        assert re.search(rf"--{key}\b[^;]*: ", message.split("keys. ", 1)[1]), key  # each says what to write
    assert (
        "--dataset_num_proc: --preprocessing_num_workers N" in message
        and "--max_seq_length: --block_size N" in message
    )

    rewritten, config = rewritten_as_told(
        HANDBOOK_SFT,
        HANDBOOK_REPLACED,
        tmp_path,
        model_name_or_path=str(small_chat_model),
        attn_implementation="sdpa",
        torch_dtype="bfloat16" if HOST_BF16 else "float32",
        output_dir=str(tmp_path / "run"),
        report_to="none",
    )
    config["dataset_mixture"]["datasets"][0].update(id=str(counting_data / "train.jsonl"), split="train")
    config["dataset_mixture"]["test_split_size"] = 40
    rewritten.write_text(__import__("yaml").safe_dump(config))
    run_in_process(
        "recipes/sft.py",
        [
            "--config",
            rewritten,
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--block_size",
            "128",
            "--max_eval_samples",
            "4",
            "--max_generation_samples",
            "2",
            "--preprocessing_num_workers",
            "0",
            "--logging_steps",
            "1",
        ],
        monkeypatch,
    )
    run = json.loads((tmp_path / "run/run.json").read_text())
    assert run["args"]["warmup_ratio"] == 0.1 and run["args"]["gradient_checkpointing"] is True
    assert run["data_sources"] == [
        {
            "source": str(counting_data / "train.jsonl"),
            "split": "train",
            "hub": False,
            "available": 400,
            "rows": 400,
            "train": 360,
            "held_out": 40,
        }
    ]
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [row["lr"] for row in rows if "lr" in row] == [2e-05, 0.0]  # warmed up by step 1, cosine to 0 at 2


HANDBOOK_DPO = REPO / "tests/data/handbook/zephyr-7b-beta-dpo-config_full.yaml"
HANDBOOK_DPO_REPLACED = {
    "bf16": None,
    "do_eval": None,
    "eval_strategy": None,
    "save_strategy": None,
    "gradient_checkpointing_kwargs": None,
    "hub_model_id": None,
    "push_to_hub": None,
    "log_level": None,
    "dataset_num_proc": "preprocessing_num_workers",
    "max_length": "block_size",
}


@pytest.mark.slow  # two models (the policy and its reference) in this process
@pytest.mark.exhaustive
def test_the_handbook_dpo_recipe_yaml_names_its_keys_in_one_message_and_then_runs(
    small_chat_model, tmp_path, monkeypatch
):
    """The alignment-handbook's zephyr-7b-beta DPO config as published: one message names the 10 keys taken
    otherwise here (max_length: --block_size). Rewritten as it says, with the model swapped for a small one with
    the real chat model's tokenizer and template, and its two UltraFeedback sources (whole chats sharing their
    prompt turns, `chosen` and `rejected` kept) for two local files, it trains 2 steps in this process: beta 0.01,
    warmup_ratio, max_prompt_length, the two sources' counts, a frozen copy of the model as the reference, log 2 at
    step 1."""
    import math

    import yaml
    from conftest import run_in_process

    from common.data.synthetic import preference_examples

    message, named = handbook_message("dpo.py", HANDBOOK_DPO)
    assert named == sorted(HANDBOOK_DPO_REPLACED)
    assert "--max_length: --block_size N" in message and "--dataset_num_proc: --preprocessing_num_workers N" in message

    rewritten, config = rewritten_as_told(
        HANDBOOK_DPO,
        HANDBOOK_DPO_REPLACED,
        tmp_path,
        model_name_or_path=str(small_chat_model),
        output_dir=str(tmp_path / "run"),
        report_to="none",
    )
    for source, split, count, seed in zip(
        config["dataset_mixture"]["datasets"], ("train_prefs", "test_prefs"), (60, 30), (0, 1)
    ):
        path = tmp_path / f"{split}.jsonl"
        path.write_text(
            "".join(
                json.dumps(
                    {
                        "prompt": row["prompt"][0]["content"],
                        "chosen": row["prompt"] + row["chosen"],
                        "rejected": row["prompt"] + row["rejected"],
                    }
                )
                + "\n"
                for row in preference_examples(count, seed)
            )
        )
        source.update(id=str(path), split="train")
    config["dataset_mixture"]["test_split_size"] = 20
    rewritten.write_text(yaml.safe_dump(config))
    run_in_process(
        "recipes/dpo.py",
        [
            "--config",
            rewritten,
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--preprocessing_num_workers",
            "0",
            "--logging_steps",
            "1",
        ],
        monkeypatch,
    )
    run = json.loads((tmp_path / "run/run.json").read_text())
    assert (
        run["args"]["beta"] == 0.01 and run["args"]["max_prompt_length"] == 512 and run["args"]["block_size"] == 1024
    )
    assert run["reference_model"]["kind"] == "model" and run["args"]["gradient_checkpointing"] is True
    assert [(s["rows"], s["train"] + s["held_out"]) for s in run["data_sources"]] == [(60, 60), (30, 30)]
    assert sum(s["held_out"] for s in run["data_sources"]) == 20
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "lr" in row]
    assert [row["lr"] for row in train] == [5e-07, 0.0] and abs(train[0]["loss"] - math.log(2)) < 1e-6


# what a recipe's --help and argument errors wait for no more: 26 s of grpo.py --help, 10 s of sft.py's before this
HEAVY = {"peft", "deepspeed", "trl", "datasets", "evaluate", "pandas", "pyarrow"}


@pytest.mark.slow
def test_help_and_argument_errors_come_before_the_training_libraries_load():
    """`grpo.py --help` took 26 s: what a recipe imports before parsing its arguments (torch, transformers' argument
    parser and auto classes) no longer pulls in peft or DeepSpeed (transformers' scheduler module imported peft),
    datasets or evaluate (imported where data is read and metrics are loaded), nor transformers' modeling code
    (common.data.packing registers sdpa_varlen when a model is prepared), so help and a bad argument answer in about
    5 s here (torch's import is 3 s of it); the seconds are printed."""
    import subprocess
    import sys
    import time

    for argv in (["--help"], ["--no_such_option", "1"]):
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-X", "importtime", str(REPO / "recipes/grpo.py"), *argv],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        seconds = time.perf_counter() - started
        loaded = {
            line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
        }
        print(f"grpo.py {' '.join(argv)}: {seconds:.1f} s")
        assert ("usage:" in result.stdout) if argv == ["--help"] else ("no_such_option" in result.stderr), result
        assert not HEAVY & loaded, sorted(HEAVY & loaded)
    # every recipe's imports (what runs before its arguments are read), in one process
    recipes = sorted(str(path) for path in (REPO / "recipes").glob("*.py"))
    probe = (
        "import importlib.util, sys\n"
        "for path in sys.argv[1:]:\n"
        "    spec = importlib.util.spec_from_file_location(path.rsplit('/', 1)[1][:-3], path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        f"print(sorted(set({sorted(HEAVY)!r}) & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", probe, *recipes], capture_output=True, text=True, cwd=REPO)
    assert len(recipes) >= 6 and result.stdout.strip() == "[]", (result.stdout, result.stderr[-3000:])


@pytest.mark.parametrize("recipe", ["sft", "dpo", "reward_model", "grpo"])
def test_every_field_of_trls_config_works_here_or_is_refused_saying_what_to_write(recipe, recipe_yaml):
    """TRL 1.16.0's SFTConfig, DPOConfig, RewardConfig and GRPOConfig (tests/data/trl_config_fields.json, written by
    benchmarks/peers/trl_fields.py): each field is an option of the recipe under that name, or its refusal carries
    a line saying what to write instead (common.options.trl_keys, common.options.parsing); all of a config's
    unknown keys are named in one message."""
    from common.launch.internals import parser_actions
    from common.options.parsing import ELSEWHERE, _RaisingParser

    listed = json.loads((REPO / "tests/data/trl_config_fields.json").read_text())
    assert listed["trl"] == "1.16.0"  # the version make benchmark-peers installs and docs/rl.md follows
    types = tuple(t for t in load_script(f"recipes/{recipe}.py").main.__annotations__.values() if isinstance(t, type))
    taken = parser_actions(_RaisingParser(types))
    unanswered = [key for key in listed["fields"][recipe] if key not in taken and key not in ELSEWHERE]
    assert not unanswered, unanswered
    refused = [key for key in listed["fields"][recipe] if key not in taken]
    assert refused  # the check reaches the lines
    trl_yaml = recipe_yaml.parent / f"{recipe}_trl.yaml"
    trl_yaml.write_text("".join(f"{key}: 1\n" for key in refused))
    with pytest.raises(UsageError) as error:
        _parse(types, ["--config", str(trl_yaml)])
    said = str(error.value)
    assert "\n" not in said and all(f"--{key}" in said for key in refused), said[:500]
    if recipe == "grpo":
        assert re.search(r"--use_vllm(, --\w+)*: the rollouts are sampled by the recipe's own sampler", said)
        # TRL's older GRPOConfig key, refused with what a prompt may take here
        with pytest.raises(UsageError, match=r"--max_prompt_length: grpo.py: a prompt keeps --block_size less "):
            _parse(types, ["--max_prompt_length", "512"])
