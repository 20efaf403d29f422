"""The recipe set (sequence classification, LoRA, SFT) under DDP, FSDP2 and ZeRO-3 on 2 CPU processes.

One config of each recipe is launched through its make target (`make sft CONFIG=...
ARGS=...`, as the README shows), so each target is run for real by the test that checks
what the run did."""

import json
import shlex
import shutil

import pytest
import torch
from conftest import (
    FP32,
    HOST_PRECISION,
    REPO,
    assert_same_hf_folder,
    bf16_or_host_precision,
    evaluate_in_process,
    export_checkpoint,
    flags,
    free_port,
    launch,
    read_metrics,
    read_run,
    resume_elsewhere,
    run,
    run_make_warm,
    tiered,
)


STRATEGIES = {"ddp.yaml": "MULTI_CPU", "fsdp.yaml": "FSDP", "zero3.yaml": "DEEPSPEED"}
# config -> processes its LoRA run's step-15 checkpoint resumes on (written by 2)
LORA_RESUME_PROCESSES = {"fsdp.yaml": 1, "zero3.yaml": 1}
# make test runs each recipe through its make target, under its config here (the rest in make test-all)
# make target -> the config its test runs it under
MAKE_TARGETS = {"sequence_classification": "ddp.yaml", "lora": "fsdp.yaml", "sft": "ddp.yaml"}


def launch_recipe(config: str, recipe: str, args: list, launcher_args: list | None = None, target: str | None = None):
    """`accelerate launch` of the recipe, or for the config in MAKE_TARGETS its make target
    (`target`, else the recipe's name; it makes the demo data first, then launches with ARGS
    after the demo's own flags)."""
    target = target or recipe.removesuffix(".py")
    if MAKE_TARGETS.get(target) != config:
        return launch(config, recipe, args, launcher_args=launcher_args)
    launch_args = [*(launcher_args or []), "--main_process_port", str(free_port())]
    # sequence_classification and sft: their recipes' make targets as the README writes them; lora (causal_lm.py's
    # --use_peft) through the warm launcher (make demo is causal_lm.py's)
    return (run_make_warm if target == "lora" else run)(
        [
            "make",
            target,
            f"CONFIG=accelerate_configs/{config}",
            f"LAUNCH_ARGS={shlex.join(launch_args)}",
            f"ARGS={shlex.join(map(str, args))}",
        ]
    )


def tokenized_by_2_processes(config: str, data, tmp_path) -> dict:
    """Under zero3.yaml, --preprocessing_num_workers 2, on a copy of the data files (datasets would
    load the tokenized copy an earlier test cached, and run no workers): the flags that ask for it."""
    if config != "zero3.yaml":
        return {}
    for split in ("train", "validation"):
        shutil.copy(data / f"{split}.jsonl", tmp_path / f"{split}.jsonl")
    return {
        "preprocessing_num_workers": 2,
        "train_file": tmp_path / "train.jsonl",
        "validation_file": tmp_path / "validation.jsonl",
    }


def assert_two_process_run(out, config):
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["world_size"] == 2
    assert record["distributed_type"] == STRATEGIES[config]
    return record


def first_and_last_loss(out):
    train = read_metrics(out)[0]
    return train[0]["loss"], train[-1]["loss"]


