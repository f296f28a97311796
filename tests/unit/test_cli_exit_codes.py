"""The CLI's exit codes and where its messages go, against a scripted API (MockTransport):
0 done, 1 refused / a wait that ended badly / something wrong, 2 unreachable / not logged in."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow import cli
from heteroflow.cmd import remote

Handler = Callable[[httpx.Request], httpx.Response]
Install = Callable[[Handler], list[str]]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[Install]:
    """Route the CLI's logged-in client to ``handler``; returns the paths asked."""

    def install(handler: Handler) -> list[str]:
        asked: list[str] = []

        def record(request: httpx.Request) -> httpx.Response:
            asked.append(f"{request.method} {request.url.path}")
            return handler(request)

        monkeypatch.setattr(
            remote,
            "_client",
            lambda server=None: httpx.Client(
                base_url="http://hf.test", transport=httpx.MockTransport(record)
            ),
        )
        return asked

    yield install


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """time.sleep advances a fake monotonic clock instead of pausing."""
    now = [1000.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(time, "sleep", sleep)  # the module waiting.py calls them on
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    return now


def routes(table: dict[str, Any]) -> Handler:
    """``"GET /path"`` -> JSON (a list of answers is served one by one, the last repeats);
    an ``httpx.Response`` is returned as is; anything unlisted is a 404."""

    def handler(request: httpx.Request) -> httpx.Response:
        answer = table.get(f"{request.method} {request.url.path}")
        if answer is None:
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "no"}})
        if isinstance(answer, list) and answer and isinstance(answer[0], Step):
            step = answer.pop(0) if len(answer) > 1 else answer[0]
            answer = step.value
        if isinstance(answer, httpx.Response):
            return answer
        return httpx.Response(200, json=answer)

    return handler


class Step:
    def __init__(self, value: Any) -> None:
        self.value = value


def group(status: str, message: str = "", task_status: str | None = None) -> dict[str, Any]:
    return {
        "id": "tg-1",
        "name": "svc",
        "model_name": "m",
        "status": status,
        "status_message": "",
        "endpoint": "ep-1",
        "current_replicas": 1,
        "tasks": [
            {
                "id": "task-1",
                "rank": 0,
                "status": task_status or status,
                "status_message": message,
                "node_id": None,
                "ports": [],
            }
        ],
    }


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ---- failures: one line on stderr and the right code --------------------------------


def test_an_http_error_exits_1_with_the_message_on_stderr(
    api: Install, capsys: pytest.CaptureFixture[str]
) -> None:
    api(routes({}))
    code, out, err = run(["services", "show", "tg-9"], capsys)
    assert (code, out, err) == (1, "", "heteroflow services: error 404: no\n")


