"""Log lines (P3): secrets redacted from messages, arguments and tracebacks; JSON lines
with the request id of the request that wrote them."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from heteroflow.logs import (
    REQUEST_ID,
    JsonFormatter,
    RedactSecrets,
    make_handler,
    redact,
    register_secrets,
    request_id,
)

KEY = "sk-3f1c2a9e-58b4-4c1e-9d7a-0123456789ab"  # the shape of core.ids.new_api_key
NODE_TOKEN = "node-tok-8c0f4e1b77a2"  # a registered secret with no telling name around it


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger writing JSON lines to a buffer through the process's own handler."""
    out = io.StringIO()
    handler = make_handler("json", out)
    logger = logging.getLogger("heteroflow.test_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, out
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.feature("P3")
@pytest.mark.parametrize(
    ("text", "secret"),
    [
        (f"calling with {KEY}", KEY),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl", "eyJhbG"),
        ("authorization: basic YWRtaW46aHVudGVyMg==", "YWRtaW46"),
        ("login password=hunter2-long for admin", "hunter2"),
        ('body {"username": "admin", "password": "correct horse battery"}', "horse"),
        ("{'node_token': 'abc123def456'}", "abc123def456"),
        ("HETEROFLOW_GATEWAY_TOKEN=gw-secret-99 set", "gw-secret-99"),
        ("jwt_secret: s3cr3t-value, next", "s3cr3t"),
        ("x-api-key: k-777777777 sent", "k-777777777"),
        ("database postgresql://hf:pg-pass-1@db:5432/hf unreachable", "pg-pass-1"),
        (f"heartbeat refused for {NODE_TOKEN}!", NODE_TOKEN),
    ],
)
def test_secrets_are_redacted(text: str, secret: str) -> None:
    register_secrets(NODE_TOKEN)
    out = redact(text)
    assert secret not in out
    assert "***" in out


@pytest.mark.feature("P3")
def test_ordinary_words_and_display_prefixes_stay() -> None:
    register_secrets("abc")  # too short to search for: it would blank out words
    for text in (
        "key sk-3f1c… (display prefix) created",
        "max_tokens=512 prompt tokens: 12",
        "token bucket refilled; password policy applied",
        "user abc logged in from http://10.0.0.1:3333/api",
    ):
        assert redact(text) == text


@pytest.mark.feature("P3")
def test_a_secret_in_the_arguments_or_a_traceback_never_reaches_the_line(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    logger.info("key %s for tenant %s", KEY, "acme")
    try:
        raise ValueError(f"upstream said: Bearer {KEY}")
    except ValueError:
        logger.exception("call failed for token=%s", "tok-abcdef123")
    text = out.getvalue()
    assert KEY not in text and "tok-abcdef123" not in text
    first, second = lines(out)
    assert first["message"] == "key sk-*** for tenant acme"
    assert second["message"] == "call failed for token=***"
    assert "ValueError: upstream said: Bearer ***" in str(second["exception"])


@pytest.mark.feature("P3")
def test_json_lines_carry_the_request_id_only_inside_a_request(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    logger.warning("before")
    token = REQUEST_ID.set("req_feedface")
    try:
        logger.warning("inside %d", 1)
    finally:
        REQUEST_ID.reset(token)
    logger.info("après")  # not ASCII: written as is, still one line
    before, inside, after = lines(out)
    assert set(before) == {"time", "level", "logger", "message"}
    assert inside["request_id"] == "req_feedface" and inside["message"] == "inside 1"
    assert inside["level"] == "WARNING" and inside["logger"] == "heteroflow.test_logs"
    assert str(inside["time"]).endswith("+00:00")
    assert "request_id" not in after and after["message"] == "après"


@pytest.mark.feature("P3")
def test_a_multi_line_message_is_still_one_json_line() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "a\nb", None, None)
    text = JsonFormatter().format(record)
    assert "\n" not in text and json.loads(text)["message"] == "a\nb"


@pytest.mark.feature("P3")
def test_text_stays_the_default_format() -> None:
    out = io.StringIO()
    handler = make_handler(stream=out)
    handler.handle(logging.LogRecord("hf", logging.INFO, __file__, 1, "password=x1", None, None))
    assert out.getvalue().rstrip().endswith("INFO hf: password=***")


def test_request_ids_the_caller_sent_are_kept_when_printable_and_short() -> None:
    assert request_id(b"trace-7") == "trace-7"
    for bad in (None, b"", b"a\tb", b"x" * 129, "é".encode()):
        assert request_id(bad).startswith("req_") and len(request_id(bad)) == 36


@pytest.mark.feature("P3")
def test_the_cli_takes_the_format_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from heteroflow import cli

    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        root.handlers = []
        monkeypatch.setenv("HETEROFLOW_LOG_FORMAT", "json")
        cli._logging(verbose=False)
        (handler,) = root.handlers
        assert isinstance(handler.formatter, JsonFormatter)
        root.handlers = []
        monkeypatch.delenv("HETEROFLOW_LOG_FORMAT")
        cli._logging(verbose=False)
        (handler,) = root.handlers
        assert type(handler.formatter) is logging.Formatter  # text, as before
        assert any(isinstance(f, RedactSecrets) for f in handler.filters)  # both redact
        monkeypatch.setenv("HETEROFLOW_LOG_FORMAT", "yaml")
        with pytest.raises(SystemExit) as bad:
            cli._logging(verbose=False)
        assert bad.value.code == 2
    finally:
        root.handlers, root.level = saved, level
