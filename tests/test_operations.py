"""Operating a run: profiling a window of steps, restarts after a lost worker."""

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    FP32,
    OFFLINE_ENV,
    REPO,
    causal_lm_args,
    free_port,
    launch,
    launch_command,
    losses,
    max_weight_difference,
    read_metrics,
    read_run,
    two_machines,
)


def test_profile_steps_write_one_trace_per_rank_with_the_models_ops(copied_recipe_run):
    """ddp.yaml (bf16), 4 steps, --profile_steps 2-3: the run of causal_lm.py that test_causal_lm launches from a
    copy of the recipe (conftest.copied_recipe_run)."""
    _, out = copied_recipe_run
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


def worker_pid(rank: int, marker: str) -> int | None:
    """The pid of the recipe process with RANK=rank whose command line holds `marker`."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker in cmdline and "recipes/causal_lm.py" in cmdline and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_resumes_to_the_same_weights(markov_data, reference, tmp_path):
    """`make causal_lm LAUNCH_ARGS="--max_restarts 2"` (ddp, 2 processes, fp32) over an earlier run's
    checkpoint (step_11), as the make target runs it: --overwrite_output_dir. Rank 1 is killed (SIGKILL)
    twice: while starting up, before the earlier run is cleared, and once the new run's step-2
    checkpoint exists. torchrun restarts both workers each time. After the first kill they must start
    afresh as the first attempt did, not resume the earlier run's step_11 (which would not load: it
    holds only its trainer_state.json); after the second they resume from the latest checkpoint by
    themselves (the command still says --overwrite_output_dir). The final weights equal an
    uninterrupted run's (the one-process reference, global batch 8)."""
    out = tmp_path / "run"
    earlier = out / "checkpoints/step_11"
    earlier.mkdir(parents=True)
    (earlier / "trainer_state.json").write_text(json.dumps({"step": 11}))
    args = causal_lm_args(markov_data, out, per_device_train_batch_size=4, save_steps=2, save_total_limit=2)
    command = [
        "make",
        "causal_lm",
        "CONFIG=accelerate_configs/ddp.yaml",
        f"LAUNCH_ARGS=--max_restarts 2 --mixed_precision no --main_process_port {free_port()}",
        "ARGS=" + " ".join(args[2:]),
    ]  # the recipe YAML comes from the make target
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, **OFFLINE_ENV},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    killed = []
    deadline = time.time() + 300
    while len(killed) < 2 and process.poll() is None and time.time() < deadline:
        starting = not killed and (out / ".launch_starting").exists() and not (out / "run.json").exists()
        trained = killed and (out / "checkpoints/step_2").exists()
        if (starting or trained) and (pid := worker_pid(1, str(out))) and pid not in killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.005)
    output = process.communicate(timeout=600)[0]
    assert len(killed) == 2 and process.returncode == 0, output[-4000:]
    assert "restart 1 of at most 2: the first attempt ended before it started training: starting as it did" in output
    restarted = re.search(r"restart 2 of at most 2: resuming from the latest checkpoint", output)
    resumed = re.search(r"resumed from \S+/step_(\d+) at step (\d+)", output)
    assert restarted and resumed, output[-4000:]
    assert "connect to the dead ones' addresses" not in output  # make chose a fresh store per attempt
    print(f"killed rank 1 (pids {killed}) at start-up and after step 2; restarted from step {resumed.group(2)}")
    assert int(resumed.group(2)) < 12
    assert [row["step"] for row in read_metrics(out)[0]] == list(range(1, 13))  # each step logged once
    gap = max_weight_difference(out / "final", reference / "final")
    print(f"final weights vs the uninterrupted reference: max gap {gap:.2e}")
    assert gap < 1e-5


