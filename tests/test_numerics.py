"""The numbers a run produces do not depend on the strategy, the split of the global
batch into processes and accumulation steps, or where an epoch ends."""

import json
import shutil
from types import SimpleNamespace

import pytest
from conftest import (
    FP32,
    REPO,
    causal_lm_args,
    flags,
    launch,
    launch_one_process,
    losses,
    max_weight_difference,
    read_metrics,
    read_run,
    tiered,
)

from common.launch.errors import UsageError
from common.options.arguments import TrainingArguments


# --- loss = mean over the global batch's label tokens --------------------------------


def sft_args(data, out, batch, accumulation, packing):
    return flags(
        config=REPO / "recipes/configs/sft_demo.yaml",
        tokenizer_name_or_path=data / "tokenizer",
        train_file=data / "train.jsonl",
        validation_file=data / "validation.jsonl",
        output_dir=out,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        packing=packing,
        max_steps=6,
        logging_steps=1,
        eval_steps=0,
        save_steps=0,
        warmup_steps=0,
        learning_rate=3e-3,
        max_generation_samples=1,
        max_new_tokens=1,
        eval_on_start="false",  # the test reads the train lines
        report_to="none",
    )


def test_counting_chats_have_label_counts_that_vary(counting_data):
    from accelerate import PartialState
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from common.data.chat import tokenize_sft

    tokenizer = AutoTokenizer.from_pretrained(counting_data / "tokenizer")
    raw = load_dataset(
        "json",
        data_files={
            "train": str(counting_data / "train.jsonl"),
            "validation": str(counting_data / "validation.jsonl"),
        },
    )
    counts = {
        sum(t != -100 for t in e["labels"])
        for e in tokenize_sft(raw, tokenizer, "messages", 64, "drop", PartialState(cpu=True))[0]["train"]
    }
    assert min(counts) == 2 and max(counts) == 13  # answer (1 to 12 tokens) + EOS