# --- sequence classification --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(STRATEGIES, ["ddp.yaml"]))  # zero3: LoRA's classification test
def test_sequence_classification(config, sentiment_data, minilm, tmp_path):
    out = tmp_path / "run"
    workers = tokenized_by_2_processes(config, sentiment_data, tmp_path)
    result = launch_recipe(
        config,
        "sequence_classification.py",
        flags(
            **{
                "config": REPO / "recipes/configs/sequence_classification_demo.yaml",
                "model_name_or_path": minilm,
                "train_file": sentiment_data / "train.jsonl",
                "validation_file": sentiment_data / "validation.jsonl",
                "output_dir": out,
                "max_steps": 16,
                "eval_steps": 8,
                "logging_steps": 4,
                "per_device_train_batch_size": 8,
                "early_stopping_patience": 3,
                "eval_on_start": "true",  # the pretrained encoder's scores first (not a best model to keep)
                **workers,
            }
        ),
    )
    assert ("tokenizing (num_proc=2)" in result.stderr) == bool(workers)
    record = assert_two_process_run(out, config)
    assert record["labels"] == ["negative", "positive"]
    first, last = first_and_last_loss(out)
    assert last < first
    start, *evals = read_metrics(out)[1]
    assert start["step"] == 0 and [e["step"] for e in evals] == [8, 16]
    # Every held-out example counted exactly once, though 201 does not split evenly over 2 ranks.
    assert all(e["eval_samples"] == 201 for e in [start, *evals])
    final = evals[-1]
    print(f"{config}: held-out accuracy {[round(e['eval_accuracy'], 4) for e in evals]}, f1 {final['eval_f1']:.4f}")
    if config in ("ddp.yaml", "zero3.yaml"):
        assert final["eval_accuracy"] >= 0.90

    # The export reloads and reproduces the logged accuracy; best/ holds the best evaluation's model.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rows = [json.loads(line) for line in (sentiment_data / "validation.jsonl").read_text().splitlines()]
    for folder, expected in (("final", final["eval_accuracy"]), ("best", max(e["eval_accuracy"] for e in evals))):
        model = AutoModelForSequenceClassification.from_pretrained(out / folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(out / folder)
        with torch.no_grad():
            logits = model(**tokenizer([r["text"] for r in rows], padding=True, return_tensors="pt")).logits
        predicted = [model.config.id2label[i] for i in logits.argmax(-1).tolist()]
        accuracy = sum(p == r["label"] for p, r in zip(predicted, rows)) / len(rows)
        assert accuracy == pytest.approx(expected, abs=1e-9), folder


@pytest.mark.slow
@pytest.mark.exhaustive
def test_sequence_classification_with_a_decoder_that_has_no_pad_token(decoder_classifier, sentiment_data, tmp_path):
    """A Llama-style checkpoint (bf16, no pad token in config or tokenizer, as on the Hub)
    classifies, padded per batch, with the pad token borrowed from EOS and saved in the config."""
    out = tmp_path / "run"
    launch(
        "ddp.yaml",
        "sequence_classification.py",
        flags(
            config=REPO / "recipes/configs/sequence_classification_demo.yaml",
            model_name_or_path=decoder_classifier,
            train_file=sentiment_data / "train.jsonl",
            validation_file=sentiment_data / "validation.jsonl",
            output_dir=out,
            max_steps=30,
            eval_steps=0,
            logging_steps=5,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            learning_rate=3e-3,
        ),
    )
    assert_two_process_run(out, "ddp.yaml")
    first, last = first_and_last_loss(out)
    evals = read_metrics(out)[1]
    print(f"decoder classifier: loss {first:.4f} -> {last:.4f}, accuracy {[e['eval_accuracy'] for e in evals]}")
    assert last < first and evals[-1]["eval_accuracy"] > 0.65  # chance: 0.5; validation sentences use unseen templates
    saved = json.loads((out / "final" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForSequenceClassification"] and saved["pad_token_id"] == 1  # </s>
    assert saved["dtype"] == "bfloat16"  # the checkpoint's dtype (--save_dtype auto)


def test_best_model_tracker_and_early_stopping():
    from common.training.evaluation import BestModelTracker

    tracker = BestModelTracker("eval_accuracy", greater_is_better=True, patience=2)
    assert [tracker.update(s, {"eval_accuracy": a}) for s, a in [(1, 0.5), (2, 0.7), (3, 0.7), (4, 0.6)]] == [
        True,
        True,
        False,
        False,
    ]
    assert tracker.best_step == 2 and tracker.should_stop
    restored = BestModelTracker("eval_accuracy", patience=2)
    restored.load_state_dict(tracker.state_dict())
    assert restored.best_value == 0.7 and restored.should_stop
    lower = BestModelTracker("eval_loss", greater_is_better=False)
    assert (
        lower.update(1, {"eval_loss": 2.0})
        and lower.update(2, {"eval_loss": 1.0})
        and not lower.update(3, {"eval_loss": 1.5})
    )


def test_shipped_metrics_load_offline_and_compute():
    from common.training.evaluation import load_metric

    assert load_metric("accuracy").compute(predictions=[1, 0, 1, 1], references=[1, 1, 1, 0])["accuracy"] == 0.5
    f1 = load_metric("f1")
    assert f1.compute(predictions=[1, 0, 1, 1], references=[1, 1, 1, 0])["f1"] == pytest.approx(2 / 3)
    assert f1.compute(predictions=[0, 1, 2, 2], references=[0, 2, 2, 1], average="macro")["f1"] == pytest.approx(0.5)


# --- LoRA ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(STRATEGIES, ["fsdp.yaml"]))  # zero3: LoRA on SFT and classification
def test_lora(config, trained_base, shifted_markov_data, tmp_path):
    out = tmp_path / "run"
    data = flags(
        train_file=shifted_markov_data / "train.jsonl",
        validation_file=shifted_markov_data / "validation.jsonl",
        block_size=32,
    )

    def lora_args(output_dir, **overrides):
        return [
            "--config",
            REPO / "recipes/configs/lora_demo.yaml",
            "--model_name_or_path",
            trained_base,
            *data,
            *flags(
                **{
                    "output_dir": output_dir,
                    "max_steps": 30,
                    "eval_steps": 0,
                    "save_steps": 15,
                    "save_total_limit": 2,
                    "logging_steps": 5,
                    "per_device_train_batch_size": 4,
                    "lora_r": 4,
                    **overrides,
                }
            ),
        ]

    launch_recipe(config, "causal_lm.py", lora_args(out), launcher_args=FP32, target="lora")
    record = assert_two_process_run(out, config)
    # Rank 4 on 7 projections of 2 layers: 4 x (in + out) per projection.
    assert 0 < record["trainable_parameters"] < record["total_parameters"] / 2
    first, last = first_and_last_loss(out)
    evals = read_metrics(out)[1]
    assert last < first and evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # evals[0]: the base model

    # The saved adapter is not empty: LoRA's B matrices start at zero and must have trained.
    from safetensors.torch import load_file

    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    b_norms = [float(t.norm()) for k, t in adapter.items() if "lora_B" in k]
    assert len(b_norms) == 2 * 7 and min(b_norms) > 0, adapter.keys()
    assert not (out / "final" / "model.safetensors").exists()  # adapter only
    assert_same_hf_folder(export_checkpoint(out / "checkpoints" / "step_30", tmp_path / "exported"), out / "final")

    # Base + reloaded adapter, and the merged export, give the eval loss logged at the end of training
    # (fp32 throughout, so that the round trip is checked to 1e-5 rather than to bf16's rounding).
    evaluate = [*data, "--per_device_eval_batch_size", "16"]
    with_adapter = evaluate_in_process(
        evaluate + ["--model_name_or_path", trained_base, "--adapter_name_or_path", out / "final"]
    )
    merged = evaluate_in_process(evaluate + ["--model_name_or_path", out / "final_merged"])
    for result in (with_adapter, merged):
        assert result["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], abs=1e-5)

    # The step-15 checkpoint, written by 2 processes, resumes on 1 (the global batch of 8 kept:
    # accumulation 2) to the same losses: only the adapter and its optimizer state are saved.
    if config in LORA_RESUME_PROCESSES:
        stopped, processes = tmp_path / "stopped", LORA_RESUME_PROCESSES[config]
        resume_elsewhere(
            out,
            stopped,
            15,
            processes,
            config,
            "causal_lm.py",
            lambda **resume: lora_args(stopped, **resume),
            accumulation=2,
            launcher_args=FP32,
        )
        resumed, logged = read_metrics(stopped)[0], read_metrics(out)[0]
        assert [r["step"] for r in resumed] == [20, 25, 30]
        gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(logged[-3:], resumed))
        print(f"{config}: LoRA resumed on {processes} process(es), max loss gap {gap:.2e} (fp32)")
        assert gap < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision",
    # emulated bf16 took 87 s of a 2-core AVX2 host's make test, fp32 48 s
    bf16_or_host_precision(),
)
def test_lora_on_sequence_classification_under_zero3_in_bf16(precision, sentiment_data, minilm, tmp_path):
    """--use_peft on the classifier recipe, under ZeRO-3 in the config's bf16: the adapters and the
    new head train (peft keeps the head as a module to save: a copy DeepSpeed must partition with
    the adapters), the adapter is saved whole, and the merged export predicts what the adapter on
    the base model predicts."""
    out = tmp_path / "run"
    launch(
        "zero3.yaml",
        "sequence_classification.py",
        flags(
            config=REPO / "recipes/configs/sequence_classification_demo.yaml",
            model_name_or_path=minilm,
            train_file=sentiment_data / "train.jsonl",
            validation_file=sentiment_data / "validation.jsonl",
            output_dir=out,
            max_steps=24,
            eval_steps=12,
            logging_steps=4,
            per_device_train_batch_size=8,
            learning_rate=5e-3,
            use_peft="true",
            lora_r=8,
            save_merged_model="true",
        ),
    )
    record = assert_two_process_run(out, "zero3.yaml")
    assert record["mixed_precision"] == ("bf16" if precision == "bf16" else "no")
    assert record["trainable_parameters"] < record["total_parameters"] / 20
    first, last = first_and_last_loss(out)
    final = read_metrics(out)[1][-1]
    print(
        f"LoRA classifier under zero3, {precision}: loss {first:.4f} -> {last:.4f}, accuracy {final['eval_accuracy']:.4f}"
    )
    assert last < first and final["eval_accuracy"] >= 0.8

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    b_norms = [float(t.norm()) for k, t in adapter.items() if "lora_B" in k]
    assert len(b_norms) == 2 * 6 and min(b_norms) > 0, adapter.keys()  # query and value of 6 layers
    head = [k for k in adapter if "classifier" in k]
    assert sorted(head) == ["base_model.model.classifier.bias", "base_model.model.classifier.weight"], head
    assert not (out / "final" / "model.safetensors").exists()

    rows = [json.loads(line) for line in (sentiment_data / "validation.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(out / "final_merged")
    batch = tokenizer([r["text"] for r in rows], padding=True, return_tensors="pt")
    merged = AutoModelForSequenceClassification.from_pretrained(out / "final_merged").eval()
    base = AutoModelForSequenceClassification.from_pretrained(minilm, num_labels=2)
    with_adapter = PeftModel.from_pretrained(base, out / "final").eval()
    with torch.no_grad():
        merged_logits, adapter_logits = merged(**batch).logits, with_adapter(**batch).logits
    assert (merged_logits - adapter_logits).abs().max() < 1e-3
    accuracy = sum(merged.config.id2label[i] == r["label"] for i, r in zip(merged_logits.argmax(-1).tolist(), rows))
    # the run evaluated in bf16; the export in fp32: a few borderline sentences may flip
    assert abs(accuracy / len(rows) - final["eval_accuracy"]) <= 3 / len(rows)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.bf16
def test_lora_sft_of_the_real_model_under_zero3_in_bf16(real_model, arithmetic_data, tmp_path):
    """--use_peft on sft.py with SmolLM2-135M-Instruct (its template, tied embeddings, grouped
    query attention) under ZeRO-3 in bf16: only the adapters train and are saved (non-empty under
    ZeRO-3), the merged export keeps the checkpoint's bf16 and its tie and answers as base + adapter
    does, and the step-2 checkpoint resumes to the same losses."""

    def sft_args(output_dir, **overrides):
        return flags(
            **{
                "config": REPO / "recipes/configs/sft_chat_demo.yaml",
                "model_name_or_path": real_model,
                "train_file": arithmetic_data / "train.jsonl",
                "validation_file": arithmetic_data / "validation.jsonl",
                "output_dir": output_dir,
                "max_steps": 4,
                "save_steps": 2,
                "logging_steps": 1,
                "per_device_train_batch_size": 8,
                "max_generation_samples": 8,
                "eval_on_start": "false",  # the test reads the train lines
                "learning_rate": 2e-3,
                "warmup_steps": 0,
                "use_peft": "true",
                "save_merged_model": "true",
                **overrides,
            }
        )

    out = tmp_path / "run"
    launch("zero3.yaml", "sft.py", sft_args(out))
    record = assert_two_process_run(out, "zero3.yaml")
    assert record["total_parameters"] == 134_515_008 + record["trainable_parameters"]
    assert record["trainable_parameters"] < record["total_parameters"] / 100
    train = read_metrics(out)[0]
    print(f"LoRA SFT of SmolLM2-135M under zero3, bf16: losses {[round(r['loss'], 3) for r in train]}")
    assert train[-1]["loss"] < train[0]["loss"] / 2

    from safetensors.torch import load_file

    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    b_norms = [float(t.norm()) for k, t in adapter.items() if "lora_B" in k]
    assert len(b_norms) == 2 * 30 and min(b_norms) > 0  # q_proj and v_proj (peft's default for Llama) x 30
    assert not (out / "final" / "model.safetensors").exists()
    merged = json.loads((out / "final_merged" / "config.json").read_text())
    assert merged["dtype"] == "bfloat16" and merged["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(str(out / "final_merged" / "model.safetensors"))

    from conftest import load_script

    ask = load_script("scripts/ask.py")
    question = "what is 7 plus 8 ?"
    assert ask.answer(str(out / "final_merged"), question, 4) == ask.answer(
        str(real_model), question, 4, adapter=str(out / "final")
    )

    stopped = tmp_path / "stopped"
    resume_elsewhere(
        out, stopped, 2, 2, "zero3.yaml", "sft.py", lambda **resume: sft_args(stopped, **resume), accumulation=1
    )
    resumed = read_metrics(stopped)[0]
    assert [r["step"] for r in resumed] == [3, 4]
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(train[2:], resumed))
    print(f"resumed at step 2: loss gap {gap:.2e}")
    assert gap < 1e-3


# --- SFT ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(STRATEGIES, ["ddp.yaml"]))
def test_sft(config, arithmetic_data, tmp_path):
    """Under ddp.yaml, through `make sft`, the demo as it ships (bf16, the YAML's 600 steps) answers
    nearly every held-out question; fsdp and zero3 run a shorter stretch of it."""
    out = tmp_path / "run"
    steps = {} if config == "ddp.yaml" else {"max_steps": 120}
    workers = tokenized_by_2_processes(config, arithmetic_data, tmp_path)
    result = launch_recipe(
        config,
        "sft.py",
        flags(
            **{
                "config": REPO / "recipes/configs/sft_demo.yaml",
                "tokenizer_name_or_path": arithmetic_data / "tokenizer",
                "train_file": arithmetic_data / "train.jsonl",
                "validation_file": arithmetic_data / "validation.jsonl",
                "output_dir": out,
                "logging_steps": 20,
                **steps,
                **workers,
            }
        ),
    )
    assert ("tokenizing SFT examples (num_proc=2)" in result.stderr) == bool(workers)
    record = assert_two_process_run(out, config)
    assert record["mixed_precision"] == HOST_PRECISION
    if record["device"] == "cpu":  # packed rows: per-example sdpa here (a GPU's choice: tests/test_gpu.py)
        assert record["speed"]["attention"] == "sdpa_varlen"
    first, last = first_and_last_loss(out)
    before, after = read_metrics(out)[1][0], read_metrics(out)[1][-1]
    assert before["step"] == 0 and after["step"] == record["max_steps"] and after["eval_generated"] == 101
    print(
        f"{config}: exact match {before['eval_exact_match']:.3f} untrained -> {after['eval_exact_match']:.3f} "
        f"after {after['step']} steps; loss {first:.3f} -> {last:.3f}"
    )
    assert last < first / 2
    if config == "ddp.yaml":
        assert after["step"] == 600 and after["eval_exact_match"] >= 0.95
    else:
        assert after["eval_exact_match"] >= before["eval_exact_match"] + 0.1
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out / "final")
    assert reloaded.config.vocab_size == len(
        json.loads((out / "final" / "tokenizer.json").read_text())["model"]["vocab"]
    )


def _chat_batches(arithmetic_data, count=12):
    from accelerate import PartialState
    from datasets import DatasetDict, load_dataset
    from transformers import AutoTokenizer

    from common.data.chat import tokenize_sft

    tokenizer = AutoTokenizer.from_pretrained(arithmetic_data / "tokenizer")
    raw = load_dataset(
        "json",
        data_files={
            "train": str(arithmetic_data / "validation.jsonl"),
            "validation": str(arithmetic_data / "validation.jsonl"),
        },
    )
    raw = DatasetDict({k: v.select(range(count)) for k, v in raw.items()})
    return tokenizer, raw, tokenize_sft(raw, tokenizer, "messages", 64, "drop", PartialState(cpu=True))[0]


def test_chat_labels_cover_the_assistant_answer_only(arithmetic_data):
    tokenizer, raw, tokenized = _chat_batches(arithmetic_data)
    for example, messages in zip(tokenized["train"], raw["train"]["messages"]):
        learned = [t for t in example["labels"] if t != -100]
        assert tokenizer.decode(learned) == f"{messages[-1]['content']} <eos>"
        assert len(example["labels"]) == len(example["input_ids"])


def loss_and_gradient(model, batch) -> tuple[float, torch.Tensor]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


def test_packing_leaves_the_per_token_loss_unchanged(counting_data):
    """One flattened row with restarting position ids == a padded batch, for the same weights:
    with transformers' dense mask (sdpa) and with attention per conversation (sdpa_varlen, whose
    conversations of different lengths go to different sdpa calls), losses and gradients alike."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    from common.data.packing import use_per_example_attention
    from common.models.loading import load_model
    from common.options.arguments import ModelArguments

    tokenizer, _, tokenized = _chat_batches(counting_data)  # 1 to 12 answer tokens: lengths vary
    features = [{k: e[k] for k in ("input_ids", "labels")} for e in tokenized["train"]]
    model = load_model(
        ModelArguments(
            model_config=str(REPO / "recipes/configs/tiny_llama.json"),
            tokenizer_name_or_path=str(counting_data / "tokenizer"),
        ),
        tokenizer,
        seed=3,
    )
    packed = DataCollatorWithFlattening()(features)
    padded = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)(features)
    assert packed["input_ids"].shape[0] == 1 and padded["input_ids"].shape[0] == len(features)
    assert int((packed["input_ids"] == tokenizer.pad_token_id).sum()) == 0
    from common.data.packing import _example_groups

    groups = _example_groups(packed["position_ids"])  # sdpa_varlen attends each length group apart
    assert len(groups) > 1 and sum(int(real.sum()) for _, real in groups) == packed["input_ids"].shape[1]

    padded_loss, padded_gradient = loss_and_gradient(model, padded)
    dense_loss, dense_gradient = loss_and_gradient(model, packed)
    assert use_per_example_attention(model) == "sdpa_varlen"
    varlen_loss, varlen_gradient = loss_and_gradient(model, packed)
    for loss, gradient in ((dense_loss, dense_gradient), (varlen_loss, varlen_gradient)):
        assert loss == pytest.approx(padded_loss, abs=1e-5)
        assert (gradient - padded_gradient).abs().max() < 1e-5
    assert loss_and_gradient(model, padded)[0] == padded_loss  # padded batches still take sdpa's own path


def test_per_example_attention_never_crosses_conversations(arithmetic_data):
    """Changing every token of the first conversation in a packed row leaves the others' logits as
    they were; a model without per-example attention (plain causal over the row) would not."""
    from transformers import DataCollatorWithFlattening

    from common.data.packing import use_per_example_attention
    from common.models.loading import load_model
    from common.options.arguments import ModelArguments

    tokenizer, _, tokenized = _chat_batches(arithmetic_data, count=6)
    features = [{k: e[k] for k in ("input_ids", "labels")} for e in tokenized["train"]]
    changed = [{**features[0], "input_ids": [(t + 5) % len(tokenizer) for t in features[0]["input_ids"]]}] + features[
        1:
    ]
    model = load_model(
        ModelArguments(
            model_config=str(REPO / "recipes/configs/tiny_llama.json"),
            tokenizer_name_or_path=str(arithmetic_data / "tokenizer"),
        ),
        tokenizer,
        seed=3,
    )
    use_per_example_attention(model)
    first = len(features[0]["input_ids"])
    with torch.no_grad():
        logits = [model(**DataCollatorWithFlattening()(batch)).logits[0] for batch in (features, changed)]
        assert (logits[0][first:] - logits[1][first:]).abs().max() == 0
        assert (logits[0][:first] - logits[1][:first]).abs().max() > 0
        # Control: the same row with positions 0..n-1 throughout is one causal sequence, and leaks.
        row = DataCollatorWithFlattening()(changed)
        leaky = model(input_ids=row["input_ids"]).logits[0]
        assert (leaky[first:] - logits[1][first:]).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_per_example_attention_honours_sliding_windows(family):
    """Mistral-style (every layer) and Qwen2-style (some layers) sliding-window attention: a packed
    row under sdpa_varlen gives the padded batch's loss and gradients, windows shorter than the
    conversations included."""
    from transformers import (
        DataCollatorWithFlattening,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from common.data.packing import use_per_example_attention

    shape = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        attn_implementation="sdpa",
        pad_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = (
        MistralForCausalLM(MistralConfig(**shape))
        if family == "mistral"
        else Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, max_window_layers=1))
    )
    lengths = (11, 7, 13, 5)
    features = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(3, 100, (n,)).tolist() for n in lengths)]
    padded = {
        key: torch.full((len(lengths), max(lengths)), fill)
        for key, fill in (("input_ids", 0), ("labels", -100), ("attention_mask", 0))
    }
    for row, feature in enumerate(features):
        n = len(feature["input_ids"])
        padded["input_ids"][row, :n] = padded["labels"][row, :n] = torch.tensor(feature["input_ids"])
        padded["attention_mask"][row, :n] = 1

    padded_loss, padded_gradient = loss_and_gradient(model, padded)
    assert use_per_example_attention(model) == "sdpa_varlen"
    packed_loss, packed_gradient = loss_and_gradient(model, DataCollatorWithFlattening()(features))
    assert packed_loss == pytest.approx(padded_loss, abs=1e-5)
    assert (packed_gradient - padded_gradient).abs().max() < 1e-5
