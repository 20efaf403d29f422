"""The recipes' shared pieces, one job per module (the README's Layout lists them)."""

import logging

import torch


# torchao (accelerate's FP8 backend, which transformers and peft import whenever it is installed) logs at import
# that its CUDA-only kernels (mxfp8, CUTLASS sm90a) cannot load on a CPU build of torch, and torch then calls the
# enums it registers deprecated: four lines on every run's stderr, before any error, that say nothing about the run.
# On a CUDA build torchao's lines stay: there they name a real mismatch.
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
if torch.version.cuda is None:
    logging.getLogger("torchao").setLevel(logging.ERROR)
