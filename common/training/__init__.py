"""The pieces around a recipe's training loop.

loop         optimizer, schedule, step counts, the loop's batch windows, the evaluation loss
time_budget  --max_train_seconds: the step at which a wall-clock budget stops the run
batch_size   --auto_find_batch_size
speed        the speed options: attention kernel, compile, AdamW kernel, checkpointing, Liger, FP8
nonfinite    non-finite loss or gradients: skip the step or stop
memory       memory per rank by category, counted in the run
flops        FLOPs per batch and the device's peak, for MFU
profiling    --profile_steps
evaluation   task metrics (+ evaluate_metrics/), best model, early stopping
experts      mixture-of-experts models: the router's load-balancing loss and the experts' load, logged
"""
