"""Port-bind conflict back-off (FEATURES C11), as a pure schedule.

Deleting a service and creating one on the same port races the old engine's exit (the
spec measured ~20 s). A port conflict is therefore retried — 1, 2, 4, 8, 16, 32 s and
then what is left of the budget, ~119 s in all by default — while any other launch
failure is reported at once.
"""

from __future__ import annotations

from dataclasses import dataclass

PORT_RETRY_TOTAL_S = 119.0


@dataclass(frozen=True)
class Backoff:
    total_s: float = PORT_RETRY_TOTAL_S
    first_s: float = 1.0
    factor: float = 2.0

    def next_delay(self, attempt: int, elapsed_s: float) -> float | None:
        """Seconds until the next try after ``attempt`` failures, or None: give up."""
        left = self.total_s - elapsed_s
        if left <= 0:
            return None
        return min(self.first_s * self.factor ** max(attempt - 1, 0), left)
