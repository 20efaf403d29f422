"""The process and its launch: the lowest layer, which every other imports.

accelerator     the Accelerator for the launched config: precision, accumulation, clipping, ranks checked
cpu_host        the GPU configs on a host without CUDA (gloo, FSDP2 and DeepSpeed on the CPU)
mesh            a parallelism_config's sizes (the pipeline's read from the launched config), data-parallel sums
errors          the one-line errors and the exit policy
peers           a lost peer, and long work one rank does alone
elastic         --nnodes MIN:MAX: a node range that shrinks to the nodes left and grows back
internals       every use of another library's internals, with the versions they were checked on
versions        whether the installed libraries are inside those versions
"""
