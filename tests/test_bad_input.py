"""Bad input found after the process group starts, launched as users launch (2 processes
under ddp.yaml): one `error:` line that names what is wrong, a non-zero exit, no traceback
from the recipes or `common`, and nothing of an earlier run changed. (Bad arguments, found
before start-up, are tested in-process in test_arguments.py; input a library refuses at
start-up, through a recipe's run_recipe in this process, `error_in_process`.)"""

import json
import re
import shutil

import pytest
from conftest import REPO, causal_lm_args, flags, launch, pretrained_args, read_run


GOOD = '{"text": "a b c d e f g h"}\n' * 40


def launch_bad(args: list, recipe: str = "causal_lm.py") -> str:
    """The one error line of a 2-process run that must fail."""
    result = launch("ddp.yaml", recipe, args, check=False, real=True)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, output[-4000:]
    # torchrun reports the failed child with its own launcher traceback; none comes from our code.
    assert not re.search(r'File "[^"]*/(recipes|common)/', output), output[-4000:]
    print(errors[0])
    return errors[0]


def data_files(tmp_path, train: str, validation: str = GOOD) -> dict:
    (tmp_path / "train.jsonl").write_text(train)
    (tmp_path / "validation.jsonl").write_text(validation)
    return {"train_file": tmp_path / "train.jsonl", "validation_file": tmp_path / "validation.jsonl"}


