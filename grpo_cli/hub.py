"""Reaching the Hugging Face hub, or not: one probe before a process's first hub access.

Unreachable, huggingface_hub retries each request with backoff (five tries, about 30 s, a log line each) before
it fails. So before the first access (a hub dataset, a hub model id) one TCP connect to the hub's endpoint is
tried with a short timeout; when it fails, this process goes offline (`HF_HUB_OFFLINE=1`): datasets,
transformers and vLLM read their local cache only, so a cached model or dataset still loads and a missing one
fails at once. A user's own HF_HUB_OFFLINE is left alone. Standard library only.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0  # name lookup + TCP connect to the endpoint; a reachable hub answers in well under this
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")

_settled: str | None = None  # None: not probed yet; "" online (or the user's choice); else why we went offline


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _connects(host: str, port: int, timeout_s: float) -> bool:
    """A TCP connect within timeout_s, the name lookup included (getaddrinfo takes no timeout: it runs in a
    daemon thread that is left behind if it hangs)."""
    done: list[bool] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                done.append(True)
        except OSError:
            done.append(False)

    thread = threading.Thread(target=attempt, daemon=True, name="grpo-hub-probe")
    thread.start()
    thread.join(timeout_s)
    return bool(done and done[0])


def go_offline() -> None:
    """Offline from now on, for libraries imported later (their env variables) and already imported ones (the
    module constants they read at call time)."""
    for name in OFFLINE_ENV:
        os.environ[name] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def settle() -> str:
    """Probe the hub once per process before its first access; returns "" when the hub is used as usual, else
    the reason this process reads only the local cache (to add to a hub error's line)."""
    global _settled
    if _settled is None:
        if any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in OFFLINE_ENV):
            _settled = ""  # the user chose offline: their own error messages say so
        else:
            url = urlparse(endpoint())
            host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
            if _connects(host, port, PROBE_TIMEOUT_S):
                _settled = ""
            else:
                go_offline()
                _settled = (f"the hub ({host}) could not be reached within {PROBE_TIMEOUT_S:g} s, so only the local cache "
                            "was read")
    return _settled


def offline_note() -> str:
    """"; <why only the cache was read>" after a hub error, when this process went offline; else ""."""
    return f"; {_settled}" if _settled else ""
