"""Optimizer groups, schedule scaling and checkpoint bookkeeping, without launching anything."""

import os
import re
import shutil

import pytest
import torch
from conftest import REPO

from common.launch.errors import UsageError
from common.options.arguments import TrainingArguments
from common.outputs.run_dir import check_output_dir, list_checkpoints, resolve_checkpoint
from common.training.loop import create_optimizer, create_scheduler, total_training_steps


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )


def test_weight_decay_skips_norms_and_biases():
    model = tiny_llama()
    optimizer = create_optimizer(model, TrainingArguments(weight_decay=0.1))
    decayed, plain = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all("norm" in names[id(p)] for p in plain["params"])
    assert all("norm" not in names[id(p)] for p in decayed["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_schedule_horizon_is_the_runs_optimizer_steps():
    args = TrainingArguments(warmup_steps=2, lr_scheduler_type="linear", learning_rate=1.0)
    optimizer = create_optimizer(tiny_llama(), args)
    scheduler = create_scheduler(optimizer, args, max_steps=10)
    lrs = []
    for _ in range(10):  # the recipes step the schedule once per optimizer step, on any world size
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs[:2] == pytest.approx([0.5, 1.0]) and lrs[-1] == pytest.approx(0.0)  # warmup is 2 optimizer steps
    two = Processes(2)
    assert (
        total_training_steps(TrainingArguments(num_train_epochs=3, gradient_accumulation_steps=2), range(20), two)
        == 15
    )
    assert (
        total_training_steps(TrainingArguments(num_train_epochs=3, gradient_accumulation_steps=3), range(20), two) == 9
    )
    with pytest.raises(UsageError, match="fewer than gradient_accumulation_steps=4"):
        total_training_steps(TrainingArguments(gradient_accumulation_steps=4), range(6), two)
    assert total_training_steps(TrainingArguments(max_steps=7), None, two) == 7
    # a tensor-parallel pair trains on one batch at a time: the epoch's 20 batches are all its own
    pair = Processes(2, tp_size=2)
    assert (
        total_training_steps(TrainingArguments(num_train_epochs=3, gradient_accumulation_steps=2), range(20), pair)
        == 30
    )


class Processes:
    """What total_training_steps reads of an Accelerator: the processes, and the mesh (common.launch.mesh)."""

    def __init__(self, count: int, tp_size: int = 1):
        from accelerate.utils import ParallelismConfig

        self.num_processes = count
        self.parallelism_config = ParallelismConfig(tp_size=tp_size) if tp_size > 1 else None


def test_latest_checkpoint_ignores_unfinished_saves(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_2", "step_10", "tmp-step_12"):  # tmp-: a save that crashed before its rename
        (root / name).mkdir(parents=True)
        (root / name / "trainer_state.json").write_text("{}")
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["step_2", "step_10"]
    assert resolve_checkpoint(str(tmp_path), "latest").endswith("step_10")
    assert resolve_checkpoint(str(tmp_path / "fresh"), "latest") is None
    with pytest.raises(UsageError, match="not a complete checkpoint"):
        resolve_checkpoint(str(tmp_path), str(root / "tmp-step_12" / "missing"))
    with pytest.raises(UsageError, match="already holds a run"):
        check_output_dir(str(tmp_path), None, overwrite=False)
    check_output_dir(str(tmp_path), "latest", overwrite=False)


def counted_training_flops(model, batch) -> float:
    """FLOPs torch itself counts for one forward and backward (matmuls and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(**batch, labels=batch["input_ids"]).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("kind", ["llama", "gpt2_tied", "llama_lora"])
def test_model_flops_match_what_torch_counts(kind):
    """6N + 12 L H Q T (4N + 2N_trainable with LoRA's frozen base), from the model's own layers,
    equals torch's FLOP counter over a real forward and backward within 1%."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from common.training.flops import ModelFlops

    torch.manual_seed(0)
    if kind == "gpt2_tied":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=96,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                attn_implementation="eager",
            )
        )  # counted as matmuls
    if kind == "llama_lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    batch = {"input_ids": torch.randint(0, 96, (3, 40)), "attention_mask": torch.ones(3, 40, dtype=torch.long)}
    expected = float(ModelFlops(model).per_batch(batch))
    if kind == "llama_lora":
        # The formula takes an input gradient for every weight. Autograd computes none where nothing
        # below needs one: the inputs of layer 0's q/k/v projections (and of its LoRA A matrices),
        # and layer 0's key gradient (its keys come from a frozen projection of a frozen input).
        attention = model.base_model.model.model.layers[0].self_attn
        skipped = [
            attention.q_proj.base_layer,
            attention.k_proj,
            attention.v_proj.base_layer,
            attention.q_proj.lora_A["default"],
            attention.v_proj.lora_A["default"],
        ]
        expected -= 2 * batch["input_ids"].numel() * sum(layer.weight.numel() for layer in skipped)
        expected -= 2 * batch["input_ids"].numel() * 64 * batch["input_ids"].shape[1]  # dK = dS^T Q
    counted = counted_training_flops(model, batch)
    print(f"{kind}: formula {expected:.4g}, torch counted {counted:.4g}")
    assert abs(expected - counted) / counted < 0.01


def test_mfu_needs_a_known_peak():
    import torch

    from common.training.flops import device_peak_tflops

    assert device_peak_tflops(torch.device("cpu"), "bfloat16", None) is None  # no MFU invented on CPU
    assert device_peak_tflops(torch.device("cpu"), "bfloat16", 100.0) == 100.0


def test_long_work_on_the_main_process_reports_while_the_others_wait(capsys):
    """Progress lines past every N seconds, the warning once half of --ddp_timeout is spent, a
    closing line; nothing for quick work, and nothing from the ranks that wait."""
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    from accelerate.utils import InitProcessGroupKwargs

    from common.launch.peers import main_process_alone

    main = SimpleNamespace(is_main_process=True, init_handler=InitProcessGroupKwargs(timeout=timedelta(seconds=1)))
    with main_process_alone(main, "tokenizing", every=0.2):
        time.sleep(0.9)
    lines = capsys.readouterr().err.strip().splitlines()
    progress = [
        line
        for line in lines
        if "s so far on the main process; the other ranks wait for it up to --ddp_timeout 1 s" in line
    ]
    assert len(progress) >= 3 and lines[-1].startswith("tokenizing: done in"), lines
    assert "raise --ddp_timeout" not in progress[0] and "raise --ddp_timeout" in progress[-1], progress
    for accelerator, seconds in (
        (SimpleNamespace(is_main_process=True), 0.0),
        (SimpleNamespace(is_main_process=False), 0.5),
    ):
        with main_process_alone(accelerator, "tokenizing", every=0.2):
            time.sleep(seconds)
        assert capsys.readouterr().err == ""


def test_the_data_position_is_the_same_sample_under_another_split_and_another_global_batch_is_refused():
    """Step k of an epoch trains on samples [k x G, (k+1) x G) of the epoch's permutation for
    global batch G, however G is split: a position saved as 4 per batch x accumulation 4
    resumes as 8 x 2 at the same sample. Another G gets one line saying what to set."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    from common.training.loop import TrainBatches

    def order(batch_size, accumulation, resume_from):
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True)
        examples = [{"input_ids": torch.tensor([i])} for i in range(100)]
        loader = accelerator.prepare(
            DataLoader(
                examples,
                batch_size=batch_size,
                shuffle=True,
                drop_last=True,
                generator=torch.Generator().manual_seed(7),
            )
        )
        batches = TrainBatches(accelerator, loader, accumulation, 6, resume_from=resume_from)
        return batches, iter(batches)

    try:
        batches, stream = order(4, 4, {"step": 0})
        trained = [int(x) for _ in range(8) for x in next(stream)["input_ids"].flatten()]  # steps 1 and 2
        saved = batches.position  # what a checkpoint at step 2 stores
        assert saved == {"epoch": 0, "samples": 32, "global_batch": 16}
        _, stream = order(8, 2, {"step": 2, "data": saved})
        resumed = [int(x) for _ in range(2) for x in next(stream)["input_ids"].flatten()]
        _, fresh = order(4, 4, {"step": 0})
        whole = [int(x) for _ in range(12) for x in next(fresh)["input_ids"].flatten()]
        assert resumed == whole[32:48] and trained == whole[:32] and len(set(whole)) == 48
        # Steps 1-6 in all (max_steps 6): 24 micro-batches of 4, then the iteration ends; none when resumed at 6.
        assert len(list(order(4, 4, {"step": 0})[0])) == 24
        assert list(order(4, 4, {"step": 6, "data": {"epoch": 1, "samples": 0, "global_batch": 16}})[0]) == []
        with pytest.raises(UsageError, match=r"global batch of 16 samples per step and this run's is 8 .*= 16$"):
            order(4, 2, {"step": 2, "data": saved})
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.parametrize("emulate", ["false", "true"])
def test_bf16_on_a_cpu_without_bf16_instructions_falls_back_to_fp32_unless_emulation_is_asked(
    emulate, monkeypatch, capsys
):
    """Where the CPU has no bf16 instructions (stood in for by the probe answering no), a bf16
    launch trains in fp32 and says so once; RECIPES_EMULATE_BF16=true keeps bf16."""
    import torch
    from accelerate.utils import InitProcessGroupKwargs

    from common.launch import cpu_host

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("RECIPES_EMULATE_BF16", emulate)
    monkeypatch.setenv("RANK", "0")
    assert cpu_host.accelerator_kwargs("single", InitProcessGroupKwargs()) == {}
    warned = capsys.readouterr().err
    if emulate == "true":
        assert os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16" and warned == ""
    else:
        assert os.environ["ACCELERATE_MIXED_PRECISION"] == "no"
        assert warned.startswith("warning: mixed_precision=bf16 asked for, but this CPU has no bf16 instructions")
        assert "RECIPES_EMULATE_BF16=true" in warned and warned.strip().endswith("training in fp32")


@pytest.mark.parametrize("kind", [kind.value for kind in __import__("transformers").SchedulerType])
def test_every_scheduler_offered_trains_or_is_refused_before_start_up(kind):
    """Each transformers scheduler either steps once per optimizer step through the recipes'
    create_scheduler (with --lr_scheduler_kwargs where it needs arguments, which it names when
    they are missing) or is refused while parsing with one line."""
    from common.options.arguments import METRIC_SCHEDULERS, SCHEDULER_KWARGS_EXAMPLES

    if kind in METRIC_SCHEDULERS:
        with pytest.raises(UsageError, match=f"{kind} steps on an evaluation metric"):
            TrainingArguments(lr_scheduler_type=kind)
        return
    example = SCHEDULER_KWARGS_EXAMPLES.get(kind)
    if example is not None:
        with pytest.raises(UsageError, match=f"pass its arguments, e.g. --lr_scheduler_kwargs '{re.escape(example)}'"):
            TrainingArguments(lr_scheduler_type=kind, max_steps=10)
        example = example.replace("100", "4")  # decay over the last 4 of 10 steps
    args = TrainingArguments(
        lr_scheduler_type=kind, lr_scheduler_kwargs=example, warmup_steps=2, learning_rate=1.0, max_steps=10
    )
    optimizer = create_optimizer(tiny_llama(), args)
    scheduler = create_scheduler(optimizer, args, max_steps=10)
    lrs = []
    for _ in range(10):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert all(0 <= lr <= 1.0 for lr in lrs) and lrs[1] > 0, lrs  # finite, within the peak, and moving


def test_a_checkpoint_that_does_not_load_says_whether_the_host_the_file_or_the_arguments_are_at_fault(tmp_path):
    """Real failures of each kind, raised by the libraries that raise them, classified."""
    import errno

    import torch
    from safetensors.torch import load_file, save_file

    from common.launch.errors import RunStopped
    from common.outputs.checkpoints import load_failure

    def failure_of(action):
        try:
            action()
        except Exception as error:  # noqa: BLE001 - the point is to see what each raises
            return load_failure("step_2", error)
        raise AssertionError("no failure")

    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(weights))
    weights.write_bytes(weights.read_bytes()[:20])  # a save cut short
    damaged = failure_of(lambda: load_file(str(weights)))
    assert isinstance(damaged, UsageError) and "step_2 is damaged" in str(damaged), damaged
    other = failure_of(
        lambda: torch.nn.Linear(4, 8).load_state_dict({"weight": torch.zeros(4, 4), "bias": torch.zeros(4)})
    )
    assert isinstance(other, UsageError) and "written with other model or strategy arguments" in str(other), other
    io = failure_of(lambda: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error", str(weights))))
    assert isinstance(io, RunStopped) and "an I/O error on this host" in str(io), io
    memory = failure_of(lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")))
    assert isinstance(memory, RunStopped) and "ran out of memory" in str(memory), memory
    missing = failure_of(lambda: open(tmp_path / "optimizer.bin", "rb"))
    assert isinstance(missing, UsageError) and "is damaged" in str(missing), missing


def test_a_folder_swap_never_leaves_the_target_missing(tmp_path, monkeypatch):
    """Replacing a complete folder (a same-step checkpoint, final/) is one atomic step: after every
    filesystem operation the swap makes, the target is a complete folder, old or new. Checked after
    each operation rather than by a thread polling the target, which saw the fallback's gap in 1 of
    5 runs only. The swap must have used renameat2's exchange (a filesystem without it takes the
    fallback below, which does leave a gap)."""
    from common.outputs import run_dir

    target, tmp = tmp_path / "step_4", tmp_path / "tmp-step_4"
    target.mkdir()
    (target / "complete").write_text("0")
    probe = [tmp_path / "probe_a", tmp_path / "probe_b"]
    for folder in probe:
        folder.mkdir()
    if not run_dir._exchange(str(probe[0]), str(probe[1])):
        pytest.skip(f"{tmp_path}'s filesystem has no renameat2 exchange: swaps take the fallback tested below")
    operations, gaps = [], []

    def watched(name, operation):
        def run(*args, **kwargs):
            result = operation(*args, **kwargs)
            operations.append(name)
            if not (target / "complete").exists():
                gaps.append(name)
            return result

        return run

    monkeypatch.setattr(run_dir, "_exchange", watched("exchange", run_dir._exchange))
    monkeypatch.setattr(run_dir.os, "replace", watched("replace", os.replace))
    monkeypatch.setattr(run_dir.shutil, "rmtree", watched("rmtree", shutil.rmtree))
    for version in range(1, 4):
        tmp.mkdir()
        (tmp / "complete").write_text(str(version))
        run_dir.swap_into_place(str(tmp), str(target))
        assert not tmp.exists() and (target / "complete").read_text() == str(version)
    assert "exchange" in operations and "replace" not in operations, operations
    assert not gaps, f"the target was missing after {gaps}"


@pytest.mark.parametrize("crash_after", [1, 2])
def test_where_folders_cannot_be_exchanged_a_crash_mid_swap_leaves_the_old_folder_at_target_old(
    crash_after, tmp_path, monkeypatch
):
    """The fallback (no renameat2 exchange: an older kernel, some network filesystems) renames the old
    folder to target.old, then the new one into place: a crash after either rename leaves a complete
    folder at the target or at target.old, nothing lost."""
    from common.outputs import run_dir

    target, tmp = tmp_path / "final", tmp_path / "final.tmp"
    for folder, version in ((target, "old"), (tmp, "new")):
        folder.mkdir()
        (folder / "complete").write_text(version)
    calls, replace = [], os.replace

    def crashing_replace(source, destination):
        replace(source, destination)
        calls.append(destination)
        if len(calls) == crash_after:
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(run_dir, "_exchange", lambda first, second: False)
    monkeypatch.setattr(run_dir.os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        run_dir.swap_into_place(str(tmp), str(target))
    left = {path.name: (path / "complete").read_text() for path in tmp_path.iterdir() if (path / "complete").exists()}
    assert left == (
        {"final.old": "old", "final.tmp": "new"} if crash_after == 1 else {"final.old": "old", "final": "new"}
    ), left


# --- what the train lines count (common.outputs.metrics, common.training.flops)
# ---------------------------------------------


def window_counts(batches, tmp_path, **record) -> dict:
    """One logging window over `batches` on a one-process CPU Accelerator: the train row's rates, and their
    common window seconds recovered from elapsed time (the rates' ratios are exact)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from common.outputs.metrics import MetricsLogger

    AcceleratorState._reset_state(True)
    try:
        os.makedirs(tmp_path, exist_ok=True)
        metrics = MetricsLogger(Accelerator(cpu=True), str(tmp_path), total_steps=1)
        for batch in batches:
            metrics.record_batch(torch.tensor(1.0), batch, **record)
        return metrics.log_train(1, 0.0, None)
    finally:
        AcceleratorState._reset_state(True)


def test_train_lines_count_input_tokens_label_tokens_and_examples_as_named(tmp_path):
    """Before, tokens_per_s counted the label tokens alone, samples_per_s a packed row as one sample and DPO's
    chosen and rejected rows apart. Now: tokens_per_s the input tokens without padding, label_tokens_per_s
    the labelled ones, samples_per_s the examples (4 conversations in one packed row; pairs where the
    recipe says so)."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    lengths, answers = [5, 9, 3, 7], [2, 4, 1, 3]
    features = [
        {"input_ids": list(range(1, n + 1)), "labels": [-100] * (n - a) + list(range(a))}
        for n, a in zip(lengths, answers)
    ]
    packed = DataCollatorWithFlattening(return_tensors="pt")(features)
    row = window_counts([packed], tmp_path / "packed")
    assert row["tokens_per_s"] / row["samples_per_s"] == pytest.approx(sum(lengths) / 4, rel=1e-9)
    assert row["label_tokens_per_s"] / row["samples_per_s"] == pytest.approx(sum(answers) / 4, rel=1e-9)

    class Tokenizer:  # what DataCollatorForSeq2Seq reads of one
        pad_token_id, padding_side = 0, "right"

        def pad(self, features, **kwargs):
            from transformers.tokenization_utils_base import BatchEncoding

            longest = max(len(f["input_ids"]) for f in features)
            return BatchEncoding(
                {
                    "input_ids": torch.tensor(
                        [f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features]
                    ),
                    "attention_mask": torch.tensor(
                        [[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"])) for f in features]
                    ),
                }
            )

    padded = DataCollatorForSeq2Seq(Tokenizer(), padding=True, label_pad_token_id=-100)(
        [{**f, "labels": list(f["labels"])} for f in features]
    )
    assert padded["input_ids"].numel() == 4 * 9  # 12 of the 36 positions are padding
    row = window_counts([padded], tmp_path / "padded")
    assert row["tokens_per_s"] / row["samples_per_s"] == pytest.approx(sum(lengths) / 4, rel=1e-9)
    pairs = window_counts([padded], tmp_path / "pairs", examples=2)  # DPO: two pairs in these four rows
    assert pairs["tokens_per_s"] / pairs["samples_per_s"] == pytest.approx(sum(lengths) / 2, rel=1e-9)


def test_dpo_flops_count_the_reference_models_forward():
    """A forward pass is a third of a training step's FLOPs with every weight trained (2N of 6N per token,
    and the attention's 4 of 12); DPO's train lines add one forward of the reference per batch (before, its
    FLOPs and MFU left it out)."""
    from common.training.flops import ModelFlops

    flops = ModelFlops(tiny_llama())
    batch = {"input_ids": torch.ones(2, 24, dtype=torch.long), "attention_mask": torch.ones(2, 24, dtype=torch.long)}
    batch["attention_mask"][1, 20:] = 0
    assert float(flops.per_batch(batch, forward_only=True)) * 3 == float(flops.per_batch(batch))


def test_evaluation_before_training_is_asked_for_and_its_figure_outlives_a_resume(
    arithmetic_data, tmp_path, monkeypatch, capsys
):
    """--eval_on_start (Trainer's name; off by default, as there): before, every run evaluated at step 0
    (68 s of an 11-minute SFT run), and a resumed run's summary lost its 'untrained ->' figure. SFT, one
    process in this one, packed, accumulation 2."""
    from conftest import flags, read_metrics, run_in_process

    def sft(out, **overrides):
        argv = flags(
            config=REPO / "recipes/configs/sft_demo.yaml",
            tokenizer_name_or_path=arithmetic_data / "tokenizer",
            train_file=arithmetic_data / "train.jsonl",
            validation_file=arithmetic_data / "validation.jsonl",
            output_dir=out,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=4,
            logging_steps=2,
            save_steps=2,
            max_eval_samples=8,
            max_generation_samples=2,
            max_new_tokens=2,
            **overrides,
        )
        return run_in_process("recipes/sft.py", argv, monkeypatch)

    plain = tmp_path / "plain"
    sft(plain, eval_on_start="false")
    assert [row["step"] for row in read_metrics(plain)[1]] == [4]  # the end's evaluation alone

    out = tmp_path / "run"
    sft(out)  # the demo YAML turns it on
    evals = read_metrics(out)[1]
    assert [row["step"] for row in evals] == [0, 4]
    capsys.readouterr()
    sft(out, resume_from_checkpoint=out / "checkpoints/step_2")
    assert f"exact match {evals[0]['eval_exact_match']:.3f} untrained -> " in capsys.readouterr().out
    assert [row["step"] for row in read_metrics(out)[1]] == [0, 4]  # step 0's kept, not run again


def test_a_tied_embeddings_checkpoint_saves_without_accelerates_shared_tensor_line_and_loads_back_tied(
    tmp_path, caplog
):
    """Qwen3 ties its embeddings: accelerate's own save_state warns "Removed shared tensor" on every save; the
    recipes' save leaves that line out, and the checkpoint loads back with both names the one trained tensor."""
    import logging

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.outputs.checkpoints import load_checkpoint, save_checkpoint

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_qwen3.json"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    with caplog.at_level(logging.WARNING):
        accelerator.save_state(str(tmp_path / "plain"))
        assert "Removed shared tensor" in caplog.text  # what the console showed on every save
        caplog.clear()
        path = save_checkpoint(accelerator, model, optimizer, scheduler, str(tmp_path / "run"), 3, {}, None)
    assert "Removed shared tensor" not in caplog.text, caplog.text
    trained = model.model.embed_tokens.weight.detach().clone()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    assert load_checkpoint(accelerator, path, model, optimizer, scheduler)["step"] == 3
    assert (
        torch.equal(model.model.embed_tokens.weight, trained)
        and model.lm_head.weight is model.model.embed_tokens.weight
    )
    AcceleratorState._reset_state(True)


def test_deepspeeds_cpu_shared_memory_all_reduce_is_neither_compiled_nor_loaded():
    """DeepSpeed's CPU backend would compile deepspeed_shm_comm at its first start on a machine (24 s on a 2-core host,
    a failed start without a compiler) for an all-reduce only its inference layers call: after the recipes' CPU-host
    setup its own loader (deepspeed.comm.torch.build_shm_op, which every DeepSpeed backend calls at start) gives none."""
    from deepspeed.comm.torch import build_shm_op

    from common.launch.accelerator import import_deepspeed
    from common.launch.cpu_host import skip_shm_comm_build

    import_deepspeed()
    skip_shm_comm_build()
    assert build_shm_op() is None
