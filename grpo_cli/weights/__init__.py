"""Weights on disk: where a model lives, checkpoints, LoRA adapters and run directories.

- model_files.py: a model name (path, hub id, `builtin:`) -> its files.
- checkpoint.py: saving and loading a run's state (HF-format weights, optimizer, cursors, the pool).
- lora.py: LoRA adapters on the policy, merged or pushed as an adapter.
- runs.py: a run directory's complete checkpoints, resuming, pruning, and what `grpo eval` names point to.
"""
