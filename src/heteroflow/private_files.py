"""Owner-only files for what the platform writes: the database, task logs, tokens.

The database holds the JWT signing secret, the node and gateway tokens and password
hashes; task logs hold whatever an engine prints. Every process root (server, agent,
``up``) also sets the umask to 0o077 (``PRIVATE_UMASK``) so that anything else it
creates is owner-only too; these helpers make the important files right even when the
code runs as a library under another umask (tests, embedding).

Existing directories keep their mode: ``--data-dir /srv/shared`` must never chmod a
directory the operator owns. Files the platform owns are always set to 0600.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_UMASK = 0o077


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) owner-only; an existing directory is left as is."""
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def private_file(path: Path) -> Path:
    """Make ``path`` exist as an owner-only file (0600), created so if it is new."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path
