"""The speed options (common/training/speed.py) on this host: refused in one line where they cannot run,
the attention kernel chosen and recorded, activation checkpointing per N layers, and regional
compile + foreach AdamW + checkpointing training as the defaults do (2 processes, bf16,
accumulation). Their GPU side is in tests/test_gpu.py."""

import pytest
import torch
from conftest import REPO, causal_lm_args, launch, losses, read_run

from common.launch.errors import UsageError
from common.options.arguments import TrainingArguments


TINY = str(REPO / "recipes/configs/tiny_llama.json")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"use_liger_kernel": True}, "Liger's kernels are Triton GPU kernels"),
        ({"attn_implementation": "flex_attention"}, "flex_attention has no backward on CPU"),
        ({"attn_implementation": "flash_attention_2"}, "needs an NVIDIA GPU and the flash-attn package"),
        ({"attn_implementation": "flash"}, "--attn_implementation must be one of auto, sdpa"),
        ({"optim": "adamw_8bit"}, "--optim must be one of adamw_torch_fused, adamw_torch"),
        ({"gradient_checkpointing_every_n_layers": 2}, "add --gradient_checkpointing true"),
        ({"gradient_checkpointing": True, "gradient_checkpointing_every_n_layers": 0}, "must be at least 1"),
    ],
)
def test_an_option_this_host_cannot_run_is_refused_in_one_line(options, message):
    if torch.cuda.is_available() and "GPU" in message:
        pytest.skip("this host has a GPU, where the option runs (tests/test_gpu.py)")
    with pytest.raises(UsageError) as refused:
        TrainingArguments(**options)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choice; the GPU's is in tests/test_gpu.py")
def test_auto_attention_on_cpu_is_per_example_sdpa_for_packed_rows_and_the_models_own_otherwise():
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.training.speed import prepare_model, speed_record

    def attention(packed_rows, **speed):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY, vocab_size=64))
        return speed_record(prepare_model(model, TrainingArguments(**speed), packed_rows), TrainingArguments(**speed))

    assert attention(False)["attention"] == "sdpa"
    assert attention(True)["attention"] == "sdpa_varlen"
    assert attention(True, attn_implementation="eager")["attention"] == "eager"
    assert attention(False, attn_implementation="sdpa_varlen")["attention"] == "sdpa_varlen"


def _saved_activation_bytes(every_n_layers: int | None) -> tuple[int, float]:
    """Bytes kept for the backward by one training forward of a 4-layer Llama, and its loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.training.speed import checkpointed_layers, prepare_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY, vocab_size=64, num_hidden_layers=4))
    speed = (
        {}
        if every_n_layers is None
        else {"gradient_checkpointing": True, "gradient_checkpointing_every_n_layers": every_n_layers}
    )
    prepare_model(model, TrainingArguments(**speed)).train()
    expected = [False] * 4 if every_n_layers is None else [i % every_n_layers == 0 for i in range(4)]
    assert checkpointed_layers(model) == expected
    saved = []
    tokens = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
    ):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return sum(saved), loss.item()


def test_checkpointing_every_other_layer_keeps_about_half_of_what_full_checkpointing_saves():
    """Activations kept for the backward: none checkpointed > every other layer > every layer, and
    the loss is the same whichever layers are recomputed."""
    (plain, loss), (half, half_loss), (full, full_loss) = (_saved_activation_bytes(n) for n in (None, 2, 1))
    print(f"saved for the backward: plain {plain} B, every other layer {half} B, every layer {full} B")
    assert plain > half > full
    # Half the layers keep their activations: the saving is about half the full saving.
    assert (plain - half) == pytest.approx((plain - full) / 2, rel=0.15)
    assert loss == half_loss == full_loss


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.bf16
def test_regional_compile_foreach_adamw_and_partial_checkpointing_train_as_the_defaults(markov_data, tmp_path):
    """ddp.yaml, 2 processes, bf16, accumulation 2: --torch_compile true --optim adamw_torch
    --gradient_checkpointing true --gradient_checkpointing_every_n_layers 2 give the default run's losses (to
    bf16's rounding of different kernels), and run.json says what ran."""
    common = dict(max_steps=8, gradient_accumulation_steps=2, per_device_train_batch_size=2, logging_steps=1)
    plain, fast = tmp_path / "plain", tmp_path / "fast"
    launch("ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, plain, **common))
    launch(
        "ddp.yaml",
        "causal_lm.py",
        causal_lm_args(
            markov_data,
            fast,
            torch_compile="true",
            optim="adamw_torch",
            gradient_checkpointing="true",
            gradient_checkpointing_every_n_layers=2,
            **common,
        ),
    )
    for out in (plain, fast):
        assert read_run(out)["participating_processes"] == 2 and read_run(out)["mixed_precision"] == "bf16"
    assert read_run(plain)["speed"] == {
        "attention": "sdpa",
        "torch_compile": "off",
        "optim": "adamw_torch_fused",
        "checkpointed_layers": "0 of 2",
        "liger_kernel": False,
        "float8_linear_layers": 0,
    }
    assert read_run(fast)["speed"] == {
        "attention": "sdpa",
        "torch_compile": "regional (inductor)",
        "optim": "adamw_torch",
        "checkpointed_layers": "1 of 2",
        "liger_kernel": False,
        "float8_linear_layers": 0,
    }
    gaps = [abs(a - b) for a, b in zip(losses(plain), losses(fast))]
    print(f"losses {losses(plain)} vs {losses(fast)}: largest gap {max(gaps):.2e}")
    assert len(gaps) == 8 and max(gaps) < 2e-3
    assert losses(fast)[-1] < losses(fast)[0]


@pytest.mark.parametrize(
    "capability, torchao, backend, strategy, ram_efficient, message",
    [
        ((8, 0), True, "ao", "ddp", False, "this GPU's is 8.0 (accelerate would quietly train in fp16 instead)"),
        ((9, 0), True, "te", "ddp", False, "fp8_backend te: these recipes train fp8 through torchao"),
        ((9, 0), False, "ao", "ddp", False, "torchao, which is not installed: pip install torchao"),
        ((9, 0), True, "ao", "deepspeed", False, "under DeepSpeed is not checked"),
        ((9, 0), True, "ao", "fsdp", True, "launch with --fsdp_cpu_ram_efficient_loading false"),
        ((9, 0), True, "ao", "tp", False, "under tensor parallelism (tp_size 2) does not run with torchao"),
        ((9, 0), True, "ao", "fsdp x tp", False, "under tensor parallelism (tp_size 2) does not run with torchao"),
        ((9, 0), True, "", "fsdp", False, None),  # an H100; no --fp8_backend: accelerate picks torchao
        (None, True, "AO", "ddp", False, None),  # a CPU runs torchao's float8 matmuls too (the test below)
    ],
)
def test_fp8_where_it_cannot_run_is_one_line(capability, torchao, backend, strategy, ram_efficient, message):
    from common.training.speed import fp8_problem

    tp_size = 2 if strategy.endswith("tp") else 1  # tp.yaml, fsdp_tp.yaml
    problem = fp8_problem(capability, torchao, backend, strategy.split()[0], ram_efficient, tp_size)
    assert problem == message if message is None else (message in problem and "\n" not in problem)


def test_the_recipe_refuses_fp8_it_cannot_run_before_anything_starts(markov_data, tmp_path, monkeypatch, capsys):
    """A plain `python recipe.py` reads accelerate's launch settings from the environment, as a launched one does:
    its command line run in this process (test_bad_input.error_in_process: run_recipe, exit 2) with them set."""
    from test_bad_input import error_in_process

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "te")
    line = error_in_process("causal_lm.py", causal_lm_args(markov_data, tmp_path / "run"), capsys)
    assert line.startswith("error: fp8_backend te: "), line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.bf16
