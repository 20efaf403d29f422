"""The reward model (recipes/reward_model.py): its loss and metrics against their formulas, the reward read at each
row's last token where the pad token is EOS, margins carried from the data, bad input in one line, the LoRA export
(score head in the adapter, the merged folder scoring alike), and `make reward-model` under ZeRO-3 in bf16 with
accumulation 2 on 2 processes: held-out pair accuracy from chance to >= 0.9, and final/ loaded as a sequence
classifier ranking the held-out pairs as the run's evaluation did."""

import json
import math
import shlex

import pytest
import torch
from conftest import FP32, HOST_PRECISION, REPO, flags, launch, read_metrics, read_run, run, run_in_process
from datasets import Dataset, DatasetDict

from common.launch.errors import UsageError
from common.objectives.reward_model import (
    RewardBatches,
    attach_margins,
    load_reward_model,
    reward_loss,
    row_rewards,
    score,
)


METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


@pytest.mark.parametrize("with_margin,center", [(False, 0.0), (True, 0.0), (True, 0.01), (False, 0.5)])
def test_the_loss_and_metrics_are_their_formulas(with_margin, center):
    generator = torch.Generator().manual_seed(0)
    chosen, rejected = (torch.randn(7, generator=generator, dtype=torch.float64) * 3 for _ in range(2))
    margin = torch.rand(7, generator=generator, dtype=torch.float64) * 2 if with_margin else None
    losses, metrics = reward_loss(chosen, rejected, margin, center)
    c, r = chosen.tolist(), rejected.tolist()
    m = margin.tolist() if with_margin else [0.0] * 7
    expected = [-logsigmoid(c[i] - r[i] - m[i]) for i in range(7)]
    # TRL: -logsigmoid(...).mean() + center * mean((r_c + r_r)^2): the mean of the per-pair losses
    trl = sum(expected) / 7 + center * sum((c[i] + r[i]) ** 2 for i in range(7)) / 7
    assert float(losses.mean()) == pytest.approx(trl, rel=1e-12)
    for i in range(7):
        assert float(losses[i]) == pytest.approx(expected[i] + center * (c[i] + r[i]) ** 2, rel=1e-12)
    rewards = c + r
    assert metrics["accuracy"].tolist() == [float(c[i] > r[i]) for i in range(7)]
    assert metrics["margin"].tolist() == pytest.approx([c[i] - r[i] for i in range(7)], rel=1e-12)
    assert float(metrics["mean_reward"].mean()) == pytest.approx(sum(rewards) / 14, rel=1e-12)
    assert metrics["min_reward"].tolist() == [min(rewards)] and metrics["max_reward"].tolist() == [max(rewards)]


