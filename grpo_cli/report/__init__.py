"""What a person sees of a run: the console's lines, the metric files and wandb, plots, and health warnings.

- console.py: the per-step line, the progress bar and the run's header and summary.
- loggers.py: RUN_DIR/metrics.jsonl and completions.jsonl, and wandb when on.
- plot.py: `grpo plot`, a PNG of one or several runs' metrics.
- watch.py: warnings when groups stop carrying signal; the stop after too many non-finite steps.
"""
