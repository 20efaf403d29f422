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


@needs_gpu
def test_gpu_metrics_report_mfu_memory_and_a_profile_with_kernels(markov_data, tmp_path):
    """On a GPU in the peak table (H100, H200, A100, ...) MFU is logged; memory allocated and reserved are
    logged; the profile of a window of steps holds the CUDA kernels the steps ran."""
    import json

    from conftest import read_metrics

    out = tmp_path / "run"
    launch("single.yaml", "causal_lm.py", causal_lm_args(markov_data, out, max_steps=6, profile_steps="3-4"))
    row = read_metrics(out)[0][-1]
    print({k: row[k] for k in ("tokens_per_s_per_device", "tflops_per_device", "mfu", "data_wait_fraction",
                               "memory_allocated_mb_per_rank", "memory_reserved_mb_per_rank")})
    assert 0 < row["mfu"] < 1 and row["tflops_per_device"] > 0
    assert row["memory_reserved_mb_per_rank"][0] >= row["memory_allocated_mb_per_rank"][0] > 0
    trace = next((out / "profile").glob("rank0*.pt.trace.json"))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    print(f"{len(kernels)} CUDA kernel events in the trace of steps 3-4")
    assert kernels and any("gemm" in e["name"].lower() or "sm90" in e["name"].lower() for e in kernels)