@pytest.fixture(scope="module")
def earlier_run(markov_data, tmp_path_factory):
    """A finished 2-process run with a checkpoint: the one the failed resumes must leave as it was."""
    out = tmp_path_factory.mktemp("earlier") / "run"
    launch("ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, out, max_steps=2, save_steps=2))
    return out


def snapshot(out) -> dict:
    return {name: (out / name).read_bytes() for name in ("run.json", "metrics.jsonl")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "train, validation, expected",
    [
        # The other bad files (empty, null or number text, mismatched columns) are checked in-process
        # in test_data.py: the same code path, which this launch proves ends in one line.
        (GOOD + '{"text": "a b\n', GOOD, r"train.jsonl: not readable as json \(ArrowInvalid: JSON parse error"),
    ],
)
def test_bad_data_is_one_line(markov_data, tmp_path, train, validation, expected):
    files = data_files(tmp_path, train, validation)
    error = launch_bad(causal_lm_args(markov_data, tmp_path / "run", **files))
    assert re.search(expected, error), error


@pytest.mark.slow
def test_model_config_that_builds_no_model_overwrites_nothing(earlier_run, markov_data, tmp_path, capsys):
    """Met while loading, on every rank alike: run in this process (a launched load error's one line is
    test_resume_with_another_model_config_changes_nothing's)."""
    out = tmp_path / "run"
    shutil.copytree(earlier_run, out)
    before = snapshot(out)
    config = json.loads((REPO / "recipes/configs/tiny_llama.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps({**config, "hidden_size": 30, "num_attention_heads": 4}))
    argv = causal_lm_args(markov_data, out, model_config=tmp_path / "bad.json") + ["--overwrite_output_dir"]
    error = error_in_process("causal_lm.py", argv, capsys)
    assert "bad.json does not build a model" in error and "not a multiple of the number of attention heads" in error
    # --overwrite_output_dir clears the earlier run only once the new one is known to start.
    assert snapshot(out) == before and (out / "final").is_dir() and (out / "checkpoints" / "step_2").is_dir()


def test_folders_without_a_model_or_a_tokenizer(markov_data, tmp_path):
    """Raised while loading, on every rank alike: checked in-process (the launches above prove
    that such an error reaches the user as one line)."""
    from common.launch.errors import UsageError
    from common.models.loading import load_model, load_tokenizer
    from common.options.arguments import ModelArguments

    (tmp_path / "empty").mkdir()
    config = str(REPO / "recipes/configs/tiny_llama.json")
    tokenizer = load_tokenizer(
        ModelArguments(model_config=config, tokenizer_name_or_path=str(markov_data / "tokenizer"))
    )
    with pytest.raises(UsageError, match=r"no CausalLM model loads from .*empty"):
        load_model(
            ModelArguments(
                model_name_or_path=str(tmp_path / "empty"), tokenizer_name_or_path=str(markov_data / "tokenizer")
            ),
            tokenizer,
            seed=0,
        )
    with pytest.raises(UsageError, match=r"no tokenizer loads from .*empty"):
        load_tokenizer(ModelArguments(model_config=config, tokenizer_name_or_path=str(tmp_path / "empty")))


def test_a_hub_model_with_downloads_off_says_how_to_turn_them_on(monkeypatch):
    """A Hub name that is not in the cache while HF_HUB_OFFLINE is set (make sets it for the demos
    and tests): the first read of the model, the run's export dtype in start_run, is one line."""
    import huggingface_hub

    from common.launch.errors import UsageError
    from common.models.loading import export_dtype, load_tokenizer
    from common.options.arguments import ModelArguments

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read by the Hub client at import
    args = ModelArguments(model_name_or_path="no-such-org/no-such-model-7b")
    hint = r"HF_HUB_OFFLINE is set here, so only what the Hub cache already holds loads: set HF_HUB_OFFLINE=0"
    with pytest.raises(UsageError, match=r"no model config loads from no-such-org/no-such-model-7b .*" + hint):
        export_dtype(args)
    with pytest.raises(UsageError, match=r"no tokenizer loads from no-such-org/no-such-model-7b .*" + hint):
        load_tokenizer(args)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_hub_dataset_that_does_not_load_is_one_line(monkeypatch, streaming):
    import datasets
    import huggingface_hub

    from common.data.loading import load_raw_datasets
    from common.launch.errors import UsageError
    from common.options.arguments import DataArguments

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read by the Hub client at import
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    args = DataArguments(dataset_name="no-such-org/no-such-corpus", dataset_config_name="en", streaming=streaming)
    with pytest.raises(
        UsageError,
        match=r"--dataset_name no-such-org/no-such-corpus --dataset_config_name en does "
        r"not load \(.*\); pass a Hub dataset .* or --train_file; HF_DATASETS_OFFLINE "
        r"and HF_HUB_OFFLINE are set here",
    ):
        load_raw_datasets(args, seed=0)


def sft_data_in_no_known_format(arithmetic_data, tmp_path) -> list:
    files = data_files(tmp_path, '{"question": "q", "answer": "a"}\n' * 8, '{"question": "q", "answer": "a"}\n' * 2)
    return flags(
        config=REPO / "recipes/configs/sft_demo.yaml",
        tokenizer_name_or_path=arithmetic_data / "tokenizer",
        output_dir=tmp_path / "run",
        max_steps=2,
        **files,
    )


SFT_FORMAT = 'needs a \'messages\' column (conversations) or "prompt" and "completion" columns'


@pytest.mark.slow
@pytest.mark.exhaustive
def test_sft_data_in_no_known_format(arithmetic_data, tmp_path):
    """Launched: a data error every rank meets after the start, the path test_bad_data_is_one_line's launch proves
    in make test; make test checks this one's line in this process (below)."""
    error = launch_bad(sft_data_in_no_known_format(arithmetic_data, tmp_path), recipe="sft.py")
    assert SFT_FORMAT in error


def test_sft_data_in_no_known_format_is_one_line(arithmetic_data, tmp_path, capsys):
    """sft.py's command line in this process (error_in_process): the same line, exit 2, no traceback, nothing
    written."""
    error = error_in_process("sft.py", sft_data_in_no_known_format(arithmetic_data, tmp_path), capsys)
    assert SFT_FORMAT in error and not (tmp_path / "run" / "run.json").exists()


@pytest.mark.slow
def test_resume_with_another_model_config_changes_nothing(earlier_run, markov_data, tmp_path):
    config = json.loads((REPO / "recipes/configs/tiny_llama.json").read_text())
    (tmp_path / "wider.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    before = snapshot(earlier_run)
    error = launch_bad(
        causal_lm_args(
            markov_data,
            earlier_run,
            model_config=tmp_path / "wider.json",
            max_steps=4,
            resume_from_checkpoint="latest",
        )
    )
    assert re.search(
        r"checkpoint .*step_2 does not load into this run .*resume with the arguments in its run's "
        r"run.json",
        error,
    ), error
    assert snapshot(earlier_run) == before and read_run(earlier_run)["args"]["max_steps"] == 2


@pytest.mark.slow
@pytest.mark.exhaustive
def test_corrupt_checkpoint_changes_nothing(earlier_run, markov_data, tmp_path):
    """Launched: a resume every rank refuses while it loads the checkpoint, the path
    test_resume_with_another_model_config_changes_nothing's launch proves in make test; make test checks this
    one's line in this process (test_a_corrupt_checkpoint_is_one_line_and_changes_nothing)."""
    out = tmp_path / "run"
    shutil.copytree(earlier_run, out)
    weights = next((out / "checkpoints" / "step_2").glob("model*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # a save cut short
    before = snapshot(out)
    error = launch_bad(causal_lm_args(markov_data, out, max_steps=4, resume_from_checkpoint="latest"))
    assert re.search(r"checkpoint .*step_2 is damaged \(\w+.*resume from an earlier one", error), error
    assert snapshot(out) == before


def test_a_corrupt_checkpoint_is_one_line_and_changes_nothing(markov_data, tmp_path, monkeypatch, capsys):
    """The damaged checkpoint's line in this process: a one-process run (single.yaml's bf16, as
    conftest.launch_one_process runs it) whose step-2 weights are cut short, resumed by causal_lm.py's command
    line (error_in_process): the same line, exit 2, the run's files as they were."""
    from conftest import launch_one_process

    out = tmp_path / "run"
    launch_one_process("causal_lm.py", causal_lm_args(markov_data, out, max_steps=2, save_steps=2))
    weights = next((out / "checkpoints" / "step_2").glob("model*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # a save cut short
    before = snapshot(out)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # as the run was
    resume = causal_lm_args(markov_data, out, max_steps=4, resume_from_checkpoint="latest")
    error = error_in_process("causal_lm.py", resume, capsys)
    print(error)
    assert re.search(r"checkpoint .*step_2 is damaged \(\w+.*resume from an earlier one", error), error
    assert snapshot(out) == before


@pytest.mark.slow
def test_an_error_only_rank_1_meets_is_one_line_naming_the_rank_and_every_rank_exits(markov_data, tmp_path):
    """A copy of a recipe (as a user writes one) whose rank 1 alone meets bad input, while rank 0
    waits for it in a collective: the user sees one line from rank 1, and the launch ends."""
    import time

    recipe = tmp_path / "my_recipe.py"
    recipe.write_text(
        "from common.options.arguments import DataArguments, ModelArguments, TrainingArguments\n"
        "from common.launch.errors import UsageError\n"
        "from common.run import run_recipe, start_run\n\n\n"
        "def main(model_args, data_args, args):\n"
        "    run = start_run(model_args, data_args, args)\n"
        "    if run.accelerator.process_index == 1:\n"
        "        raise UsageError('the shard for this rank does not load: check its files')\n"
        "    run.accelerator.wait_for_everyone()  # rank 0 waits for rank 1\n\n\n"
        "run_recipe(main, ModelArguments, DataArguments, TrainingArguments)\n"
    )
    started = time.monotonic()
    error = launch_bad(causal_lm_args(markov_data, tmp_path / "out"), recipe=recipe)
    assert error == "error: rank 1: the shard for this rank does not load: check its files"
    assert time.monotonic() - started < 120  # not the collective timeout (1800 s)


def test_block_size_past_the_models_positions(bf16_checkpoint, markov_data, tmp_path):
    """A learned position table (GPT-2's n_positions) refuses a longer --block_size in one line (it
    was an IndexError mid-step); a pretrained rotary model runs past its max_position_embeddings
    with a warning; a rotary model built from a config trains at any length."""
    from common.launch.errors import UsageError
    from common.models.loading import check_block_size
    from common.options.arguments import ModelArguments

    (tmp_path / "gpt2.json").write_text(
        json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64})
    )
    tokenizer = str(markov_data / "tokenizer")
    gpt2 = ModelArguments(model_config=str(tmp_path / "gpt2.json"), tokenizer_name_or_path=tokenizer)
    with pytest.raises(
        UsageError,
        match=r"--block_size 128 is longer than the 64 positions .* learned table; "
        r"pass --block_size 64 or less",
    ):
        check_block_size(gpt2, 128)
    assert check_block_size(gpt2, 64) is None
    limit = json.loads((bf16_checkpoint / "config.json").read_text())["max_position_embeddings"]
    pretrained = ModelArguments(model_name_or_path=str(bf16_checkpoint))
    assert "a rotary model runs there" in check_block_size(pretrained, limit + 1)
    assert check_block_size(pretrained, limit) is None
    scratch = ModelArguments(
        model_config=str(REPO / "recipes/configs/tiny_llama.json"), tokenizer_name_or_path=tokenizer
    )
    assert check_block_size(scratch, limit + 1) is None


def error_in_process(recipe: str, argv: list, capsys) -> str:
    """A recipe's command line run in this process as `python recipes/<recipe>` runs it (run_recipe:
    parse, main, exit), for bad input met at start-up: its one error line (exit status 2), no traceback."""
    import importlib.util

    from accelerate.state import AcceleratorState

    spec = importlib.util.spec_from_file_location(f"recipe_{recipe[:-3]}", REPO / "recipes" / recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines main; runs nothing (__name__ is not "__main__")
    from common.models.lora import LoraArguments
    from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
    from common.run import run_recipe

    own = [
        getattr(module, name) for name in ("SFTArguments", "DPOArguments") if hasattr(module, name)
    ]  # as its last line
    types = [ModelArguments, DataArguments, *own, LoraArguments, TrainingArguments]
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_info:
            run_recipe(module.main, *types, argv=[str(a) for a in argv])
    finally:
        AcceleratorState._reset_state(True)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


@pytest.mark.parametrize("case", ["negative_seed", "weights_cut_short", "template_not_jinja"])
def test_start_up_input_a_library_refuses_is_one_line(
    case, markov_data, bf16_checkpoint, arithmetic_data, tmp_path, capsys
):
    """Issue 34, item 8: a value a library range-checks (numpy's seed), a model folder whose weights
    file is cut short, and a --chat_template that is not Jinja each end in one line before any
    process trains, with nothing written to output_dir (they were tracebacks: from set_seed, from
    safetensors inside from_pretrained, from jinja2 inside the tokenizing map)."""
    out = tmp_path / "run"
    if case == "negative_seed":
        error = error_in_process("causal_lm.py", causal_lm_args(markov_data, out, seed=-1), capsys)
        assert error == "error: --seed must be in [0, 4294967295] (numpy's seeds are 32-bit), got -1"
    elif case == "weights_cut_short":
        model = tmp_path / "model"
        shutil.copytree(bf16_checkpoint, model)
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
        error = error_in_process("causal_lm.py", pretrained_args(markov_data, model, out), capsys)
        assert error == (
            f"error: CausalLM model folder {model} is damaged (SafetensorError: Error while "
            "deserializing header: incomplete metadata, file not fully covered): a file in it is cut "
            "short or corrupt; copy or save it again"
        )
    else:
        template = tmp_path / "template.jinja"
        template.write_text("{% for message in messages %}\n{{ message.content }\n{% endfor %}")
        error = error_in_process(
            "sft.py",
            flags(
                config=REPO / "recipes/configs/sft_demo.yaml",
                output_dir=out,
                tokenizer_name_or_path=arithmetic_data / "tokenizer",
                train_file=arithmetic_data / "train.jsonl",
                validation_file=arithmetic_data / "validation.jsonl",
                chat_template=template,
            ),
            capsys,
        )
        assert error == (
            f"error: --chat_template {template} is not a valid Jinja template (TemplateSyntaxError "
            "at line 2: unexpected '}'); fix the template"
        )
    assert not out.exists()


def test_damaged_model_tokenizer_and_adapter_folders(bf16_checkpoint, tmp_path):
    """What the libraries raise for a damaged folder (a shard its index names missing, weights that
    do not fit the config, a tokenizer.json cut short, an adapter's weights cut short) is one line
    naming the folder (it was a traceback, or for the tokenizer a KeyError's)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from common.launch.errors import UsageError
    from common.models.loading import load_model, load_tokenizer
    from common.options.arguments import ModelArguments

    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(bf16_checkpoint)))
    base = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    base.save_pretrained(sharded, max_shard_size="100KB")
    max(sharded.glob("model-*.safetensors")).unlink()
    with pytest.raises(
        UsageError,
        match=r"CausalLM model folder .*sharded is damaged \(FileNotFoundError: .*model-0"
        r".*\): a file in it is missing; copy or save it again",
    ):
        load_model(ModelArguments(model_name_or_path=str(sharded)), tokenizer, seed=0)

    wider = tmp_path / "wider"
    shutil.copytree(bf16_checkpoint, wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    with pytest.raises(UsageError, match=r"the weights in .*wider do not fit the CausalLM model its config describes"):
        load_model(ModelArguments(model_name_or_path=str(wider)), tokenizer, seed=0)

    (wider / "tokenizer.json").write_text((wider / "tokenizer.json").read_text()[:200])
    with pytest.raises(
        UsageError,
        match=r"tokenizer folder .*wider is damaged \(JSONDecodeError: .*\): a file in it "
        r"is cut short or corrupt",
    ):
        load_tokenizer(ModelArguments(model_name_or_path=str(wider)))

    adapter = tmp_path / "adapter"
    get_peft_model(base, LoraConfig(r=2, task_type="CAUSAL_LM")).save_pretrained(adapter)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(
        UsageError,
        match=r"PEFT adapter folder .*adapter is damaged \(SafetensorError: .*\): a file "
        r"in it is cut short or corrupt",
    ):
        load_model(
            ModelArguments(model_name_or_path=str(bf16_checkpoint), adapter_name_or_path=str(adapter)),
            tokenizer,
            seed=0,
        )


def test_a_chat_template_that_raises_on_the_data_is_one_line(arithmetic_data):
    """A valid template that refuses a conversation as it renders (Gemma's raise_exception for a
    system turn) is one line showing the conversation, not jinja2's traceback from inside the map."""
    from transformers import AutoTokenizer

    from common.data.chat import assistant_spans
    from common.launch.errors import UsageError

    tokenizer = AutoTokenizer.from_pretrained(arithmetic_data / "tokenizer")
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
        "supported') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 1 plus 1 ?"},
        {"role": "assistant", "content": "2"},
    ]
    with pytest.raises(
        UsageError,
        match=r"the chat template \(--chat_template, or the tokenizer's\) does not render a "
        r"conversation \(TemplateError: System role not supported\): fix the template "
        r"or the data; the conversation: \[\{'role': 'system'",
    ):
        assistant_spans(tokenizer, messages)


def test_a_parquet_file_cut_short_is_one_line(tmp_path):
    """pyarrow reads a parquet file's schema before datasets generates a row: a file cut short failed
    there, outside the errors datasets wraps (ArrowInvalid's traceback)."""
    from datasets import Dataset

    from common.data.loading import load_raw_datasets
    from common.launch.errors import UsageError
    from common.options.arguments import DataArguments

    Dataset.from_dict({"text": ["a b c d"] * 50}).to_parquet(tmp_path / "train.parquet")
    Dataset.from_dict({"text": ["a b c d"] * 5}).to_parquet(tmp_path / "validation.parquet")
    train = tmp_path / "train.parquet"
    train.write_bytes(train.read_bytes()[: train.stat().st_size // 2])
    args = DataArguments(train_file=str(train), validation_file=str(tmp_path / "validation.parquet"))
    with pytest.raises(
        UsageError, match=r"train.parquet: not readable as parquet \(ArrowInvalid: Parquet magic bytes"
    ):
        load_raw_datasets(args, seed=0)


def test_a_classifier_on_one_class_stops_before_its_output_folder_changes(minilm, tmp_path, monkeypatch):
    """Issue 54, item 8: sequence_classification.py on data with a single class trained without a word and
    reported perfect accuracy. It now stops at its data, in one line, with an earlier run in --output_dir (which
    --overwrite_output_dir would clear once training starts) as it was."""
    from conftest import run_in_process

    from common.launch.errors import UsageError

    rows = "".join(json.dumps({"text": f"a fine day number {i}", "label": "positive"}) + "\n" for i in range(40))
    (tmp_path / "train.jsonl").write_text(rows)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text('{"earlier": true}')
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(out)
    args = flags(
        config=REPO / "recipes/configs/sequence_classification_demo.yaml",
        model_name_or_path=minilm,
        train_file=tmp_path / "train.jsonl",
        validation_file=tmp_path / "train.jsonl",
        output_dir=out,
        overwrite_output_dir=True,
    )
    with pytest.raises(UsageError) as refused:
        run_in_process("recipes/sequence_classification.py", args, monkeypatch)
    assert str(refused.value) == (
        "the train data has one class (label 'positive') in column 'label': a classifier learns nothing from it, "
        "and scores every row of that class right; give rows of at least two classes, or set --label_column"
    )
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "run.json"]
