"""Checkpoints and what leaves a run.

run_dir        the output folder's layout, starting over an earlier run, folder swaps
checkpoints    save every --save_steps, crash-safe, and load one to resume
reshard        a ZeRO checkpoint converted for another world size
portable       a checkpoint rewritten per parameter, to resume under another strategy
portable_load  that portable form loaded into the run's own strategy
export         the Hugging Face folder, from a run or any checkpoint
model_card     the README.md card of every exported folder
run_info       run.json: what ran, resolved
metrics        what is logged: loss, tokens/s, MFU, memory; trackers
"""
