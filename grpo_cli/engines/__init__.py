"""The rollout engines: what samples the groups, takes the pushed weights and re-scores for the push check.

`base.Engine` is the protocol every engine implements in full; `vllm`, `hf` and `remote` are the engines,
`sharded` and `tools` the wrappers, `options` the engine's settings that `grpo check` reads too. Import
each from its module (this package imports none of them, so `grpo check` can read `options` alone).
"""
