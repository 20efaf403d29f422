"""The recipes' shared pieces, one job per module, in packages that are layers: each imports only from itself and
the layers listed before it, and a package's modules import each other in one direction (tests/test_layers.py
walks the imports and holds both rules; this list is the order it reads):

    launch      the process and its launch: the Accelerator for the launched config, CPU hosts, the mesh sizes
                (the pipeline's among them), one-line errors, lost peers, elastic node ranges, other libraries'
                internals and the versions they were checked on
    options     the recipes' options as dataclasses, their ranges, --dataset_mixture's file, and the parser
                that reads a recipe YAML and the command line into them
    parallel    one module per parallelism: tensor, sequence and context, pipeline; what a rank holds
    data        datasets: sources, mixtures, streaming, chats and their templates, packing, preference
                pairs, the synthetic demo data, and loading them into batches
    training    the loop's pieces: optimizer and schedule, batches, speed options, non-finite guard,
                memory, FLOPs, profiling, evaluation, --auto_find_batch_size
    models      models and tokenizers loaded for any config, LoRA adapters
    outputs     checkpoints and what leaves a run: save and load, reshard, portable, export, model card,
                the run folder, run.json, metrics
    objectives  the losses beyond next-token: DPO and its reference, reward models and rewards, GRPO's
                rollouts and loss, distillation's teacher and divergence
    planning    the memory and step-time models that make estimate-memory and make choose-config use
    run         a run from start to finish, as every recipe runs it
"""

import logging

import torch


# torchao (accelerate's FP8 backend, which transformers and peft import whenever it is installed) logs at import
# that its CUDA-only kernels (mxfp8, CUTLASS sm90a) cannot load on a CPU build of torch, and torch then calls the
# enums it registers deprecated: four lines on every run's stderr, before any error, that say nothing about the run.
# On a CUDA build torchao's lines stay: there they name a real mismatch.
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
if torch.version.cuda is None:
    logging.getLogger("torchao").setLevel(logging.ERROR)
