"""One module per parallelism the configs choose, each applied in one place; and what a rank holds.

tensor_parallel    tp.yaml, fsdp_tp.yaml: the model split by its plan, and its checkpoints
sequence_parallel  zero3_ulysses.yaml, fsdp_cp.yaml: rows split over ranks (Ulysses, ring attention)
pipeline           pp.yaml, dp_pp.yaml: the decoder split into stages, run by a schedule
expert_parallel    ep.yaml, fsdp_ep.yaml: a mixture-of-experts model's experts split over ranks, tokens sent to them
shards             what each rank holds of the parameters under every strategy
"""
