"""The math of GRPO as pure functions over tensors: nothing here reads a config, a file or a process.

- grpo.py: group advantages, the clipped objectives and their variants, KL estimators, loss aggregations.
- passes.py: a model's forward pass to per-token logprobs (and entropies), chunked over the vocabulary.
- schedules.py: the learning-rate schedules, a name each.
"""