@pytest.mark.parametrize(
    "config,extra",
    [
        pytest.param("ddp.yaml", [], marks=pytest.mark.exhaustive),
        ("fsdp.yaml", ["--fsdp_cpu_ram_efficient_loading", "false"]),
    ],
)
def test_fp8_through_torchao_trains_resumes_and_exports_on_two_processes(
    config, extra, markov_data, bf16_checkpoint, tmp_path
):
    """`accelerate launch --mixed_precision fp8 --fp8_backend ao` on 2 processes under fsdp.yaml (FSDP2's float8
    all-gather; ddp.yaml in make test-all), continuing a bf16 checkpoint with accumulation 2: accelerate swapped torchao's
    Float8Linear into each linear layer but the first and last (run.json counts them), the losses differ from
    bf16's (the float8 matmuls ran; this CPU runs them too) but follow them, the step-3 checkpoint resumes to the
    same losses (torchao's dynamic scales hold no state) and the export is a plain bf16 checkpoint. The GPU's
    run is in tests/test_gpu.py."""
    import json

    from conftest import pretrained_args, resume_elsewhere
    from transformers import AutoModelForCausalLM

    pytest.importorskip("torchao", reason="torchao is in the test extras: make install-test")
    fp8 = ["--mixed_precision", "fp8", "--fp8_backend", "ao"]

    def args(out, **overrides):
        return pretrained_args(
            markov_data,
            bf16_checkpoint,
            out,
            **{
                "max_steps": 6,
                "save_steps": 3,
                "gradient_accumulation_steps": 2,
                "per_device_train_batch_size": 2,
                **overrides,
            },
        )

    bf16 = tmp_path / "bf16"
    launch("ddp.yaml", "causal_lm.py", args(bf16), num_processes=2)
    launcher_args = fp8 + extra
    out, stopped = tmp_path / config / "run", tmp_path / config / "stopped"
    launch(config, "causal_lm.py", args(out), num_processes=2, launcher_args=launcher_args)
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["mixed_precision"] == "fp8"
    assert record["speed"]["float8_linear_layers"] == 7 * 2 - 1  # q, k, v, o, gate, up, down; not lm_head
    gaps = [abs(a - b) / b for a, b in zip(losses(out), losses(bf16))]
    resume_elsewhere(
        out,
        stopped,
        3,
        2,
        config,
        "causal_lm.py",
        lambda **resume: args(stopped, **resume),
        accumulation=2,
        launcher_args=launcher_args,
    )
    resumed = [abs(a - b) for a, b in zip(losses(out)[3:], losses(stopped))]
    print(
        f"fp8 {config}: losses {losses(out)}, bf16 {losses(bf16)}; relative gaps {max(gaps):.2e} (largest), "
        f"resumed at step 3: largest gap {max(resumed):.2e}"
    )
    assert len(gaps) == 6 and 0 < max(gaps) < 0.05, (losses(out), losses(bf16))
    assert len(resumed) == 3 and max(resumed) < 1e-6
    final = out / "final"
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    model, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not info["missing_keys"] and not info["unexpected_keys"], info