@pytest.mark.slow
def test_a_hung_peer_ends_the_run_within_the_timeout_with_one_line(markov_data, tmp_path):
    """ddp.yaml, 2 processes, --ddp_timeout 10: rank 1 is frozen (SIGSTOP: alive, silent, like a
    node whose link went down) mid-run. Rank 0 gives up within the timeout plus a margin and
    prints one line naming the lost peer and what to check; the launch exits non-zero."""
    out = tmp_path / "run"
    args = causal_lm_args(markov_data, out, max_steps=100000, logging_steps=1, ddp_timeout=10)
    process = subprocess.Popen(
        launch_command("ddp.yaml", "causal_lm.py", args),
        cwd=REPO,
        env={**os.environ, **OFFLINE_ENV},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines = []  # (time seen, line), read as the launch prints them
    reader = threading.Thread(target=lambda: [lines.append((time.time(), line)) for line in process.stdout])
    reader.start()
    frozen = None
    deadline = time.time() + 300
    while frozen is None and process.poll() is None and time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3 and (pid := worker_pid(1, str(out))):
            os.kill(pid, signal.SIGSTOP)
            frozen, stopped_at = pid, time.time()
        time.sleep(0.01)
    while frozen and time.time() < stopped_at + 120 and not any(l.startswith("error:") for _, l in lines):
        time.sleep(0.1)
    if frozen and Path(f"/proc/{frozen}").exists():  # spare torchrun's 30 s grace period for the frozen rank
        os.kill(frozen, signal.SIGKILL)
    process.wait(timeout=120)
    reader.join()
    output = "".join(line for _, line in lines)
    errors = [(seen, line.strip()) for seen, line in lines if line.startswith("error:")]
    assert frozen and process.returncode != 0 and len(errors) == 1, output[-4000:]
    after = errors[0][0] - stopped_at
    print(f"rank 1 frozen; rank 0's error came {after:.1f} s later, exit {process.returncode}: {errors[0][1]}")
    assert after < 10 + 15  # the timeout, plus slack for a busy machine
    assert re.search(
        r"lost contact with rank 1 \(the main node is 127\.0\.0\.1:\d+\) during a collective on rank 0 "
        r".*(Timed out waiting 10000ms|Application timeout caused pair closure).*--ddp_timeout 10 s",
        errors[0][1],
    ), errors[0][1]  # gloo's two timeout texts: the op that timed out, or one beside it


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_cut_link_is_reported_on_both_nodes_and_the_run_resumes_once_it_is_back(
    two_hosts, markov_data, reference, tmp_path
):
    """multi_node_ddp.yaml across two hosts (network namespaces with their own hostnames over a
    veth pair), one process each, fp32, --ddp_timeout 10, launched as make launches with
    --max_restarts 3 (c10d rendezvous, a fresh store per attempt). The link is taken down once
    the step-2 checkpoint exists: both nodes print one line naming the other rank within the
    timeout plus a margin. The link comes back; torchrun restarts the workers, they resume from
    the latest checkpoint, and the final weights equal an uninterrupted run's (one process, the
    same global batch)."""
    out, port = tmp_path / "run", free_port()
    args = causal_lm_args(markov_data, out, per_device_train_batch_size=4, save_steps=2, ddp_timeout=10)
    lines, processes = ([], []), []
    for host in (0, 1):
        command, env = two_hosts.command(
            host,
            launch_command(
                "multi_node_ddp.yaml",
                "causal_lm.py",
                args,
                [
                    *two_machines(host, two_hosts.addresses[0], port),
                    *FP32,
                    "--max_restarts",
                    "3",
                    "--rdzv_backend",
                    "c10d",
                ],
            ),
            own_hostname=True,
        )
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env={**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        threading.Thread(
            target=lambda p=process, seen=lines[host]: [seen.append((time.time(), line)) for line in p.stdout],
            daemon=True,
        ).start()
        processes.append(process)
    deadline = time.time() + 300
    while (
        time.time() < deadline
        and all(p.poll() is None for p in processes)
        and not (out / "checkpoints/step_2").exists()
    ):
        time.sleep(0.01)
    two_hosts.set_link(1, "down")
    cut = time.time()

    def errors(host):
        return [(seen - cut, line.strip()) for seen, line in lines[host] if line.startswith("error:")]

    while time.time() < cut + 60 and not (errors(0) and errors(1)):
        time.sleep(0.1)
    two_hosts.set_link(1, "up")
    for process in processes:
        process.wait(timeout=300)
    outputs = ["".join(line for _, line in seen) for seen in lines]
    for host in (0, 1):
        first = errors(host)[0] if errors(host) else (None, outputs[host][-4000:])
        print(f"node {host}: error {first[0]:.1f} s after the cut: {first[1][:160]}")
        assert first[0] < 10 + 15, first
        assert re.search(
            rf"lost contact with rank {1 - host} \(the main node is \S+\) during a collective on rank "
            rf"{host} \(host {two_hosts.hostnames[host]}\).*--ddp_timeout 10 s",
            first[1],
        ), first[1]
        assert processes[host].returncode == 0, outputs[host][-4000:]
    resumed = re.search(r"resumed from \S+/step_(\d+) at step (\d+)", outputs[0])
    assert resumed and int(resumed.group(2)) < 12, outputs[0][-4000:]
    assert [row["step"] for row in read_metrics(out)[0]] == list(range(1, 13))  # each step logged once
    assert read_run(out)["participating_processes"] == 2
    gap = max_weight_difference(out / "final", reference / "final")
    print(
        f"{outputs[0].count('resumed from')} restart(s); resumed at step {resumed.group(2)} once the link was back; "
        f"final weights vs the uninterrupted "
        f"reference: max gap {gap:.2e}"
    )
    assert gap < 1e-5


@pytest.mark.slow
@pytest.mark.exhaustive
def test_auto_find_batch_size_halves_on_a_real_out_of_memory_and_keeps_the_global_batch(markov_data, tmp_path):
    """ddp, 2 processes, a small Llama on 256-token blocks (activations dominate), each process's data
    limited to 1.75 GiB (prlimit --data): the asked per-device batch of 64 runs out of memory for real
    (torch's CPU allocator fails), the finder settles on a divisor and raises accumulation, and the run then trains exactly as
    one launched with that batch and accumulation by hand. glibc's mmap threshold is fixed for the test:
    by default it rises after the first large free and later tensors come from a heap that keeps its
    size, so the limit would count memory the trial freed (a CPU allocator artefact; on a GPU torch's
    caching allocator reuses it, tests/test_gpu.py)."""
    import shutil

    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("needs prlimit (util-linux) to cap the processes' memory")
    config = json.loads((REPO / "recipes/configs/tiny_llama.json").read_text())
    config.update(hidden_size=128, intermediate_size=256, num_hidden_layers=4, max_position_embeddings=256)
    (tmp_path / "llama.json").write_text(json.dumps(config))
    common = dict(model_config=tmp_path / "llama.json", block_size=256, max_steps=2, per_device_eval_batch_size=2)
    found = tmp_path / "found"
    command = launch_command(
        "ddp.yaml",
        "causal_lm.py",
        causal_lm_args(markov_data, found, per_device_train_batch_size=64, gradient_accumulation_steps=1, **common)
        + ["--auto_find_batch_size", "true"],
        FP32,
    )
    result = subprocess.run(
        [prlimit, f"--data={int(1.75 * 2**30)}", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE_ENV, "MALLOC_MMAP_THRESHOLD_": "131072"},
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    chosen = re.search(
        r"auto_find_batch_size: per-device batch 64(, \d+)* ran out of memory; training with (\d+) x "
        r"gradient_accumulation_steps (\d+) per process",
        output,
    )
    assert chosen, output[-4000:]
    batch, accumulation = int(chosen.group(2)), int(chosen.group(3))
    print(chosen.group(0))
    assert batch < 64 and batch * accumulation == 64
    record = read_run(found)
    assert record["participating_processes"] == 2
    assert (record["args"]["per_device_train_batch_size"], record["args"]["gradient_accumulation_steps"]) == (
        batch,
        accumulation,
    )
    by_hand = tmp_path / "by_hand"
    launch(
        "ddp.yaml",
        "causal_lm.py",
        causal_lm_args(
            markov_data, by_hand, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, **common
        ),
        launcher_args=FP32,
    )
    assert losses(found) == pytest.approx(losses(by_hand), abs=1e-6) and len(losses(found)) == 2


@pytest.mark.slow
@pytest.mark.exhaustive
def test_max_restarts_without_a_fresh_rendezvous_store_is_refused_in_one_line(markov_data, tmp_path):
    """`accelerate launch --config_file ddp.yaml --max_restarts 1` as a user types it (no rendezvous
    flags, which make adds): restarted workers could hang, so the run is refused at once, with one
    line that gives the command that works; nothing is trained, and the launch ends."""
    out = tmp_path / "run"
    started = time.monotonic()
    result = launch(
        "ddp.yaml",
        "causal_lm.py",
        causal_lm_args(markov_data, out),
        check=False,
        launcher_args=["--max_restarts", "1"],
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"},
    )
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, (result.stdout + result.stderr)[-3000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 accelerate launch --rdzv_backend c10d --max_restarts 1" in errors[0]
    assert not (out / "run.json").exists() and time.monotonic() - started < 120
