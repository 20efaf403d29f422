#!/usr/bin/env bash
# The GPU checks in one command, for a GPU machine lent for a short while (docs/testing.md, "On a GPU"):
# the internals test on that machine's torch and tests/test_gpu.py (in parallel: one GPU holds them all), MFU of
# the recipe against the bare loop and Trainer at ~1B parameters, then each speed option's gain on the same job.
# Each section runs under its own time limit inside BUDGET seconds, so what finished comes back even when a later
# section does not; the figures pages go to $GPU_DOCS (written by the benchmark scripts) and are copied with the
# log to $OUT.
#
#   OUT=/tmp/gpu BUDGET=540 bash benchmarks/gpu_checks.sh
#
# Knobs: SECTIONS (any of "tests mfu mfu_compiled options", space-separated; they run in that order), TESTS_K (a
# pytest -k expression over the tests), TESTS_TIMEOUT (pytest's limit per test, under the section's own),
# OPTIONS (benchmark_options.py's --options), MFU_BATCH (per-device batch at 1B: 24 fits an H200's 139 GiB,
# 8 an H100's 80), GPU_DOCS (where the pages go: docs/gpu, or a folder per GPU model).
# The tests section needs pytest-xdist and pytest-timeout (the GPU image has both).
# Packages the machine lacks travel as wheels in .whl/ (installed to /tmp/site, put first on PYTHONPATH). The
# chat model's config, tokenizer and template travel in .gpu_model/ (its weights, 260 MB, cannot): a model of that
# architecture is built from them, seeded, in bf16, for the tests that fine-tune it (GPU_CHAT_MODEL).
set -u
OUT=${OUT:-outputs/gpu}
BUDGET=${BUDGET:-540}
SECTIONS=${SECTIONS:-tests mfu options}
GPU_DOCS=${GPU_DOCS:-docs/gpu}
LOG=$OUT/log.txt
START=$(date +%s)
mkdir -p "$OUT" "$GPU_DOCS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

section() {  # section NAME LIMIT_SECONDS COMMAND...: the command's output goes to the log
    local name=$1 limit=$2 left began
    shift 2
    left=$((BUDGET - ($(date +%s) - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 30 ]; then
        echo "== $name: not run ($left s of the budget left)" | tee -a "$LOG"
        return
    fi
    began=$(date +%s)
    echo "== $name (limit ${limit}s, at $((began - START))s)" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    echo "== $name: exit $? after $(($(date +%s) - began))s" | tee -a "$LOG"
}

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >>"$LOG" 2>&1 || { echo "error: the carried wheels did not install" | tee -a "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
    if ! python3 -c "import transformers, datasets, deepspeed, peft, accelerate, common.models.loading" >>"$LOG" 2>&1; then
        echo "the carried transformers did not import: the machine's own instead" | tee -a "$LOG"
        rm -rf /tmp/site/transformers /tmp/site/transformers-*
    fi
else
    export PYTHONPATH=$PWD
fi
# `make doctor` (a test runs it) with the machine's own python, its install step already done
export VENV=${VENV:-$(dirname "$(dirname "$(command -v python3)")")}
touch "$VENV/.installed" 2>/dev/null

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn',
torch.backends.cudnn.version(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
    python3 -c "import importlib.metadata as m
for n in ('accelerate', 'transformers', 'datasets', 'deepspeed', 'peft', 'evaluate', 'tokenizers', 'triton',
          'liger-kernel', 'flash-attn', 'gguf', 'trl'):
    try:
        print(n, m.version(n))
    except m.PackageNotFoundError:
        print(n, 'not installed')"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >>"$LOG"

[ -f outputs/data/markov/train.jsonl ] || section "demo data" 60 python3 scripts/make_demo_data.py --task markov \
    --out outputs/data/markov
if [ ! -f outputs/models/SmolLM2-135M-Instruct/model.safetensors ] && [ -d .gpu_model ]; then
    section "chat model from its config" 60 python3 -c "
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
source, folder = sys.argv[1:]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.bfloat16).save_pretrained(folder)
AutoTokenizer.from_pretrained(source).save_pretrained(folder)" .gpu_model /tmp/chat_model
    [ -f /tmp/chat_model/model.safetensors ] && export GPU_CHAT_MODEL=/tmp/chat_model
fi
case " $SECTIONS " in *" tests "*)
    section "tests: internals and test_gpu.py" "${TESTS_LIMIT:-300}" python3 -m pytest -v -p no:cacheprovider \
        --timeout "${TESTS_TIMEOUT:-280}" -rA -n "${TESTS_WORKERS:-4}" tests/test_internals.py tests/test_gpu.py ${TESTS_K:+-k "$TESTS_K"};;
esac
# ~1B parameters (hidden 2048, 20 layers), 2048-token blocks, per-device batch 24 (estimate-memory: 95 GiB of
# the H200's 139 at 24, 121 at 32)
JOB=(--config single.yaml --num_processes 1 --hidden 2048 --layers 20 --block_size 2048 --batch_size "${MFU_BATCH:-24}"
     --steps 15 --warmup 5 --rounds 1 --learning_rate 3e-4)
case " $SECTIONS " in *" mfu "*)
    section "MFU at 1B" 200 python3 benchmarks/benchmark_peers.py --jobs causal "${JOB[@]}" \
        --docs "$GPU_DOCS/benchmark-peers.md";;
esac
# the same three with torch.compile in each, as each one's users turn it on (the recipe's best option at 1B)
case " $SECTIONS " in *" mfu_compiled "*)
    section "MFU at 1B, all three compiled" "${COMPILED_LIMIT:-200}" python3 benchmarks/benchmark_peers.py --jobs causal \
        "${JOB[@]}" --torch_compile --docs "$GPU_DOCS/benchmark-peers-compiled.md";;
esac
# the options one at a time on the same job, most wanted first (the page is rewritten after each)
case " $SECTIONS " in *" options "*)
    section "speed options at 1B" "${OPTIONS_LIMIT:-230}" python3 benchmarks/benchmark_options.py "${JOB[@]}" \
        --options ${OPTIONS:-fp8 compile_and_fp8 compile_and_liger torch_compile liger checkpoint_every_2nd_layer adamw_torch attention_flex} \
        --docs "$GPU_DOCS/benchmark-options.md";;
esac
cp "$GPU_DOCS"/*.md "$OUT"/ 2>/dev/null
echo "== done at $(($(date +%s) - START))s" | tee -a "$LOG"