def test_connection_refused_is_one_line_and_exit_2(
    api: Install, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    api(refuse)
    for argv in (["nodes"], ["services", "list"], ["status"], ["logs", "task-1"]):
        code, out, err = run(argv, capsys)
        assert code == 2 and out == ""
        assert err.splitlines() == [
            f"heteroflow {argv[0]}: cannot reach the server at http://hf.test: "
            "[Errno 111] Connection refused"
        ]


def test_not_logged_in_names_heteroflow_login_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HETEROFLOW_CLI_DIR", str(tmp_path))
    for argv in (["nodes"], ["status"], ["status", "--json"], ["users", "list"]):
        code, _, err = run(argv, capsys)
        assert code == 2
        assert err.count("\n") == 1 and "`heteroflow login" in err
    assert not any(tmp_path.iterdir())


def test_a_rejected_token_says_to_log_in_again_and_exits_2(
    api: Install, capsys: pytest.CaptureFixture[str]
) -> None:
    expired = httpx.Response(401, json={"error": {"code": "unauthorized", "message": "expired"}})
    api(routes({"GET /api/v1/nodes": expired}))
    code, _, err = run(["nodes"], capsys)
    assert (
        code == 2 and err == "heteroflow nodes: error 401: expired: run `heteroflow login` again\n"
    )


def test_an_answer_that_is_not_json_exits_1(
    api: Install, capsys: pytest.CaptureFixture[str]
) -> None:
    api(routes({"GET /api/v1/nodes": httpx.Response(200, text="<html>")}))
    code, _, err = run(["nodes"], capsys)
    assert code == 1 and "not JSON" in err and err.count("\n") == 1


# ---- --json: the API's answer unchanged -----------------------------------------------


@pytest.mark.parametrize(
    ("argv", "path"),
    [
        (["nodes", "--json"], "GET /api/v1/nodes"),
        (["services", "list", "--json"], "GET /api/v1/task-groups"),
        (["services", "show", "tg-1", "--json"], "GET /api/v1/task-groups/tg-1"),
        (["tasks", "show", "task-1", "--json"], "GET /api/v1/tasks/task-1"),
        (["tenants", "list", "--json"], "GET /api/v1/tenants"),
        (["users", "list", "--json"], "GET /api/v1/users"),
        (["sharing-groups", "list", "--json"], "GET /api/v1/sharing-groups"),
        (["sharing-groups", "show", "sg-1", "--json"], "GET /api/v1/sharing-groups/sg-1"),
    ],
)
def test_json_prints_the_api_answer_unchanged(
    api: Install, capsys: pytest.CaptureFixture[str], argv: list[str], path: str
) -> None:
    answer: Any = [{"id": "x-1", "nested": {"a": [1, 2]}, "unknown_field": None}]
    if "show" in argv:
        answer = answer[0]
    asked = api(routes({path: answer}))
    code, out, _ = run(argv, capsys)
    assert code == 0 and json.loads(out) == answer and asked == [path]


def test_empty_lists_say_so(api: Install, capsys: pytest.CaptureFixture[str]) -> None:
    api(routes({"GET /api/v1/nodes": [], "GET /api/v1/task-groups": []}))
    assert run(["nodes"], capsys) == (0, "no nodes\n", "")
    assert run(["services", "list"], capsys) == (0, "no services\n", "")


# ---- --wait ---------------------------------------------------------------------------


def create(api: Install, *states: dict[str, Any]) -> list[str]:
    return api(
        routes(
            {
                "POST /api/v1/task-groups": {
                    **group("pending", "waiting for the scheduler"),
                    "api_key": "sk-1",
                },
                "GET /api/v1/task-groups/tg-1": [Step(s) for s in states],
            }
        )
    )


def test_a_wait_that_ends_running_exits_0_with_progress_and_elapsed_seconds(
    api: Install, capsys: pytest.CaptureFixture[str], fake_time: list[float]
) -> None:
    create(
        api,
        group("pending", "waiting for the scheduler"),
        group("scheduling", "loading model", "starting"),
        group("scheduling", "loading model", "starting"),
        group("running"),
    )
    code, out, err = run(["services", "create", "--name", "svc"], capsys)
    assert code == 0 and err == ""
    assert out.splitlines() == [
        "created tg-1 (endpoint ep-1)",
        "model name to call: m",  # issue 33: what clients put in "model"
        "API key (shown once): sk-1",
        "  [0s] pending — waiting for the scheduler",
        "  [0s] scheduling — loading model",
        "  [2s] running",
        "service tg-1 is running",
    ]


@pytest.mark.parametrize("end", ["failed", "stopped"])
def test_a_wait_that_ends_failed_or_stopped_exits_1(
    api: Install, capsys: pytest.CaptureFixture[str], fake_time: list[float], end: str
) -> None:
    create(api, group("pending"), group(end, "engine exited 1\nlog tail"))
    code, out, err = run(["services", "create", "--name", "svc", "--image", "img"], capsys)
    assert code == 1
    assert out.splitlines()[-1] == f"  [0s] {end} — engine exited 1"
    assert err == f"heteroflow services: service tg-1 ended {end}: engine exited 1\n"


def test_a_wait_that_times_out_exits_1_and_says_where_it_stood(
    api: Install, capsys: pytest.CaptureFixture[str], fake_time: list[float]
) -> None:
    create(api, group("pending", "InsufficientResources: 0/1 nodes fit"))
    code, _, err = run(["services", "create", "--name", "svc", "--timeout", "5"], capsys)
    assert code == 1
    assert err.startswith("heteroflow services: timed out after 5 s waiting for service tg-1")
    assert "(now: pending — InsufficientResources: 0/1 nodes fit)" in err
    assert err.count("\n") == 1


def test_no_wait_returns_after_create_and_json_keeps_stdout_for_the_answer(
    api: Install, capsys: pytest.CaptureFixture[str], fake_time: list[float]
) -> None:
    asked = create(api, group("running"))
    assert run(["services", "create", "--name", "svc", "--no-wait"], capsys)[0] == 0
    assert asked == ["POST /api/v1/task-groups"]
    code, out, err = run(["services", "create", "--name", "svc", "--json"], capsys)
    assert code == 0 and json.loads(out)["api_key"] == "sk-1"
    assert "  [0s] running" in err.splitlines()


def test_tasks_stop_wait_follows_the_task_until_stopped(
    api: Install, capsys: pytest.CaptureFixture[str], fake_time: list[float]
) -> None:
    t = group("running")["tasks"][0]
    asked = api(
        routes(
            {
                "POST /api/v1/tasks/task-1/stop": {**t, "status": "stopping"},
                "GET /api/v1/tasks/task-1": [
                    Step({**t, "status": "stopping", "status_message": "stopped by admin"}),
                    Step({**t, "status": "stopped", "status_message": "stopped by admin"}),
                ],
            }
        )
    )
    code, out, _ = run(["tasks", "stop", "task-1", "--wait"], capsys)
    assert code == 0
    assert out.splitlines() == [
        "stopping task-1 (now stopping)",
        "  [0s] stopping — stopped by admin",
        "  [0s] stopped — stopped by admin",
        "task task-1 has stopped",
    ]
    assert asked[0] == "POST /api/v1/tasks/task-1/stop"


def test_services_delete_wait_follows_every_task_until_it_ended(
    api: Install, capsys: pytest.CaptureFixture[str], fake_time: list[float]
) -> None:
    t = group("running")["tasks"][0]
    api(
        routes(
            {
                "GET /api/v1/task-groups/tg-1": group("running"),
                "DELETE /api/v1/task-groups/tg-1": httpx.Response(204),
                "GET /api/v1/tasks/task-1": [
                    Step({**t, "status": "stopping"}),
                    Step({**t, "status": "stopped"}),
                ],
            }
        )
    )
    code, out, _ = run(["services", "delete", "tg-1", "--wait"], capsys)
    assert code == 0
    assert out.splitlines() == [
        "deleted tg-1",
        "  [0s] 0/1 tasks ended (1 stopping)",
        "  [0s] 1/1 tasks ended (1 stopped)",
        "every task of tg-1 has stopped",
    ]


# ---- status ---------------------------------------------------------------------------


def node(status: str) -> dict[str, Any]:
    return {"name": f"n-{status}", "status": status, "gpus": [], "address": "10.0.0.1"}


def platform(nodes: list[dict[str, Any]], groups: list[dict[str, Any]], servers: Any) -> Handler:
    return routes(
        {
            "GET /healthz": {"status": "ok"},
            "GET /api/v1/servers": servers,
            "GET /api/v1/nodes": nodes,
            "GET /api/v1/task-groups": groups,
        }
    )


LEADER = {
    "leader": "srv-1",
    "instances": [
        {"id": "srv-1", "hostname": "h", "port": 1, "pid": 2, "version": "0.1.0", "is_leader": True}
    ],
}
FORBIDDEN = httpx.Response(403, json={"error": {"code": "forbidden", "message": "operators"}})


@pytest.mark.parametrize(
    ("nodes", "groups", "servers", "code"),
    [
        ([node("online")], [group("running")], LEADER, 0),
        ([node("online")], [group("running")], FORBIDDEN, 0),  # a member: no servers list
        ([node("online"), node("offline")], [group("running")], LEADER, 1),
        ([node("online")], [group("failed", "exit 1")], LEADER, 1),
        ([node("online")], [group("pending", "InsufficientResources")], FORBIDDEN, 1),
        ([], [], LEADER, 1),
    ],
)
def test_status_exits_0_when_nothing_is_wrong_else_1(
    api: Install,
    capsys: pytest.CaptureFixture[str],
    nodes: list[dict[str, Any]],
    groups: list[dict[str, Any]],
    servers: Any,
    code: int,
) -> None:
    api(platform(nodes, groups, servers))
    got, out, err = run(["status"], capsys)
    assert (got, err) == (code, "")
    assert ("nothing is wrong" in out) == (code == 0)
    got, out, _ = run(["status", "--json"], capsys)
    summary = json.loads(out)
    assert got == code and summary["ok"] == (code == 0)
    assert summary["servers"]["visible"] == (servers is LEADER)


def test_status_json_when_unreachable_still_prints_json_and_exits_2(
    api: Install, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    api(refuse)
    code, out, err = run(["status", "--json"], capsys)
    assert code == 2 and json.loads(out)["ok"] is False and "cannot reach" in err


# ---- help -----------------------------------------------------------------------------


def _parsers(
    parser: argparse.ArgumentParser, path: str = "heteroflow"
) -> Iterator[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    for action in parser._actions:
        yield path, parser, action
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                assert helps.get(name), f"{path} {name} has no help"
                yield from _parsers(sub, f"{path} {name}")


def test_every_command_and_flag_has_help_and_the_top_help_is_for_users() -> None:
    parser = cli.build_parser()
    # `up` is another engineer's block; every other command and flag explains itself
    missing = [
        f"{path} {action.option_strings or action.dest}"
        for path, _, action in _parsers(parser)
        if not action.help
        and not path.startswith("heteroflow up")
        and not isinstance(action, argparse._SubParsersAction)
    ]
    assert missing == []
    text = parser.format_help()
    assert "Entry points" not in text and "delegates to" not in text  # not developer notes
    examples = text.split("examples:")[1].split("\n\n")[0].strip().splitlines()
    assert len(examples) == 3 and all(e.strip().startswith("heteroflow ") for e in examples)
