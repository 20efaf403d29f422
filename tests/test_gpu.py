"""Behaviour that only a GPU shows. Skipped, with the reason, on hosts without CUDA."""

import pytest
import torch

from conftest import causal_lm_args, launch, losses, read_run

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")


@needs_gpu
@pytest.mark.parametrize("config", ["single.yaml", "fsdp.yaml", "zero3.yaml"])
def test_bf16_is_used_on_gpu(config, markov_data, tmp_path):
    """On a GPU the configs' bf16 is honoured with fp32 master weights, and training works."""
    processes = min(torch.cuda.device_count(), 2) if config != "single.yaml" else 1
    out = tmp_path / "run"
    launch(config, "causal_lm.py", causal_lm_args(markov_data, out, max_steps=20), num_processes=processes)
    record = read_run(out)
    assert record["participating_processes"] == processes
    assert record["device"].startswith("cuda")
    assert (record["compute_dtype"], record["master_weights_dtype"]) == ("bfloat16", "float32")
    assert losses(out)[-1] < losses(out)[0]
