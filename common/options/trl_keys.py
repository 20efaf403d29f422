"""TRL's config keys the recipes take otherwise: what to write instead of each, or why it is not offered.

GRPOConfig, DPOConfig, SFTConfig, RewardConfig and the TrainingArguments they extend. `common.options.parsing` adds
the line to its refusal of an unknown key, so a TRL config or command brought here is fixed in one go. tests/data
holds TRL 1.16.0's fields; a test checks that each one is an option of its recipe or has a line here.
"""

_SAMPLER = (
    "the rollouts are sampled by the recipe's own sampler from whole weights on every rank (no vLLM, no generate "
    "settings; docs/rl.md): --temperature, --top_p and --max_completion_length set it, --rollout_weights where the "
    "weights sit"
)
_ROLLOUT = (
    "a rollout is one optimizer step's completions (processes x --per_device_train_batch_size x "
    "--gradient_accumulation_steps), reused for --num_iterations steps"
)
_OBJECTIVE = (
    "not in grpo.py's objective, which takes --loss_type (dapo, grpo, dr_grpo, bnpo), --epsilon, --epsilon_high, "
    "--delta, --importance_sampling_level, --beta, --scale_rewards, --num_iterations and --advantage_estimator rloo "
    "(docs/rl.md)"
)
_DPO_LOSS = "not in dpo.py's objective, which takes --loss_type (sigmoid, ipo, hinge), --beta, --label_smoothing and --rpo_alpha"
_COMPLETIONS = "--log_completions writes every completion, with its rewards, to completions.jsonl (docs/rl.md)"
_LOADER = (
    "the recipes build their own data loaders (tokenizing with --preprocessing_num_workers processes, batches in "
    "the training process)"
)
_METRICS = "each recipe computes its own evaluation figures on every --eval_steps (docs: its metrics)"
_DDP = "the recipes set DDP themselves (gradient_as_bucket_view on, no unused-parameter search); the strategy comes from the accelerate config"
_PRECISION = "precision comes from the accelerate config, its mixed_precision, for training and evaluation alike"
_RESUME = "--resume_from_checkpoint latest resumes everything a checkpoint holds, at its data position"
_LOSS_MASK = "sft.py trains on the assistant turns' (a completion's) tokens only, always"
_UPLOAD = "the recipes do not upload: hf upload REPO OUTPUT_DIR/final uploads the exported folder"
_NOT_HERE = "not offered by these recipes"

