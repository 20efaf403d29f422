"""The speed options: attention kernel, regional compile, AdamW kernel, activation checkpointing, Liger, FP8.

Each is a flag (or a recipe-YAML key) with the HF Trainer's / TRL's name. One the host cannot run
is refused with one line before anything starts (Liger and flex_attention's backward need a GPU;
flash_attention_2 needs the flash-attn package). `prepare_model` applies the model-side ones in one
place, `adamw_kernel` the optimizer's and common.launch.accelerator's `dynamo_plugin` the compile (the options
themselves are common.options.arguments' SpeedArguments), and `speed_record` says in run.json what ran.

    --attn_implementation auto   # flash_attention_2 where installed; for packed rows flex_attention
                                 # on a GPU, else common.data.packing's sdpa_varlen; the model's own otherwise
    --torch_compile true         # accelerate's regional compile: each repeated layer compiled once
    --optim adamw_torch          # torch's foreach AdamW instead of the fused kernel (the default)
    --gradient_checkpointing true --gradient_checkpointing_every_n_layers 2   # every other layer
    --use_liger_kernel true      # Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear + loss)
    accelerate launch --mixed_precision fp8 --fp8_backend ao ...   # torchao's float8 matmuls (Hopper, Ada)
"""

from __future__ import annotations

import os

import torch

from common.launch.errors import UsageError
from common.launch.internals import attention_implementation
from common.launch.mesh import launched_mesh_size
from common.options.arguments import OPTIMIZERS, SpeedArguments, installed
from common.parallel.sequence_parallel import check_heads, launched_attention


FP8_CAPABILITY = (8, 9)  # float8 matmuls: Ada Lovelace and Hopper on


def attention_candidates(requested: str, model, packed_rows: bool) -> list[str]:
    """The kernels `--attn_implementation` stands for on this host, fastest first; with auto the
    model's own comes last, so the first the model accepts is used (see SpeedArguments)."""
    if requested != "auto":
        return [requested]
    current, on_gpu = attention_implementation(model), torch.cuda.is_available()
    candidates = ["flash_attention_2"] if on_gpu and installed("flash_attn") else []  # packed rows: varlen
    if packed_rows:  # flex_attention: transformers builds a block mask of the packed examples
        candidates += (["flex_attention"] if on_gpu else []) + (["sdpa_varlen"] if current == "sdpa" else [])
    return candidates + [current]


def prepare_model(model, speed: SpeedArguments, packed_rows: bool = False):
    """Set the attention kernel, activation checkpointing and Liger's kernels on a freshly loaded
    model (before LoRA adapters, and before `accelerator.prepare`, which compiles)."""
    from common.data.packing import NAME, register, use_per_example_attention

    register()  # sdpa_varlen, which --attn_implementation may name

    candidates = attention_candidates(speed.attn_implementation, model, packed_rows)
    sequence_parallel_attention = launched_attention()  # zero3_ulysses.yaml: DeepSpeed wraps it; fsdp_cp.yaml: sdpa
    if sequence_parallel_attention is not None:
        if speed.attn_implementation not in ("auto", sequence_parallel_attention):
            named = (
                "its config's parallelism_config_sp_attn_implementation"
                if launched_mesh_size("sp") > 1
                else "context parallelism's ring attention replaces sdpa's"
            )
            raise UsageError(
                f"--attn_implementation {speed.attn_implementation} under sequence/context parallelism, "
                f"which runs {sequence_parallel_attention} ({named}): leave out --attn_implementation"
            )
        candidates = [sequence_parallel_attention]
        check_heads(model)
    for attention in candidates:
        try:
            if attention == NAME:
                use_per_example_attention(model)
            elif attention != attention_implementation(model):
                model.set_attn_implementation(attention)
            break
        except (ValueError, ImportError) as error:  # the model's class does not support it
            if len(candidates) == 1:
                reason = str(error).strip().splitlines()[0]
                raise UsageError(
                    f"--attn_implementation {attention} does not run on {type(model).__name__} "
                    f"({reason}); use --attn_implementation auto"
                ) from None
    if speed.gradient_checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False},
            every_n_layers=speed.gradient_checkpointing_every_n_layers,
        )
        count_layers_by_index(model, speed.gradient_checkpointing_every_n_layers)
    if speed.use_liger_kernel:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, None)  # the kernels for the model's architecture, as Trainer applies them
    return model


def adamw_kernel(speed: SpeedArguments) -> dict:
    """torch.optim.AdamW's keyword choosing the kernel for --optim."""
    return dict(OPTIMIZERS[speed.optim])


