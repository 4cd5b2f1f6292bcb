"""What goes into the engine: rows read from a source, prompts rendered from them, and which come next.

- rows.py: a data source (a JSONL file, a hub dataset, a built-in task) -> checked rows, a seeded cursor.
- templates.py: a row -> the prompt text (plain or the model's chat template); conversations.
- pool.py: the prompt pool (`sampler.*`): which prompts a step draws, by how often they were solved.
"""
