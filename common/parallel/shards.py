"""What each rank holds of the model's parameters under every strategy: its shards, and the whole model's counts."""

from common.launch.internals import full_numel, zero3_partition


def count_parameters(model) -> dict:
    """run.json's parameter counts of a model this rank holds whole or sharded (a shard counts as its full shape)."""
    total = sum(full_numel(p) for p in model.parameters())
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    return {"total_parameters": total, "trainable_parameters": trainable}


def local_parameter_shards(model):
    """The parameter values this rank stores: its partition under ZeRO-3, its shard under
    FSDP2, every parameter otherwise."""
    for parameter in model.parameters():
        if zero3_partition(parameter) is not None:  # DeepSpeed ZeRO-3 partition
            yield zero3_partition(parameter)
        elif hasattr(parameter, "to_local"):  # FSDP2 DTensor shard
            yield parameter.to_local()
        else:
            yield parameter
