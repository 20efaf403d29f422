"""The recipes' options: the dataclasses, the bounds of their numbers, and the parser that fills them.

arguments        the shared options (model, data, training, speed), each value checked on its own
ranges           where a number option's value must lie, declared in its annotation
dataset_mixture  --dataset_mixture's file read and checked into a Mixture
parsing          a recipe YAML and the command line into the dataclasses; options wrong together
trl_keys         TRL's config keys the recipes take otherwise: what to write instead of each
"""
