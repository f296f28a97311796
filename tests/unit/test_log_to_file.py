"""``up`` keeps its terminal for its progress (issue 33): INFO lines go to the log file,
warnings and errors to both; the file is owner-only and redacted like the terminal."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from heteroflow.logs import make_handler, to_file


@pytest.fixture
def root() -> Iterator[logging.Logger]:
    logger = logging.getLogger()
    saved, level = logger.handlers[:], logger.level
    yield logger
    for h in logger.handlers:
        if h not in saved:
            h.close()
    logger.handlers[:] = saved
    logger.setLevel(level)


def test_info_goes_to_the_file_warnings_to_both(root: logging.Logger, tmp_path: Path) -> None:
    terminal = io.StringIO()
    root.handlers[:] = [make_handler("text", terminal)]
    root.setLevel(logging.INFO)
    path = to_file(tmp_path / "logs" / "heteroflow.log")
    log = logging.getLogger("heteroflow.test")
    log.info("scheduler placed 1 task(s)")
    log.warning("password=hunter2hunter2 was rejected")
    for h in root.handlers:
        h.flush()
    text = path.read_text()
    assert "scheduler placed" in text and "scheduler placed" not in terminal.getvalue()
    assert "was rejected" in text and "was rejected" in terminal.getvalue()
    assert "hunter2" not in text + terminal.getvalue()  # redacted in both
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_verbose_process_keeps_everything_on_the_terminal(
    root: logging.Logger, tmp_path: Path
) -> None:
    terminal = io.StringIO()
    root.handlers[:] = [make_handler("json", terminal)]
    root.setLevel(logging.DEBUG)
    path = to_file(tmp_path / "up.log")
    logging.getLogger("heteroflow.test").info("loaded")
    for h in root.handlers:
        h.flush()
    assert '"message": "loaded"' in terminal.getvalue()
    assert '"message": "loaded"' in path.read_text()  # the process's format, JSON here
