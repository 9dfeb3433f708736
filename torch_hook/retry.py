"""When to try artemisd again after it answered 503 or 429 (stdlib only).

Shared by the probe's sender (torch_hook/transport.py) and the node programs
(prolog_epilog/artemis_node.py).  The daemon sends ``Retry-After`` in seconds;
an HTTP date (RFC 9110) is understood too, for a proxy in between.
"""

from __future__ import annotations

import email.utils
import random
import time

# 503: the daemon is at its connection or body-memory limit (or munged is
# unreachable); 429: too many requests.  Nothing of the request was stored.
RETRY_STATUSES = (429, 503)
FIRST_S = 1.0
MAX_S = 60.0


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Backoff:
    """Waits between retries: at least what the server asked, doubling from FIRST_S, capped at MAX_S.

    Each wait is stretched by a random 0-50 % so that clients refused together
    (every rank of a job) do not come back together.
    """

    def __init__(self, rng: random.Random, first_s: float = FIRST_S, max_s: float = MAX_S):
        self.rng = rng
        self.first_s = first_s
        self.max_s = max_s
        self.current = first_s

    def reset(self) -> None:
        self.current = self.first_s

    def next(self, asked_s: float | None) -> float:
        base = min(max(self.current, asked_s or 0.0), self.max_s)
        self.current = min(self.current * 2, self.max_s)
        return base * (1.0 + 0.5 * self.rng.random())