def test_the_reward_is_the_score_at_the_last_token_even_where_pad_is_eos():
    """Rows that end with EOS, where EOS is also the pad token (as Llama's and SmolLM2's tokenizers are loaded):
    transformers' own pooling takes the last token that is not pad_token_id, the one before the EOS; the reward is
    the score at the last token of the attention mask, the same as each row scored alone, whatever the padding."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    eos = 2
    config = AutoConfig.from_pretrained(
        REPO / "recipes/configs/tiny_llama_reward.json",
        vocab_size=16,
        num_labels=1,
        pad_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    rows = [[1, 5, 6, 7, eos], [1, 8, eos], [1, 9, 10, 11, 12, 13]]  # the last ends without EOS
    batch = RewardBatches(pad_token_id=eos)(
        [
            {"chosen_input_ids": a, "chosen_labels": a, "rejected_input_ids": b, "rejected_labels": b, "index": 0}
            for a, b in [(rows[0], rows[1]), (rows[2], rows[0])]
        ]
    )
    with torch.no_grad():
        rewards = row_rewards(model, batch["input_ids"], batch["attention_mask"])
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        every = model.score(hidden)[..., 0]
        last = batch["attention_mask"].sum(1) - 1  # right-padded
        by_hand = every[torch.arange(4), last]
        alone = torch.cat(
            [model(input_ids=torch.tensor([row])).logits[:, 0] for row in [rows[0], rows[2], rows[1], rows[0]]]
        )
        pooled = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        alone_ours = torch.cat(
            [row_rewards(model, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long)) for row in rows]
        )
    assert torch.equal(rewards, by_hand.float())
    assert torch.allclose(rewards[[0, 2, 1]], alone_ours, atol=1e-6)
    assert batch["labels"].tolist() == [1, 1, 0, 0]
    # transformers' pooling reads the EOS rows one token early (alone or padded); the row without EOS alike
    assert not torch.isclose(pooled[0], rewards[0]) and not torch.isclose(alone[0], rewards[0])
    assert torch.isclose(pooled[1], rewards[1]) and torch.isclose(pooled[0], every[0, 3])


def test_margins_come_from_the_data_by_pair_and_bad_ones_stop_in_one_line():
    raw = DatasetDict(
        train=Dataset.from_dict({"margin": [0.5, 2, 1.5]}), validation=Dataset.from_dict({"other": [1, 2]})
    )
    tokenized = DatasetDict(
        train=Dataset.from_dict({"index": [2, 0]}), validation=Dataset.from_dict({"index": [0, 1]})
    )  # row 1 dropped (too long), the rest in order
    assert attach_margins(raw, tokenized)
    assert tokenized["train"]["margin"] == [1.5, 0.5] and "margin" not in tokenized["validation"].column_names
    as_text = DatasetDict(train=Dataset.from_dict({"index": [1, 0]}))  # a CSV column with text in it: all text
    attach_margins(DatasetDict(train=Dataset.from_dict({"margin": ["0.25", "1e-1"]})), as_text)
    assert as_text["train"]["margin"] == [0.1, 0.25]
    rows = [
        {
            "chosen_input_ids": [1, 2],
            "chosen_labels": [1, 2],
            "rejected_input_ids": [1],
            "rejected_labels": [1],
            "index": i,
            "margin": m,
        }
        for i, m in enumerate([1.5, 0.5])
    ]
    assert RewardBatches(0)(rows)["margin"].tolist() == [1.5, 0.5]
    assert "margin" not in RewardBatches(0)([{k: v for k, v in rows[0].items() if k != "margin"}])
    for values, shown in [
        (["1", "a lot"], "'a lot'"),
        ([1.0, None], "'None'"),
        ([1.0, float("nan")], "'nan'"),
        ([1.0, float("inf")], "'inf'"),
        ([False, True], "'True'"),
    ]:
        raw = DatasetDict(train=Dataset.from_dict({"margin": values}))
        if values[0] is False:
            shown, values = "'False'", None  # every value of a column of booleans: the first named
        with pytest.raises(UsageError, match=rf"^row {0 if values is None else 1} of the train data: margin {shown} "):
            attach_margins(raw, DatasetDict(train=Dataset.from_dict({"index": [0, 1]})))


def _loop(recipe: str) -> list[str]:
    lines = (REPO / "recipes" / recipe).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("batches = TrainBatches("))
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "metrics.advance()")
    return [line.strip() for line in lines[start : end + 1]]


def test_the_loop_is_causal_lms_loop_with_its_own_loss():
    """The pairs' rewards, their loss and metrics in place of the model's own loss; the rest of the step
    (accumulation, clipping, the guard, the step, logging) is causal_lm.py's, line for line."""
    own = {
        "chosen, rejected = pair_rewards(model, batch)  # one forward scores both sides",
        'losses, values = reward_loss(chosen, rejected, batch.get("margin"), center)',
        "loss = losses.mean()  # pairs per micro-batch are equal on every rank: the global batch's mean",
        "metrics.record_values(values)",
    }
    pairs = "metrics.record_batch(loss, batch, examples=len(losses))  # its examples are pairs (two rows each)"
    mine = [line if line != pairs else "metrics.record_batch(loss, batch)" for line in _loop("reward_model.py")]
    assert [line for line in mine if line not in own] == [
        line for line in _loop("causal_lm.py") if line != "loss = model(**batch).loss"
    ]