def count_layers_by_index(model, every_n_layers: int) -> None:
    """Every n-th decoder layer counted by its index in the model, as transformers counts a whole model's: a
    pipeline stage built alone (common.parallel.pipeline.load_stages) holds placeholders for the other stages'
    layers, which transformers' count skips, so its first layer would be counted as layer 0."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if every_n_layers == 1 or not isinstance(layers, torch.nn.ModuleList):
        return
    if all(isinstance(layer, GradientCheckpointingLayer) for layer in layers):
        return  # a whole model: transformers' count is already by index
    for index, layer in enumerate(layers):
        if isinstance(layer, GradientCheckpointingLayer):
            layer.gradient_checkpointing = index % every_n_layers == 0


def checkpointed_layers(model) -> list[bool]:
    """Per repeated layer, whether its activations are recomputed in the backward."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [bool(m.gradient_checkpointing) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def fp8_problem(
    capability: tuple | None,
    torchao: bool,
    backend: str,
    strategy: str,
    fsdp_ram_efficient_loading: bool,
    tp_size: int = 1,
) -> str | None:
    """Why `mixed_precision: fp8` cannot run here, in one line, else None. `capability`: the CUDA GPU's compute
    capability (None: no GPU; a CPU runs the float8 matmuls too, to check a run, never faster); `backend`:
    ACCELERATE_FP8_BACKEND as the launcher set it ("" when not given); `tp_size`: the mesh's tensor-parallel size."""
    if capability is not None and tuple(capability) < FP8_CAPABILITY:  # a CPU runs torchao's float8 matmuls
        return (
            f"mixed_precision fp8 needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper: L4, "
            f"H100, H200) and this GPU's is {capability[0]}.{capability[1]} (accelerate would quietly train "
            "in fp16 instead): use bf16"
        )
    if backend.upper() not in ("", "NO", "AO"):
        return (
            f"fp8_backend {backend.lower()}: these recipes train fp8 through torchao, the backend checked here; "
            "launch with --fp8_backend ao (or fp8_config: {backend: AO} in the config)"
        )
    if not torchao:
        return "mixed_precision fp8 trains through torchao, which is not installed: pip install torchao, or use bf16"
    instead = "use single.yaml, ddp.yaml, or fsdp.yaml with --fsdp_cpu_ram_efficient_loading false, or bf16"
    if tp_size > 1:  # seen on a CPU: torchao's float8 matmul refuses DTensor weights; FSDP x TP fails in prepare
        return f"mixed_precision fp8 under tensor parallelism (tp_size {tp_size}) does not run with torchao: {instead}"
    if strategy == "deepspeed":
        return f"mixed_precision fp8 under DeepSpeed is not checked with torchao here: {instead}"
    if strategy == "fsdp" and fsdp_ram_efficient_loading:
        return (
            "mixed_precision fp8 (torchao) under FSDP2 cannot load with fsdp_cpu_ram_efficient_loading: true "
            "(accelerate refuses the pair): set it to false in the config, or launch with "
            "--fsdp_cpu_ram_efficient_loading false"
        )
    return None


def fp8_host(use_cpu: bool = False) -> tuple[tuple | None, bool]:
    """What `fp8_problem` asks of this host: the CUDA GPU's compute capability (None: none, or `use_cpu`), and
    whether torchao is installed."""
    on_gpu = torch.cuda.is_available() and not use_cpu
    return (torch.cuda.get_device_capability() if on_gpu else None), installed("torchao")


def refuse_fp8_where_it_cannot_run(strategy: str, tp_size: int) -> None:
    """`accelerate launch --mixed_precision fp8` (or the config's) refused in one line before anything starts
    where it cannot run (`fp8_problem`); where it can, the launcher's environment set as accelerate reads it."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower() != "fp8":
        return
    problem = fp8_problem(
        *fp8_host(os.environ.get("ACCELERATE_USE_CPU", "false").lower() == "true"),
        os.environ.get("ACCELERATE_FP8_BACKEND", ""),
        strategy,
        os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true",
        tp_size,
    )
    if problem:
        raise UsageError(problem)
    # accelerate's launcher exports --fp8_backend as given (ao), which its own FP8BackendType (AO) then refuses
    os.environ["ACCELERATE_FP8_BACKEND"] = os.environ.get("ACCELERATE_FP8_BACKEND", "NO").upper()
    if strategy != "fsdp":  # accelerate wraps every float8 weight for FSDP2's float8 all-gather even without
        # FSDP2, and its own safetensors checkpoint cannot read a wrapped weight's storage: plain weights
        os.environ["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] = "false"


def speed_record(model, speed: SpeedArguments) -> dict:
    """What ran, for run.json: the attention kernel read back from the model, and the other options."""
    layers = checkpointed_layers(model)
    return {
        "attention": attention_implementation(model),
        "torch_compile": "regional (inductor)" if speed.torch_compile else "off",
        "optim": speed.optim,
        "checkpointed_layers": f"{sum(layers)} of {len(layers)}",
        "liger_kernel": speed.use_liger_kernel,
        # accelerate swaps these in at prepare under mixed_precision fp8 (torchao): every linear layer whose sizes
        # divide by 16 but the model's first and last (LoRA's adapters too, where their rank divides by 16)
        "float8_linear_layers": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
    }
