"""The two exceptions the CLI prints as one line without a traceback, a reward server's failure, and the one-line
form of any error.

They live apart from cli/ so that library modules (data, rewards, train, ...) can raise them
without importing the command-line layer.
"""


class UsageError(Exception):
    """The input is wrong (a key, a file, a row, a recipe): one line naming it, exit code 2. Raised
    before a run starts whenever it can be known then."""


class RunFailure(Exception):
    """A run stopped for a reason one line explains (a reward that fails on most samples, too many
    non-finite steps in a row, an engine that holds stale weights): exit code 1; the traceback goes to
    the run's log."""


class Unreachable(RuntimeError):
    """A learned reward's server did not answer after its tries: the call's samples all fail at once (no retry
    one sample at a time, which against a stalled server would cost a timeout per sample; rewards/score.py)."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`TypeName: message` with the message's whitespace folded, at most `limit` characters."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:limit]