# --- runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The demo's kind of pairs, few of them, each with a margin (0 to 1)."""
    from common.data.synthetic import write_preference_data

    out = tmp_path_factory.mktemp("reward_pairs")
    write_preference_data(str(out), train=96, validation=24)
    for split in ("train", "validation"):
        path = out / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**row, "margin": (i % 5) / 4}) + "\n" for i, row in enumerate(rows)))
    return out


def reward_args(data, out, **overrides) -> list[str]:
    values = {
        "config": REPO / "recipes/configs/reward_model_demo.yaml",
        "tokenizer_name_or_path": data / "tokenizer",
        "train_file": data / "train.jsonl",
        "validation_file": data / "validation.jsonl",
        "output_dir": out,
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "per_device_eval_batch_size": 8,
        "logging_steps": 1,
        "warmup_steps": 2,
        "eval_on_start": False,
        **overrides,
    }
    return flags(**values)


def refused(argv, capsys) -> str:
    """The recipe's command line run in this process as `python recipes/reward_model.py` runs it: its one error
    line (exit status 2), no traceback."""
    from accelerate.state import AcceleratorState
    from conftest import load_script

    from common.models.lora import LoraArguments
    from common.options.arguments import DataArguments, ModelArguments, TrainingArguments
    from common.run import run_recipe

    module = load_script("recipes/reward_model.py")
    types = [ModelArguments, DataArguments, module.RewardArguments, LoraArguments, TrainingArguments]
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


def test_a_margin_that_is_not_a_number_and_a_classifier_with_two_outputs_stop_in_one_line(pairs, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in (pairs / "train.jsonl").read_text().splitlines()][:8]
    rows[5]["margin"] = "high"
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = refused(reward_args(pairs, tmp_path / "run", train_file=bad), capsys)
    assert line.startswith("error: row 5 of the train data: margin 'high' is not a number"), line
    assert not (tmp_path / "run" / "run.json").exists()

    classifier = tmp_path / "two_labels"
    config = AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_llama_reward.json", vocab_size=64, num_labels=2)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(pairs / "tokenizer").save_pretrained(classifier)
    argv = reward_args(pairs, tmp_path / "run2", model_config="", model_name_or_path=classifier)
    line = refused(argv, capsys)
    assert line.startswith(f"error: --model_name_or_path {classifier} is a sequence classifier with 2 outputs"), line
    assert not (tmp_path / "run2").exists()


