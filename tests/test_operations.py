"""Operating a run: profiling a window of steps."""

import json

from conftest import causal_lm_args, launch, read_run


def test_profile_steps_write_one_trace_per_rank_with_the_models_ops(markov_data, tmp_path):
    out = tmp_path / "run"
    launch("ddp.yaml", "causal_lm.py", causal_lm_args(markov_data, out, max_steps=4, profile_steps="2-3"))
    assert read_run(out)["participating_processes"] == 2
    traces = sorted((out / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"], traces
    for trace in traces:
        names = {event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
        # the Llama's forward and backward matmuls, its attention, AdamW, and DDP's gradient all-reduce
        for op in ("aten::mm", "MmBackward0", "aten::scaled_dot_product_attention", "Optimizer.step#AdamW.step"):
            assert any(op in name for name in names), (trace.name, op)
        assert any("all_reduce" in name for name in names), trace.name