TRL_ELSEWHERE = {
    # generation (GRPO)
    **dict.fromkeys(
        (
            "use_vllm",
            "vllm_mode",
            "vllm_model_impl",
            "vllm_server_base_url",
            "vllm_server_host",
            "vllm_server_port",
            "vllm_server_timeout",
            "vllm_group_port",
            "vllm_gpu_memory_utilization",
            "vllm_tensor_parallel_size",
            "vllm_max_model_length",
            "vllm_enable_sleep_mode",
            "vllm_structured_outputs_regex",
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_cap",
            "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_clip_max",
            "use_transformers_paged",
            "use_transformers_continuous_batching",
            "transformers_continuous_batching_config",
            "cache_implementation",
            "ds3_gather_for_generation",
            "generation_kwargs",
            "top_k",
            "min_p",
            "repetition_penalty",
        ),
        _SAMPLER,
    ),
    **dict.fromkeys(("generation_batch_size", "steps_per_generation"), _ROLLOUT),
    "max_prompt_length": "grpo.py: a prompt keeps --block_size less --max_completion_length tokens (a longer one is "
    "left out, counted in run.json's prompts_dropped)",
    "num_generations_eval": "evaluation answers each held-out prompt greedily, once (docs/rl.md)",
    "shuffle_dataset": "the prompts are drawn from a permutation seeded by --seed and the epoch (docs/rl.md)",
    "max_tool_calling_iterations": "the rollouts call no tools",
    **dict.fromkeys(
        ("num_completions_to_print", "log_completions_hub_repo", "log_unique_prompts", "log_multimodal"), _COMPLETIONS
    ),
    **dict.fromkeys(
        (
            "top_entropy_quantile",
            "off_policy_mask_threshold",
            "sapo_temperature_neg",
            "sapo_temperature_pos",
            "vespo_k_neg",
            "vespo_k_pos",
            "vespo_lambda_neg",
            "vespo_lambda_pos",
            "entropy_coef",
            "entropy_coef_delta",
            "entropy_coef_max",
            "entropy_coef_min",
            "entropy_target",
            "use_adaptive_entropy",
            "multi_objective_aggregation",
        ),
        _OBJECTIVE,
    ),
    "cast_lm_head_to_fp32": "the log-probabilities are taken in fp32 from the logits; the head's precision is the "
    "accelerate config's",
    # DPO
    **dict.fromkeys(
        ("f_divergence_type", "f_alpha_divergence_coef", "discopop_tau", "ld_alpha", "loss_weights", "use_weighting"),
        _DPO_LOSS,
    ),
    **dict.fromkeys(
        ("ref_model_mixup_alpha", "ref_model_sync_steps", "sync_ref_model"),
        "the reference is the starting model, frozen (dpo.py, and grpo.py with --beta): never synced or mixed",
    ),
    "precompute_ref_batch_size": "--precompute_ref_log_probs computes them at --per_device_eval_batch_size",
    "truncation_mode": "--overlong says what happens to a longer example (docs/data.md)",
    "loss_type": "sft.py trains the next-token loss, reward_model.py the Bradley-Terry loss; --loss_type is dpo.py's "
    "and grpo.py's",
    # SFT
    **dict.fromkeys(("assistant_only_loss", "completion_only_loss"), _LOSS_MASK),
    **dict.fromkeys(
        ("packing_strategy", "padding_free"),
        "--packing true packs whole examples, attention kept within each (sft.py)",
    ),
    "eval_packing": "evaluation batches as training does (--packing)",
    "chat_template_path": "--chat_template FILE",
    "chat_template_kwargs": "--chat_template FILE with the template's variables written in",
    "dataset_kwargs": "--train_file, --validation_file, --dataset_name or --dataset_mixture say what to load",
    **dict.fromkeys(("eos_token", "pad_token"), "the tokenizer's own (--tokenizer_name_or_path, --chat_template)"),
    "pad_to_multiple_of": "batches are padded to their longest row (sft.py's also packed, with --packing true)",
    "model_init_kwargs": "--torch_dtype and --attn_implementation",
    "trust_remote_code": "models load with transformers' own classes only",
    "use_cache": "the recipes turn the cache off for training forwards and on for sampling",
    "activation_offloading": "--gradient_checkpointing true, or an offload config (zero3_offload.yaml, fsdp_offload.yaml)",
    **dict.fromkeys(("activation_checkpointing", "activation_checkpointing_kwargs"), "--gradient_checkpointing true"),
    "liger_kernel_config": "--use_liger_kernel true",
    # Trainer
    **dict.fromkeys(
        ("accelerator_config", "parallelism_config", "ddp_backend"),
        "the strategy and its process group come from the accelerate config: accelerate launch --config_file "
        "accelerate_configs/X.yaml",
    ),
    **dict.fromkeys(
        ("ddp_broadcast_buffers", "ddp_bucket_cap_mb", "ddp_find_unused_parameters", "ddp_static_graph"), _DDP
    ),
    **dict.fromkeys(("bf16_full_eval", "fp16_full_eval", "tf32"), _PRECISION),
    "average_tokens_across_devices": "always: the loss is the mean over the global batch's tokens",
    "data_seed": "--seed",
    "full_determinism": "--seed (a run's data order and GRPO's rollouts depend on it, not on the process count)",
    **dict.fromkeys(
        (
            "dataloader_drop_last",
            "dataloader_in_order",
            "dataloader_multiprocessing_context",
            "dataloader_num_workers",
            "dataloader_persistent_workers",
            "dataloader_pin_memory",
            "dataloader_prefetch_factor",
            "train_sampling_strategy",
            "length_column_name",
        ),
        _LOADER,
    ),
    **dict.fromkeys(
        (
            "batch_eval_metrics",
            "eval_accumulation_steps",
            "eval_do_concat_batches",
            "eval_use_gather_object",
            "include_for_metrics",
            "label_names",
            "prediction_loss_only",
        ),
        _METRICS,
    ),
    "include_num_input_tokens_seen": "metrics.jsonl's train lines carry the input tokens per second (and GRPO's "
    "num_tokens)",
    "skip_memory_metrics": "metrics.jsonl and run.json carry each rank's peak memory, always",
    **dict.fromkeys(("do_train", "do_predict"), "each recipe trains, and evaluates every --eval_steps"),
    "eval_delay": "--eval_steps N (0: at the end only)",
    **dict.fromkeys(
        ("metric_for_best_model", "greater_is_better", "load_best_model_at_end"),
        "final/ is the last step's model (sequence_classification.py also keeps best/)",
    ),
    **dict.fromkeys(("enable_jit_checkpoint", "restore_callback_states_from_checkpoint", "ignore_data_skip"), _RESUME),
    **dict.fromkeys(
        ("save_on_each_node", "save_only_model"),
        "a checkpoint holds what a resume needs, written once per run on the shared output folder",
    ),
    **dict.fromkeys(("log_level_replica", "log_on_each_node"), "the main process logs; the others print errors"),
    "logging_first_step": "--logging_steps 1 logs every step; --eval_on_start evaluates before the first",
    "logging_nan_inf_filter": "--nonfinite says what a non-finite loss does (stop, or skip the step)",
    "disable_tqdm": "the progress bar shows on the main process only",
    **dict.fromkeys(("optim_args", "optim_target_modules"), "--optim, --adam_beta1, --adam_beta2, --adam_epsilon"),
    **dict.fromkeys(
        ("torch_compile_backend", "torch_compile_mode"),
        "--torch_compile true (accelerate's regional compilation, inductor)",
    ),
    "use_cpu": "a host without a GPU trains on its CPU, as the accelerate config asks",
    "debug": "--profile_steps A-B writes a torch.profiler trace; --nonfinite stop names the step of a non-finite loss",
    **dict.fromkeys(("hub_always_push", "hub_revision", "hub_token"), _UPLOAD),
    **dict.fromkeys(
        ("trackio_bucket_id", "trackio_space_id", "trackio_static_space_id", "project"),
        "--report_to trackio logs to a local trackio project named after --run_name",
    ),
    **dict.fromkeys(
        ("neftune_noise_alpha", "label_smoothing_factor", "torch_empty_cache_steps", "router_aux_loss_coef"),
        _NOT_HERE,
    ),
}
