"""Two "machines" on loopback, and the SLURM batch script with faked SLURM variables (running HSDP)."""

import json
import os
import re
import stat
import subprocess
import threading
import time

import pytest
from conftest import (
    BIN,
    FP32,
    OFFLINE_ENV,
    REPO,
    causal_lm_args,
    free_port,
    launch_command,
    launch_one_process,
    losses,
    read_metrics,
    read_run,
    tiered,
    two_machines,
)


TEMPLATES = {"multi_node_ddp.yaml": "MULTI_CPU", "multi_node_fsdp.yaml": "FSDP", "multi_node_zero3.yaml": "DEEPSPEED"}


def wait_all(processes, timeout=600):
    """Read every node's output at the same time: reading them one after another lets a later
    node fill its pipe and block inside a collective, which hangs the node being read too."""
    outputs = [None] * len(processes)

    def read(index):
        try:
            outputs[index] = processes[index].communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            outputs[index] = None

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(processes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if any(out is None for out in outputs):
        for p in processes:
            p.kill()
        raise AssertionError("a node hung (did two nodes claim the same machine_rank?)")
    for process, out in zip(processes, outputs):
        assert process.returncode == 0, out[-6000:]
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("config", tiered(sorted(TEMPLATES), ["multi_node_zero3.yaml"]))  # fsdp: the SLURM test's
def test_two_machines_on_loopback_match_one_process(config, markov_data, reference, tmp_path):
    out, port = tmp_path / "run", free_port()
    args = causal_lm_args(markov_data, out, per_device_train_batch_size=4, max_steps=12)
    nodes = [
        subprocess.Popen(
            launch_command(
                config,
                "causal_lm.py",
                args,
                [*two_machines(rank, "127.0.0.1", port), *FP32],
            ),
            cwd=REPO,
            env={**os.environ, **OFFLINE_ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    logs = wait_all(nodes)
    print(f"{config}: node output {[len(log) for log in logs]} characters")
    # The second node says where the first node's tokenized cache is, and that it must be shared.
    assert "note: the first node tokenized into" in logs[1] and "note: the first node" not in logs[0]
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["distributed_type"] == TEMPLATES[config]
    gap = max(abs(a - b) for a, b in zip(losses(out), losses(reference)))
    print(f"{config} on 2 loopback machines: max loss gap to one process {gap:.2e}")
    assert len(losses(out)) == 12 and gap < 1e-5


FAKE_SRUN = """#!/bin/bash
# Stand-in for srun: start the command once per node, each with its own SLURM_NODEID.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def run_slurm_job(config: str, args: list, tmp_path) -> str:
    """scripts/slurm/train.sbatch with `config` on 2 fake nodes x 2 processes (loopback); its output."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in {"srun": FAKE_SRUN, "scontrol": "#!/bin/bash\necho 127.0.0.1\necho 127.0.0.1\n"}.items():
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(stat.S_IRWXU)
    env = {
        **os.environ,
        **OFFLINE_ENV,
        "PATH": f"{fake_bin}:{OFFLINE_ENV['PATH']}",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "GPUS_PER_NODE": "2",
        "MAIN_PROCESS_PORT": str(free_port()),
        "ACCELERATE": str(BIN / "accelerate"),
    }
    env.pop("SLURM_NODEID", None)
    process = subprocess.Popen(
        ["bash", "scripts/slurm/train.sbatch", f"accelerate_configs/{config}", *FP32, "recipes/causal_lm.py", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = wait_all([process])[0]
    assert "machine_rank=0 of 2, 2 processes" in log and "machine_rank=1 of 2, 2 processes" in log, log[-4000:]
    return log


@pytest.mark.slow
@pytest.mark.exhaustive
def test_slurm_batch_script_runs_hsdp_on_two_fake_nodes_of_two_processes(markov_data, reference, tmp_path):
    """scripts/slurm/train.sbatch with multi_node_hsdp.yaml on 2 fake nodes x 2 processes (loopback):
    the script sets the mesh from the job (dp_replicate = nodes, dp_shard = GPUs per node), so the
    parameters are sharded over a node's 2 processes (each rank holds half, not a quarter) and
    replicated across the nodes, and the run trains the same model as one process (4 ranks x 2)."""
    out = tmp_path / "run"
    run_slurm_job(
        "multi_node_hsdp.yaml", causal_lm_args(markov_data, out, per_device_train_batch_size=2, max_steps=12), tmp_path
    )
    record = read_run(out)
    assert record["participating_processes"] == 4 and record["distributed_type"] == "FSDP"
    assert record["device_mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    total, local = record["total_parameters"], record["local_parameter_elements"]
    assert all(0.45 * total <= n <= 0.55 * total for n in local), (local, total)
    gap = max(abs(a - b) for a, b in zip(losses(out), losses(reference)))
    print(
        f"HSDP, 2 fake SLURM nodes x 2 processes: local parameter elements {local} of {total}, "
        f"max loss gap to one process {gap:.2e}"
    )
    assert len(losses(out)) == 12 and gap < 1e-5


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("config", ["dp_pp.yaml", "pp.yaml"])
def test_slurm_batch_script_runs_a_pipeline_in_each_node_replicated_across_nodes(
    config, markov_data, reference, tmp_path
):
    """A pipeline config through train.sbatch on 2 fake nodes x 2 processes: no HSDP sizes added, each node one
    2-stage pipeline (its ranks consecutive), the nodes its data-parallel replicas, and the same losses as one
    process of the same global batch (2 replicas x 4)."""
    out = tmp_path / "run"
    run_slurm_job(config, causal_lm_args(markov_data, out, per_device_train_batch_size=4, max_steps=12), tmp_path)
    record = read_run(out)
    assert record["participating_processes"] == 4 and record["pipeline"]["replicas"] == 2
    assert [stage["rank"] for stage in record["pipeline"]["stages"]] == [0, 1]
    gap = max(abs(a - b) for a, b in zip(losses(out), losses(reference)))
    print(f"{config}, 2 fake SLURM nodes x 2 processes (a pipeline per node): max loss gap to one process {gap:.2e}")
    assert len(losses(out)) == 12 and gap < 1e-5


@pytest.mark.slow
@pytest.mark.exhaustive
def test_slurm_batch_script_splits_the_experts_within_each_node_and_shards_them_across_nodes(markov_data, tmp_path):
    """fsdp_ep.yaml through train.sbatch on 2 fake nodes x 2 processes: no replicas added, each node's pair of ranks
    splits the tiny MoE's 8 experts (4 each, its all-to-alls within the node) and each expert is sharded across the
    two nodes, and the run trains as one process on the same 2-row micro-batches (4 ranks x 2 rows against 2 rows x
    accumulation 4): the same losses, aux losses and experts' load (fp32)."""
    moe = dict(model_config=REPO / "recipes/configs/tiny_qwen3_moe.json", per_device_train_batch_size=2, max_steps=6)
    out, one = tmp_path / "run", tmp_path / "one"
    run_slurm_job("fsdp_ep.yaml", causal_lm_args(markov_data, out, **moe), tmp_path)
    launch_one_process("causal_lm.py", causal_lm_args(markov_data, one, gradient_accumulation_steps=4, **moe), FP32)
    record = read_run(out)
    assert record["participating_processes"] == 4 and record["device_mesh"] == {"dp_shard": 4}
    assert record["experts"]["ep_size"] == 2 and record["experts"]["expert_shards"] == 2
    rows, reference = (read_metrics(run)[0] for run in (out, one))
    figures = ("loss", "aux_loss", "expert_load_max_over_mean")
    gap = max(abs(a[f] - b[f]) / abs(b[f]) for a, b in zip(rows, reference, strict=True) for f in figures)
    print(f"fsdp_ep.yaml, 2 fake SLURM nodes x 2 processes: largest relative gap to one process {gap:.2e}")
    assert len(rows) == 6 and gap < 1e-5


@pytest.mark.parametrize(
    "config, gpus, expected",
    [
        ("dp_pp.yaml", 2, r"launch --config_file accelerate_configs/dp_pp.yaml --num_machines 2 --machine_rank 0 "
         r"--num_processes 4 --main_process_ip"),
        ("pp.yaml", 4, r"--num_processes 8 --main_process_ip"),
        ("multi_node_hsdp.yaml", 2, r"--num_processes 4 --parallelism_config_dp_replicate_size 2 "
         r"--parallelism_config_dp_shard_size 2 --main_process_ip"),
        ("dp_pp.yaml", 3, r"^error: accelerate_configs/dp_pp.yaml: parallelism_config_pp_size 2 does not divide the 3 "
         r"processes of a node: a pipeline stays within a node; .*$"),
        ("fsdp_ep.yaml", 4, r"--num_processes 8 --parallelism_config_dp_shard_size 8 --main_process_ip"),
        ("fsdp_ep.yaml", 3, r"^error: accelerate_configs/fsdp_ep.yaml: parallelism_config_ep_size 2 does not divide "
         r"the 3 processes of a node: each group of ep_size ranks exchanges tokens within a node; .*$"),
    ],
)  # fmt: skip
def test_the_slurm_launcher_keeps_a_pipeline_within_a_node(config, gpus, expected, tmp_path):
    """launch_node.sh's launch line (accelerate stood in for by echo): a pipeline config gets no HSDP sizes, an expert
    parallel one dp_shard over every process (no replicas), and a pp or ep size that does not divide a node's
    processes is one line and exit status 2, before anything starts."""
    env = {
        **os.environ,
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "GPUS_PER_NODE": str(gpus),
        "MAIN_PROCESS_IP": "127.0.0.1",
        "MAIN_PROCESS_PORT": "29500",
        "ACCELERATE": "echo",
    }
    result = subprocess.run(
        ["bash", "scripts/slurm/launch_node.sh", f"accelerate_configs/{config}", "recipes/causal_lm.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    said = result.stderr.splitlines()[-1] if result.returncode else result.stdout
    assert re.search(expected, said), (result.stdout, result.stderr)
    assert result.returncode == (2 if said.startswith("error:") else 0)
    assert "parallelism_config_dp_replicate" not in result.stdout or config.startswith("multi_node_hsdp")
    assert "parallelism_config_dp" not in result.stdout or config.startswith(("multi_node_hsdp", "fsdp_ep"))


def zero3_checkpoint_of_another_world_size(folder):
    """A checkpoint that says 4 processes wrote it (so 2 need DeepSpeed's universal conversion), whose
    ZeRO shards are missing: rank 0's conversion fails."""
    (folder / "pytorch_model").mkdir(parents=True)
    (folder / "latest").write_text("pytorch_model")
    (folder / "trainer_state.json").write_text(
        json.dumps({"step": 4, "num_processes": 4, "zero3_sub_group_size": 10_000_000})
    )
    return folder


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_failed_conversion_ends_the_other_node_with_rank_0s_line_and_an_unseen_one_within_the_timeout(
    markov_data, tmp_path
):
    """multi_node_zero3.yaml on two loopback machines, resuming a ZeRO-3 checkpoint of 4 processes on 2:
    rank 0 converts it before any process group exists while node 1 waits on the filesystem (with the
    static rendezvous its agent never learns that node 0 ended). Shared checkpoint: rank 0's conversion
    fails, and node 1 ends with rank 0's reason, at once rather than after --ddp_timeout. Each node
    with its own copy (no shared filesystem): node 1 never sees rank 0's status and ends after
    --ddp_timeout (10 s) with a line naming the shared filesystem. Before, node 1 waited for ever."""
    shared = zero3_checkpoint_of_another_world_size(tmp_path / "shared/checkpoints/step_4")
    own = zero3_checkpoint_of_another_world_size(tmp_path / "node1/checkpoints/step_4")
    for node1_checkpoint, expected in (
        (
            shared,
            r"rank 0 could not convert \S+step_4 for this run: "
            r"checkpoint \S+ could not be converted",
        ),
        (
            own,
            r"waited 10 s \(--ddp_timeout\) for rank 0 to convert .* one shared "
            r"filesystem",
        ),
    ):
        port, started = free_port(), time.time()
        nodes = [
            subprocess.Popen(
                launch_command(
                    "multi_node_zero3.yaml",
                    "causal_lm.py",
                    causal_lm_args(
                        markov_data, tmp_path / f"run{rank}", resume_from_checkpoint=checkpoint, ddp_timeout=10
                    ),
                    two_machines(rank, "127.0.0.1", port),
                ),
                cwd=REPO,
                env={**os.environ, **OFFLINE_ENV},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank, checkpoint in ((0, shared), (1, node1_checkpoint))
        ]
        try:
            logs = [node.communicate(timeout=240)[0] for node in nodes]
        finally:
            for node in nodes:
                node.kill()
        print(
            f"node 1 ended in {time.time() - started:.0f} s: {[l for l in logs[1].splitlines() if l.startswith('error:')][-1:]}"
        )
        assert nodes[0].returncode != 0 and nodes[1].returncode != 0
        assert re.search(r"error: checkpoint \S+ could not be converted for another number of processes", logs[0])
        assert re.search(r"error: " + expected, logs[1]), logs[1][-3000:]  # at once: local rank 0 of its node
