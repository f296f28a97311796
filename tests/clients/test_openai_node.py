"""The OpenAI Node SDK against the gateway in front of a real llama.cpp engine.

``node/sdk_check.mjs`` makes the calls a Node developer makes (chat, a stream, a tool
call, errors) and prints one JSON line; the assertions are here. Node comes from
Debian's packages (``scripts/test`` installs ``nodejs`` and ``npm`` when they are missing
and it runs as root); the SDK version is pinned by ``node/package-lock.json`` and
installed with ``npm ci`` into ``node/node_modules`` (git-ignored) the first time, and
again only when the lock file changes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import KEY, MODEL, TOOL_MESSAGES, WEATHER_TOOL, Stack

NODE_DIR = Path(__file__).parent / "node"


def _install_sdk() -> None:
    """Makes ``node_modules`` match the lock file (``npm ci``) unless it already does."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed (scripts/test installs them as root)")
    lock = hashlib.sha256((NODE_DIR / "package-lock.json").read_bytes()).hexdigest()[:16]
    stamp = NODE_DIR / "node_modules" / f".heteroflow-lock-{lock}"
    if not stamp.exists():
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"npm ci failed: {done.stderr}"
        stamp.touch()


@pytest.fixture(scope="module")
def node_result(stack: Stack) -> dict[str, Any]:
    _install_sdk()
    done = subprocess.run(
        [
            "node",
            "sdk_check.mjs",
            stack.url,
            KEY,
            MODEL,
            json.dumps(WEATHER_TOOL),
            json.dumps(TOOL_MESSAGES),
        ],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.feature("M1")
def test_chat(node_result: dict[str, Any]) -> None:
    chat = node_result["chat"]
    assert "threw" not in chat, chat
    assert isinstance(chat["content"], str) and len(chat["content"]) == 8
    assert chat["finish"] == "length" and chat["completionTokens"] == 8


@pytest.mark.feature("M13")
def test_chat_answer_has_a_request_id(node_result: dict[str, Any]) -> None:
    assert node_result["chat"].get("requestID"), node_result["chat"]


@pytest.mark.feature("M1")
def test_stream(node_result: dict[str, Any]) -> None:
    stream, chat = node_result["stream"], node_result["chat"]
    assert "threw" not in stream, stream
    assert stream["text"] == chat["content"]
    assert stream["usage"] == 8 and stream["finish"] == "length"


@pytest.mark.feature("M13")
def test_tool_choice_required_gives_a_tool_call(node_result: dict[str, Any]) -> None:
    tools = node_result["tools"]
    assert "threw" not in tools, tools
    assert tools["calls"] and {c["name"] for c in tools["calls"]} == {"get_weather"}, tools
    call = tools["calls"][0]
    assert call["type"] == "function" and call["id"]
    assert json.loads(call["arguments"])["city"] in ("Paris", "Rome")


@pytest.mark.feature("M12")
def test_unknown_model_is_not_found_error(node_result: dict[str, Any]) -> None:
    err = node_result["notFound"]
    assert err["name"] == "NotFoundError" and err["status"] == 404, err
    assert err["code"] == "model_not_found"
    assert err["requestID"], err


@pytest.mark.feature("M12")
@pytest.mark.feature("M13")
def test_bad_temperature_is_bad_request_naming_the_param(node_result: dict[str, Any]) -> None:
    err = node_result["badTemperature"]
    assert err.get("name") == "BadRequestError", err
    assert err["status"] == 400 and err["param"] == "temperature"
    assert err["codeType"] in ("string", "object"), err  # a string or null, never a number


@pytest.mark.feature("M12")
@pytest.mark.feature("M13")
def test_overlong_prompt_has_a_string_code(node_result: dict[str, Any]) -> None:
    err = node_result["overlong"]
    assert err.get("name") == "BadRequestError" and err["status"] == 400, err
    assert err["codeType"] == "string", err  # the issue: Node users got a numeric e.code
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error" and err["param"] == "messages"