# the splits each case compares with 1 x 8: processes and accumulation (ddp), tensor parallelism (a pair sharing each
# batch), sequence and context parallelism (a pair splitting each row; --packing is refused there) and, packed, the
# strategies that differ in how they reduce, not in what the collator counts
SPLIT_RUNS = {
    "padded": {"ddp 2x2x2": ("ddp.yaml", 2, 2), "ulysses 1x4x2": ("zero3_ulysses.yaml", 4, 2),
               "ring 1x4x2": ("fsdp_cp.yaml", 4, 2)},
    "padded, tp": {"tp 1x4x2": ("tp.yaml", 4, 2)},
    "packed": {"ddp 2x2x2": ("ddp.yaml", 2, 2), "tp 1x4x2": ("tp.yaml", 4, 2), "zero3 2x2x2": ("zero3.yaml", 2, 2),
               "fsdp_tp 2x2x2": ("fsdp_tp.yaml", 2, 2)},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", tiered(SPLIT_RUNS, ["padded"]))  # make test: padded, with the splits of rows
def test_sft_objective_is_the_same_however_the_batch_is_split(case, counting_data, tmp_path):
    """1 x 8, 2 processes x 2 with accumulation 2 (ddp; packed: zero3 and fsdp_tp.yaml's 2 TP pairs too), a
    tensor-parallel pair sharing 4 x accumulation 2 (tp.yaml) and, padded, a sequence-parallel pair splitting
    each row of 4 x accumulation 2 (zero3_ulysses.yaml, fsdp_cp.yaml: each rank half of every row's tokens) train the same
    weights (fp32, from the same config and seed): every label token of the global batch weighs
    the same, whichever micro-batch or rank it lands in."""
    packing = "true" if case == "packed" else "false"
    runs = {"1x8": ("single.yaml", 8, 1), **SPLIT_RUNS[case]}
    for name, (config, batch, accumulation) in runs.items():
        out = tmp_path / name.replace(" ", "_")
        args = sft_args(counting_data, out, batch, accumulation, packing)
        if config == "single.yaml":  # in this process, as its launch runs it (conftest.launch_one_process)
            launch_one_process("sft.py", args, launcher_args=FP32)
        else:
            launch(config, "sft.py", args, launcher_args=FP32)
        assert read_run(out)["participating_processes"] == {"single.yaml": 1, "fsdp_tp.yaml": 4}.get(config, 2)
    base = tmp_path / "1x8"
    for name in list(runs)[1:]:
        config, out = runs[name][0], tmp_path / name.replace(" ", "_")
        weight_gap = max_weight_difference(out / "final", base / "final")
        loss_gap = max(abs(a - b) for a, b in zip(losses(out), losses(base)))
        print(f"packing={packing} {name} vs 1x8: weight gap {weight_gap:.2e}, logged loss gap {loss_gap:.2e}")
        # Packed: a batch of 8 and one of 2 may take different layouts (common.data.packing.PackOrPad keeps a
        # batch padded when padding wastes little), whose attention sums in another order; a wrong
        # weighting of label tokens moves the weights by about 1e-3. Tensor parallel: each row-split projection's
        # halves are summed by an all-reduce, in another order (unpacked, seen: 1.6e-5 and 1.3e-5 on one element
        # each of two MLP weights, where Adam divides by a second moment near 0; ddp 6.5e-6 there). Ring
        # attention merges each rank's partial attention by its log-sum-exp, in another order too (seen: 2.3e-5).
        bound = 5e-5 if packing == "true" or "tp" in config or "ulysses" in config or "cp" in config else 1e-5
        assert weight_gap < bound and loss_gap < 1e-5


# --- --max_grad_norm decides clipping under every strategy ---------------------------


@pytest.mark.slow
@pytest.mark.exhaustive
def test_small_max_grad_norm_changes_zero2_as_it_changes_one_process(markov_data, tmp_path):
    # DeepSpeed clips inside its own step with its config's gradient_clipping; build_accelerator writes
    # --max_grad_norm there. Adam is almost blind to a uniform gradient scale: a large epsilon lets clipping show.
    runs = {"unclipped": ("single.yaml", 8, 0), "one": ("single.yaml", 8, 0.01), "zero2": ("zero2.yaml", 4, 0.01)}
    for name, (config, batch, max_grad_norm) in runs.items():
        launch(
            config,
            "causal_lm.py",
            causal_lm_args(
                markov_data,
                tmp_path / name,
                per_device_train_batch_size=batch,
                max_grad_norm=max_grad_norm,
                adam_epsilon=1e-3,
                max_steps=6,
            ),
            launcher_args=FP32,
        )
    assert read_run(tmp_path / "zero2")["participating_processes"] == 2
    assert read_run(tmp_path / "zero2")["args"]["max_grad_norm"] == 0.01
    unclipped, one, zero2 = (losses(tmp_path / name) for name in runs)
    effect = max(abs(a - b) for a, b in zip(one, unclipped))
    gap = max(abs(a - b) for a, b in zip(zero2, one))
    print(f"max_grad_norm 0.01 vs 0 (off) moves the losses by up to {effect:.3f}; zero2 vs one process: {gap:.2e}")
    assert len(zero2) == len(one) == 6 and effect > 1e-2 and gap < 1e-5


def test_max_grad_norm_must_be_non_negative():
    with pytest.raises(UsageError, match="max_grad_norm must be >= 0"):
        TrainingArguments(max_grad_norm=-1)
    TrainingArguments(max_grad_norm=0)  # 0: no clipping


def test_deepspeed_clipping_follows_max_grad_norm_or_is_refused():
    from common.launch.accelerator import _clip_with_max_grad_norm

    plugin = SimpleNamespace(deepspeed_config={"gradient_clipping": "auto"}, gradient_clipping="auto")
    _clip_with_max_grad_norm(plugin, 0.25)
    assert plugin.deepspeed_config["gradient_clipping"] == 0.25
    plugin = SimpleNamespace(deepspeed_config={}, gradient_clipping=None)
    _clip_with_max_grad_norm(plugin, 0.0)
    assert plugin.deepspeed_config["gradient_clipping"] == 0.0  # DeepSpeed: 0 = no clipping
    with pytest.raises(UsageError, match="gradient_clipping: 1.0 but --max_grad_norm is 0.5"):
        _clip_with_max_grad_norm(SimpleNamespace(deepspeed_config={"gradient_clipping": 1.0}), 0.5)


# --- epochs with a remainder, and resuming past an epoch boundary ---------------------


@pytest.mark.slow
def test_epochs_with_a_remainder_resume_exactly_past_a_torn_metrics_line(tmp_path):
    from common.data.synthetic import write_markov_corpus

    data = tmp_path / "data"
    write_markov_corpus(str(data), train_docs=120, validation_docs=20, seed=0)
    accumulation = 5
    args = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=-1,
        num_train_epochs=3,
        save_steps=1,
        save_total_limit=100,
        warmup_steps=0,
        lr_scheduler_type="linear",
    )
    full = tmp_path / "full"
    launch("ddp.yaml", "causal_lm.py", causal_lm_args(data, full, **args), launcher_args=FP32)
    record = read_run(full)
    batches = record["train_blocks"] // (2 * 2)  # per rank per epoch
    per_epoch = batches // accumulation
    print(
        f"{record['train_blocks']} blocks: {batches} batches per rank per epoch, {per_epoch} steps, "
        f"remainder {batches % accumulation}"
    )
    assert batches % accumulation != 0 and per_epoch >= 2
    assert record["max_steps"] == 3 * per_epoch
    train = read_metrics(full)[0]
    assert [r["step"] for r in train] == list(range(1, 3 * per_epoch + 1))
    assert train[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # the schedule ends on the last step

    # Stopped one step after the first epoch boundary; resumed from that checkpoint.
    after_boundary = per_epoch + 1
    state = json.loads((full / "checkpoints" / f"step_{after_boundary}" / "trainer_state.json").read_text())
    assert state["data"] == {"epoch": 1, "samples": accumulation * 2 * 2, "global_batch": accumulation * 2 * 2}
    stopped = tmp_path / "stopped"
    shutil.copytree(
        full / "checkpoints" / f"step_{after_boundary}", stopped / "checkpoints" / f"step_{after_boundary}"
    )
    # The stopped run had logged two steps past its checkpoint when a crash tore its last line in half.
    rows = (full / "metrics.jsonl").read_text().splitlines(keepends=True)
    logged = [row for row in rows if json.loads(row)["step"] <= after_boundary + 2]
    (stopped / "metrics.jsonl").write_text("".join(logged) + rows[len(logged)][:25])
    launch(
        "ddp.yaml",
        "causal_lm.py",
        causal_lm_args(data, stopped, resume_from_checkpoint="latest", **args),
        launcher_args=FP32,
    )
    kept = read_metrics(stopped)[0]  # every line parses again
    assert [r["step"] for r in kept] == list(range(1, 3 * per_epoch + 1))  # the crashed run's extra steps dropped
    resumed = kept[after_boundary:]
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(train[after_boundary:], resumed))
    assert gap < 1e-6 and max_weight_difference(stopped / "final", full / "final") < 1e-6


