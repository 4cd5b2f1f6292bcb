"""The one exception type the CLI prints as a one-line error (no traceback), exit code 2.

It lives apart from cli.py so that library modules (data, rewards, train, ...) can raise
it without importing the command-line layer.
"""


class UsageError(Exception):
    """A one-line error for the user; printed without a traceback."""
