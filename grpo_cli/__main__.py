"""`python -m grpo_cli` is the same as the `grpo` command."""

import sys

from grpo_cli.cli import main

sys.exit(main())
