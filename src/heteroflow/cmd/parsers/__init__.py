"""The ``heteroflow`` command's argument parsers, one module per noun.

They import no process root: each sub-command names its root with
``set_defaults(root="heteroflow.cmd.NAME")`` and ``cli.main`` imports that module only
when the sub-command runs, so ``heteroflow agent`` never loads the server's code.
``NOUNS`` is the order the commands are listed in ``heteroflow --help``.
"""

from __future__ import annotations

from heteroflow.cmd.parsers import (
    admin,
    fleet,
    keys,
    models,
    processes,
    services,
    session,
    tenancy,
)

NOUNS = (processes, admin, session, services, keys, tenancy, fleet, models)
