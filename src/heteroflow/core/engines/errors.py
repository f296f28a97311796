"""The error of the command-line builders (kept apart so kv_offload and commands share it)."""

from __future__ import annotations


class CommandError(ValueError):
    """An engine/shape/option combination we refuse to launch; the message says why."""
