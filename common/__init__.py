"""The recipes' shared pieces, one job per module (the README's Layout lists them)."""

import logging

# torchao (accelerate's FP8 backend, which transformers imports whenever it is installed) logs at import that its
# CUDA-only kernels (mxfp8, CUTLASS sm90a) cannot load on a CPU build of torch, and torch then calls the enums it
# registers deprecated: four lines on every run's stderr, before any error, that say nothing about the run
for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).setLevel(logging.ERROR)