# --- weight decay by module type; strategy-independent initialisation -------------------


def test_weight_decay_skips_biases_and_every_norm_layer_by_type():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from common.training.loop import create_optimizer

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    decayed, plain = create_optimizer(model, TrainingArguments(weight_decay=0.1)).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    plain_names = {names[id(p)] for p in plain["params"]}
    assert "transformer.h.0.ln_1.weight" in plain_names and "transformer.ln_f.weight" in plain_names
    assert all(n.endswith("bias") or ".ln_" in n for n in plain_names)
    decayed_names = {names[id(p)] for p in decayed["params"]}
    assert "transformer.h.0.attn.c_attn.weight" in decayed_names and not any(".ln_" in n for n in decayed_names)
    assert len(decayed_names) + len(plain_names) == len(list(model.parameters()))
    assert isinstance(model.transformer.h[0].ln_1, torch.nn.LayerNorm)


def test_initial_weights_do_not_depend_on_the_global_rng_or_build_order():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from common.models.loading import initialise_weights

    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(1)
    first = AutoModelForCausalLM.from_config(config)
    initialise_weights(first, seed=7)
    torch.manual_seed(2)
    torch.rand(1000)  # another RNG state, as another strategy's set-up would leave
    second = AutoModelForCausalLM.from_config(config)
    initialise_weights(second, seed=7)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    third = AutoModelForCausalLM.from_config(config)
    initialise_weights(third, seed=8)
    assert not torch.equal(third.model.embed_tokens.weight, first.model.embed_tokens.weight)
