"""Datasets, from a source to the loop's batches.

sources        local files read as written
mixture        --dataset_mixture: several sources mixed into one training set
streaming      --streaming: a training split read as it is consumed
chat           SFT examples and their labels (the answers only)
chat_template  --chat_template read and checked
packing        packed rows that attend per example
preference     DPO's and the reward model's pairs: formats, tokens, batches
synthetic      the data the demos and tests generate
loading        load, tokenize, pack and batch, with seeded dataloaders
"""
