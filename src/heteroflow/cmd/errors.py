"""The CLI's one failure type and its exit codes (no imports: ``cli.main`` catches it).

Exit codes of the management commands: 0 done; 1 the server said no (an HTTP error),
a wait ended ``failed``/``stopped`` or timed out, or ``status`` found something wrong;
2 the server cannot be reached, or the CLI is not logged in (nothing was asked).
"""

from __future__ import annotations

EXIT_PROBLEM = 1
EXIT_UNREACHABLE = 2
EXIT_INTERRUPTED = 130


class CliError(SystemExit):
    """One line for stderr and the exit code. A ``SystemExit`` so that, raised where no
    one catches it, it still ends the process non-zero with its message."""

    def __init__(self, message: str, exit_code: int = EXIT_PROBLEM) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message
