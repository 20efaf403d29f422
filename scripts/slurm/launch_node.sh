#!/bin/bash
# One node's launch line, run by srun on every node of a job (see train.sbatch).
# Usage: launch_node.sh ACCELERATE_CONFIG RECIPE [RECIPE ARGS...]
set -euo pipefail
config="$1"; shift

nodes="${SLURM_NNODES:?run under srun (SLURM_NNODES unset)}"
node_rank="${SLURM_NODEID:?run under srun (SLURM_NODEID unset)}"
gpus="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}"
accelerate="${ACCELERATE:-accelerate}"
[ -x .venv/bin/accelerate ] && [ -z "${ACCELERATE:-}" ] && accelerate=.venv/bin/accelerate

# A hybrid-shard config (multi_node_hsdp.yaml) shards within a node and replicates across nodes. A pipeline config
# (pp.yaml, dp_pp.yaml) keeps each pipeline within a node (its ranks are consecutive) and replicates across nodes:
# its pp size must divide the node's processes. An expert-parallel config (fsdp_ep.yaml) keeps each group of ep_size
# ranks, which split the experts and exchange tokens by all-to-all, within a node, and shards over every process
# (each expert's shards across the groups): its ep size must divide the node's processes.
mesh=()
pp=$(sed -n 's/^ *parallelism_config_pp_size: *\([0-9][0-9]*\).*/\1/p' "$config" | head -n 1)
ep=$(sed -n 's/^ *parallelism_config_ep_size: *\([0-9][0-9]*\).*/\1/p' "$config" | head -n 1)
if [ -n "$pp" ] && [ "$pp" -gt 1 ]; then
    if (( gpus % pp )); then
        echo "error: $config: parallelism_config_pp_size $pp does not divide the $gpus processes of a node: a pipeline stays within a node; set GPUS_PER_NODE to a multiple of $pp or change the pp size" >&2
        exit 2
    fi
elif [ -n "$ep" ] && [ "$ep" -gt 1 ]; then
    if (( gpus % ep )); then
        echo "error: $config: parallelism_config_ep_size $ep does not divide the $gpus processes of a node: each group of ep_size ranks exchanges tokens within a node; set parallelism_config_ep_size to a divisor of $gpus (fsdp_ep.yaml)" >&2
        exit 2
    fi
    mesh=(--parallelism_config_dp_shard_size $((nodes * gpus)))
elif grep -q '^parallelism_config:' "$config"; then
    mesh=(--parallelism_config_dp_replicate_size "$nodes" --parallelism_config_dp_shard_size "$gpus")
fi

echo "node $(hostname): machine_rank=$node_rank of $nodes, $gpus processes, main=$MAIN_PROCESS_IP:$MAIN_PROCESS_PORT" >&2
# NNODES=MIN:MAX (train.sbatch passes it on): an elastic run (common/launch/elastic.py) that goes on with MIN..MAX nodes.
if [ -n "${NNODES:-}" ]; then
    python="${PYTHON:-python}"
    [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
    exec "$python" -m common.launch.elastic --nnodes "$NNODES" --rdzv_backend c10d --max_restarts "${MAX_RESTARTS:-3}" \
        --config_file "$config" --num_processes $((${NNODES#*:} * gpus)) --machine_rank "$node_rank" \
        --main_process_ip "$MAIN_PROCESS_IP" --main_process_port "$MAIN_PROCESS_PORT" \
        "$@"
fi
exec "$accelerate" launch --config_file "$config" \
    --num_machines "$nodes" --machine_rank "$node_rank" \
    --num_processes $((nodes * gpus)) "${mesh[@]}" \
    --main_process_ip "$MAIN_PROCESS_IP" --main_process_port "$MAIN_PROCESS_PORT" \
    "$@"
