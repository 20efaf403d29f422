import dataclasses

import pytest

from common.arguments import (DataArguments, ModelArguments, TrainingArguments, UsageError, _parse,
                              parse_args)

TYPES = (ModelArguments, DataArguments, TrainingArguments)


@pytest.fixture
def recipe_yaml(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a b"}\n')
    config = tmp_path / "recipe.yaml"
    config.write_text(f"model_config: {config}\ntokenizer_name_or_path: tok\ntrain_file: {data}\n"
                      "learning_rate: 0.01\nmax_steps: 7\ngradient_checkpointing: true\n")
    return config


def test_yaml_values_then_command_line_overrides(recipe_yaml):
    model, data, train = _parse(TYPES, ["--config", str(recipe_yaml), "--learning_rate", "0.5"])
    assert train.learning_rate == 0.5          # command line wins
    assert train.max_steps == 7                # from the YAML
    assert train.gradient_checkpointing is True
    assert train.per_device_train_batch_size == 8  # dataclass default
    assert model.tokenizer_name_or_path == "tok"


def test_equals_form_and_bool_override(recipe_yaml):
    _, _, train = _parse(TYPES, [f"--config={recipe_yaml}", "--gradient_checkpointing", "false"])
    assert train.gradient_checkpointing is False


@pytest.mark.parametrize("line, expected", [
    ("bogus_key: 1", "unknown key 'bogus_key'"),
    ("learning_rate: fast", "invalid float value: 'fast'"),
    ("max_steps: 1.5", "invalid int value: '1.5'"),
])
def test_bad_yaml_names_the_key_and_file(recipe_yaml, line, expected):
    recipe_yaml.write_text(recipe_yaml.read_text() + line + "\n")
    with pytest.raises(UsageError, match=expected) as error:
        _parse(TYPES, ["--config", str(recipe_yaml)])
    assert str(recipe_yaml) in str(error.value)


@pytest.mark.parametrize("argv, expected", [
    (["--no_such_flag", "1"], "unknown argument"),
    (["--per_device_train_batch_size", "many"], "invalid int value"),
    (["--per_device_train_batch_size", "0"], "must be at least 1"),
    (["--report_to", "mlflow"], "report_to"),
    (["--train_file", "/nonexistent/x.jsonl"], "does not exist"),
])
def test_bad_command_line(recipe_yaml, argv, expected):
    with pytest.raises(UsageError, match=expected):
        _parse(TYPES, ["--config", str(recipe_yaml)] + argv)


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
    assert {"output_dir", "max_steps", "num_train_epochs", "seed", "per_device_train_batch_size",
            "gradient_accumulation_steps", "learning_rate", "logging_steps", "eval_steps", "save_steps",
            "resume_from_checkpoint", "report_to", "gradient_checkpointing"} <= set(fields)
    recipe_yaml.write_text(recipe_yaml.read_text() + "seed: 3\nnum_train_epochs: 2\nreport_to: none\n")
    _, _, train = _parse(TYPES, ["--config", str(recipe_yaml)])
    assert (train.seed, train.num_train_epochs, train.report_to) == (3, 2, "none")