def test_lora_exports_the_score_head_with_the_adapter_and_the_merged_model_scores_alike(pairs, tmp_path, monkeypatch):
    """--use_peft on a pretrained base (a causal LM: its new score head trains beside the adapters): final/ is the
    adapter with the head in it (peft's modules_to_save), final_merged/ a plain sequence classifier with one output,
    and both load as reward models giving the same scores."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    base = tmp_path / "base"
    tokenizer = AutoTokenizer.from_pretrained(pairs / "tokenizer")
    config = AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_llama.json", vocab_size=len(tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "run"
    argv = reward_args(pairs, out, model_config="", model_name_or_path=base, max_steps=2, learning_rate=0.01)
    run_in_process(
        "recipes/reward_model.py", [*argv, "--use_peft", "true", "--save_merged_model", "true"], monkeypatch
    )
    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    head = [key for key in adapter if ".score." in key]
    assert head and any("lora_" in key for key in adapter), sorted(adapter)
    merged = AutoModelForSequenceClassification.from_pretrained(out / "final_merged")
    assert merged.config.num_labels == 1 and merged.score.weight.shape == (1, 64)
    assert torch.equal(merged.score.weight, next(adapter[key] for key in head).float())  # the trained head
    rows = [json.loads(line) for line in (pairs / "validation.jsonl").read_text().splitlines()]
    prompts, answers = [row["prompt"] for row in rows], [row["chosen"] for row in rows]
    from_adapter = score(*load_reward_model(str(out / "final")), prompts, answers)
    from_merged = score(*load_reward_model(str(out / "final_merged")), prompts, answers)
    assert from_adapter.shape == (len(rows),) and torch.allclose(from_adapter, from_merged, atol=1e-5)


@pytest.mark.slow
def test_make_reward_model_under_zero3_learns_to_rank_the_pairs_and_its_export_scores_them(tmp_path):
    """`make reward-model CONFIG=accelerate_configs/zero3.yaml`: 2 processes, bf16, the demo's global batch of 64
    pairs as 16 x accumulation 2 per process. The held-out pair accuracy goes from chance to >= 0.9, every train
    line carries TRL's metrics, the evaluation counts the 200 held-out pairs once (2 x 32 per batch pads the last),
    and final/ loads with AutoModelForSequenceClassification: its rewards rank the held-out pairs as the run's
    evaluation did, and its min and max are the evaluation's."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    args = ["--output_dir", str(out), "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "2"]
    result = run(["make", "reward-model", "CONFIG=accelerate_configs/zero3.yaml", f"ARGS={shlex.join(args)}"])
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["mixed_precision"] == HOST_PRECISION
    assert record["distributed_type"] == "DEEPSPEED"
    rows, evals = read_metrics(out)
    assert all(set(METRICS) <= set(row) for row in rows)
    before, after = evals[0], evals[-1]
    print(f"make reward-model: held-out pair accuracy {before['eval_accuracy']:.3f} -> {after['eval_accuracy']:.3f}")
    assert before["step"] == 0 and after["step"] == 100 and after["eval_pairs"] == 200
    assert 0.3 < before["eval_accuracy"] < 0.7 and after["eval_accuracy"] >= 0.9
    summary = (
        f"held-out pair accuracy {before['eval_accuracy']:.3f} before -> {after['eval_accuracy']:.3f} of 200 pairs"
    )
    assert summary in result.stdout
    model = AutoModelForSequenceClassification.from_pretrained(out / "final")
    assert model.config.num_labels == 1
    model, tokenizer = load_reward_model(str(out / "final"))
    held_out = (REPO / "outputs/data/preference/validation.jsonl").read_text().splitlines()
    held_out = [json.loads(line) for line in held_out]
    prompts = [row["prompt"] for row in held_out]
    answers = [row["chosen"][0]["content"] for row in held_out]  # the assistant's text: rendered as its message
    chosen = score(model, tokenizer, prompts, answers)
    rejected = score(model, tokenizer, prompts, [row["rejected"] for row in held_out])
    accuracy = float((chosen > rejected).float().mean())
    assert accuracy >= 0.9 and abs(accuracy - after["eval_accuracy"]) <= 0.02  # bf16 in the run, fp32 here
    rewards = torch.cat([chosen, rejected])
    assert float(rewards.min()) == pytest.approx(after["eval_min_reward"], abs=0.1)
    assert float(rewards.max()) == pytest.approx(after["eval_max_reward"], abs=0.1)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_two_processes_train_as_one_with_margins_and_centring(pairs, tmp_path):
    """fp32, ddp.yaml on 2 processes (4 pairs x accumulation 2 each) against one process (8 x 1): the same global
    batch of 16 pairs with their margins and the centring term, so every step's loss and metrics and the final
    weights agree."""
    from conftest import max_weight_difference

    runs = {}
    for processes, batch, accumulation in [(1, 8, 2), (2, 4, 2)]:
        out = runs[processes] = tmp_path / f"run{processes}"
        launch(
            "ddp.yaml",
            "reward_model.py",
            reward_args(pairs, out, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation),
            num_processes=processes,
            launcher_args=FP32,
        )
        assert read_run(out)["participating_processes"] == processes
    one, two = (read_metrics(runs[p])[0] for p in (1, 2))
    assert len(one) == len(two) == 6
    for a, b in zip(one, two):
        for key in ("loss", "accuracy", "margin", "mean_reward"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    assert max_weight_difference(runs[1] / "final", runs[2] / "final") < 1e-5
