"""The speed options (common/speed.py) on this host: refused in one line where they cannot run,
the attention kernel chosen and recorded, activation checkpointing per N layers, and regional
compile + foreach AdamW + checkpointing training as the defaults do (2 processes, bf16,
accumulation). Their GPU side is in tests/test_gpu.py."""

import pytest
import torch

from common.arguments import TrainingArguments
from common.errors import UsageError
from conftest import REPO, causal_lm_args, launch, losses, read_run

TINY = str(REPO / "recipes/configs/tiny_llama.json")


@pytest.mark.parametrize("options, message", [
    ({"use_liger_kernel": True}, "Liger's kernels are Triton GPU kernels"),
    ({"attn_implementation": "flex_attention"}, "flex_attention has no backward on CPU"),
    ({"attn_implementation": "flash_attention_2"}, "needs an NVIDIA GPU and the flash-attn package"),
    ({"attn_implementation": "flash"}, "--attn_implementation must be one of auto, sdpa"),
    ({"optim": "adamw_8bit"}, "--optim must be one of adamw_torch_fused, adamw_torch"),
    ({"gradient_checkpointing_every_n_layers": 2}, "add --gradient_checkpointing true"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_every_n_layers": 0}, "must be at least 1"),
])
def test_an_option_this_host_cannot_run_is_refused_in_one_line(options, message):
    if torch.cuda.is_available() and "GPU" in message:
        pytest.skip("this host has a GPU, where the option runs (tests/test_gpu.py)")
    with pytest.raises(UsageError) as refused:
        TrainingArguments(**options)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choice; the GPU's is in tests/test_gpu.py")
def test_auto_attention_on_cpu_is_per_example_sdpa_for_packed_rows_and_the_models_own_otherwise():
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.speed import prepare_model, speed_record

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

    from common.speed import checkpointed_layers, prepare_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY, vocab_size=64, num_hidden_layers=4))
    speed = {} if every_n_layers is None else {"gradient_checkpointing": True,
                                               "gradient_checkpointing_every_n_layers": every_n_layers}
    prepare_model(model, TrainingArguments(**speed)).train()
    expected = [False] * 4 if every_n_layers is None else [i % every_n_layers == 0 for i in range(4)]
    assert checkpointed_layers(model) == expected
    saved = []
    tokens = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
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
def test_regional_compile_foreach_adamw_and_partial_checkpointing_train_as_the_defaults(markov_data, tmp_path):
    """ddp.yaml, 2 processes, bf16, accumulation 2: --torch_compile true --optim adamw_torch
    --gradient_checkpointing true --gradient_checkpointing_every_n_layers 2 give the default run's losses (to
    bf16's rounding of different kernels), and run.json says what ran."""
    common = dict(max_steps=8, gradient_accumulation_steps=2, per_device_train_batch_size=2, logging_steps=1)
    plain, fast = tmp_path / "plain", tmp_path / "fast"
    launch("ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, plain, **common))
    launch("ddp.yaml", "causal_lm.py", causal_lm_args(
        markov_data, fast, torch_compile="true", optim="adamw_torch", gradient_checkpointing="true",
        gradient_checkpointing_every_n_layers=2, **common))
    for out in (plain, fast):
        assert read_run(out)["participating_processes"] == 2 and read_run(out)["mixed_precision"] == "bf16"
    assert read_run(plain)["speed"] == {"attention": "sdpa", "torch_compile": "off", "optim": "adamw_torch_fused",
                                        "checkpointed_layers": "0 of 2", "liger_kernel": False}
    assert read_run(fast)["speed"] == {"attention": "sdpa", "torch_compile": "regional (inductor)",
                                       "optim": "adamw_torch", "checkpointed_layers": "1 of 2", "liger_kernel": False}
    gaps = [abs(a - b) for a, b in zip(losses(plain), losses(fast))]
    print(f"losses {losses(plain)} vs {losses(fast)}: largest gap {max(gaps):.2e}")
    assert len(gaps) == 8 and max(gaps) < 2e-3
    assert losses(fast)[-1] < losses(fast)[0]
