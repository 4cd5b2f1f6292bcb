"""Built-in task generators, selected in a recipe by `data.source: builtin:NAME`.

Each entry maps a name to its `splits(num_train, num_heldout, seed, tiers)`
function returning (train, heldout) lists of problems with a `to_row()`.
"""

from grpo_cli.tasks import bike_pricing, bike_pricing_tools, bike_pricing_vision, countdown

BUILTIN_TASKS = {
    "bike_pricing": bike_pricing.splits,
    "bike_pricing_tools": bike_pricing_tools.splits,
    "bike_pricing_vision": bike_pricing_vision.splits,
    "countdown": countdown.splits,
}
