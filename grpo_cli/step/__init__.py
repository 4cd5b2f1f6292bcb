"""The stages of a training step, in the order train.py calls them.

- setup.py: the models, engine, optimizer and rewards a run starts from; state.py: what a step carries.
- rollout.py, generator.py, ahead.py: sampling the groups (in line, on ranks of their own, steps ahead).
- collect.py: groups scored and filtered into what the step trains on; batch.py: their tensors.
- update.py: the logprob passes and the clipped update; optim.py: the optimizer and its schedule.
- sync.py: the new weights pushed into the engine, and the push check.
- heldout.py: the held-out evaluation every `eval.every` steps.
- metrics.py, tool_metrics.py, timer.py: what a step measured and where its time went.
"""
