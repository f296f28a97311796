"""Login throttling and token-age rules: pure, no I/O, time is a parameter.

Throttling (issue 10, item 5). Failed logins are counted per key: ``user:<name>`` (the
name as typed, whether or not such a user exists, so throttling cannot tell which
names exist) and ``addr:<ip>`` (the client address). Each key gets ``FREE_FAILURES``
(5) password checks for free; after the 5th failure it is blocked for
``base_s * 2 ** (failures - 5)`` seconds, capped at ``max_s`` (defaults 1 s and 15 min):
failures 5, 6, 7, ... block for 1, 2, 4, ... seconds, at most 900. While either key of
a login is blocked the login is refused (429 with Retry-After) without looking at the
password, so even the right password is refused, and the refused attempt is not
counted (hammering a blocked key cannot lengthen the block). An attempt that is let
through is counted as a failure *before* its password is checked and a success then
deletes the count: attempts sent in parallel (or to several instances) cannot all be
checked before the first failure is written. A key whose last failure is ``forget_s``
(24 h) old counts from zero again.

Decision on success: a successful login clears the user key *and* the key of the
address it came from. Not clearing the address would let the typos of everyone behind
one office NAT add up until nobody there can log in; the price is that an attacker who
holds one valid account can reset its own address's counter between guesses — but
each targeted account keeps its own key, which only that account's success clears, so
every account still gets at most 5 free guesses and then the back-off. A success never
clears another address's key.

Tokens carry ``iat`` in whole seconds, so they cannot be ordered against a revocation
(``users.tokens_valid_after``) inside one second: every token issued in the second of
the revocation or earlier is refused (``first_valid_iat``), and a token issued in that
second after the revocation is stamped with the next second instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

FREE_FAILURES = 5


@dataclass(frozen=True, slots=True)
class LoginBackoff:
    base_s: float = 1.0
    max_s: float = 900.0
    forget_s: float = 24 * 3600.0
    free_failures: int = FREE_FAILURES

    def block_s(self, failures: int) -> float:
        """How long a key is blocked after its ``failures``-th consecutive failure."""
        return backoff_s(failures, base_s=self.base_s, max_s=self.max_s, free=self.free_failures)

    def forget_before(self, now: datetime) -> datetime:
        """A key whose last failure is at or before this counts from zero again."""
        return now - timedelta(seconds=self.forget_s)


def backoff_s(failures: int, *, base_s: float, max_s: float, free: int = FREE_FAILURES) -> float:
    """0 below ``free`` failures, then ``base_s * 2 ** (failures - free)``, at most ``max_s``."""
    if failures < free:
        return 0.0
    exponent = failures - free
    if exponent >= 64:  # 2**64 s outlasts any cap; avoid float overflow
        return max_s
    return min(max_s, base_s * float(2**exponent))


def retry_after_s(blocked_until: datetime, now: datetime) -> int:
    """The Retry-After value: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil((blocked_until - now).total_seconds()))


def first_valid_iat(tokens_valid_after: datetime | None) -> int:
    """The smallest ``iat`` a user's token may carry (0: no revocation)."""
    if tokens_valid_after is None:
        return 0
    return math.floor(tokens_valid_after.timestamp()) + 1
