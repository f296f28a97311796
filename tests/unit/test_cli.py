"""The CLI's request shapes and what it prints, against a scripted API (httpx MockTransport)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from heteroflow import cli
from heteroflow.cmd import remote

Handler = Callable[[httpx.Request], httpx.Response]


class Recorder:
    """Answers each request with the next scripted response and records what was asked."""

    def __init__(self, *answers: tuple[int, Any]) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[str, str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        status, payload = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if payload is None:
            return httpx.Response(status)
        return httpx.Response(status, json=payload)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Recorder]]:
    def install(*answers: tuple[int, Any]) -> Recorder:
        rec = Recorder(*answers)
        monkeypatch.setattr(
            remote,
            "_client",
            lambda server=None: httpx.Client(
                base_url="http://hf.test", transport=httpx.MockTransport(rec)
            ),
        )
        return rec

    yield install


@pytest.mark.feature("N3")
@pytest.mark.parametrize(
    ("argv", "method", "path", "body"),
    [
        (["sharing-groups", "list"], "GET", "/api/v1/sharing-groups", None),
        (["sharing-groups", "show", "sg-1"], "GET", "/api/v1/sharing-groups/sg-1", None),
        (["sharing-groups", "create", "lab"], "POST", "/api/v1/sharing-groups", {"name": "lab"}),
        (["sharing-groups", "delete", "sg-1"], "DELETE", "/api/v1/sharing-groups/sg-1", None),
        (
            ["sharing-groups", "add-tenant", "sg-1", "tn-2"],
            "POST",
            "/api/v1/sharing-groups/sg-1/tenants",
            {"tenant_id": "tn-2"},
        ),
        (
            ["sharing-groups", "remove-tenant", "sg-1", "tn-2"],
            "DELETE",
            "/api/v1/sharing-groups/sg-1/tenants/tn-2",
            None,
        ),
        (
            ["tenants", "update", "tn-2", "--priority-ceiling", "300", "--sharing-group", "sg-1"],
            "PATCH",
            "/api/v1/tenants/tn-2",
            {"priority_ceiling": 300, "sharing_group_id": "sg-1"},
        ),
        (
            ["tenants", "update", "tn-2", "--sharing-group", "none"],
            "PATCH",
            "/api/v1/tenants/tn-2",
            {"sharing_group_id": None},
        ),
        (
            ["tenants", "create", "acme", "--priority-ceiling", "50"],
            "POST",
            "/api/v1/tenants",
            {"name": "acme", "priority_ceiling": 50},
        ),
        (["tenants", "list"], "GET", "/api/v1/tenants", None),
        (
            ["users", "create", "bob", "--password", "long-enough", "--tenant-id", "tn-2"],
            "POST",
            "/api/v1/users",
            {"username": "bob", "password": "long-enough", "role": "member", "tenant_id": "tn-2"},
        ),
    ],
)
def test_commands_send_the_right_request(
    server: Callable[..., Recorder], argv: list[str], method: str, path: str, body: Any
) -> None:
    rec = server((200, [] if argv[-1] == "list" else {"ok": True}))
    assert cli.main(argv) == 0
    assert rec.requests == [(method, path, body)]


def test_delete_without_a_body_says_what_was_deleted(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]
) -> None:
    server((204, None))
    cli.main(["sharing-groups", "delete", "sg-1"])
    assert capsys.readouterr().out.strip() == "deleted /api/v1/sharing-groups/sg-1"


def test_api_errors_exit_1_with_the_message_and_field_on_stderr(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]
) -> None:
    err = {
        "code": "conflict",
        "message": "sharing group 'lab' still has tenants: a (tn-1)",
        "field": "tenants",
    }
    server((409, {"error": err}))
    assert cli.main(["sharing-groups", "delete", "sg-1"]) == 1
    out, stderr = capsys.readouterr()
    assert out == ""
    assert stderr == f"heteroflow sharing-groups: error 409: {err['message']} (field: tenants)\n"


def group(status: str, *tasks: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "tg-1",
        "name": "svc",
        "model_name": "m",
        "status": status,
        "status_message": "",
        "endpoint": "ep-1",
        "tasks": list(tasks),
    }


def task(status: str, message: str, node: str | None = None) -> dict[str, Any]:
    return {
        "id": "task-1",
        "rank": 0,
        "status": status,
        "status_message": message,
        "node_id": node,
        "ports": [{"container_port": 8000, "host_port": 0}],
    }


@pytest.mark.feature("B2", "B5")
def test_show_prints_a_pending_tasks_whole_reason(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]
) -> None:
    reason = "InsufficientResources: 0/3 nodes fit\n2 node(s): offline\n1 node(s): cross-tenant"
    server((200, group("pending", task("pending", reason))))
    assert cli.main(["services", "show", "tg-1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "status:   pending" in out
    assert "reason:   InsufficientResources: 0/3 nodes fit" in out
    tasks_at = out.index("tasks:")
    assert out[tasks_at + 1].split() == [
        "TASK",
        "RANK",
        "STATUS",
        "NODE",
        "GPUS",
        "PORTS",
        "MESSAGE",
    ]
    assert out[tasks_at + 2].split()[:6] == ["task-1", "0", "pending", "-", "-", "8000"]
    assert out[tasks_at + 3 :] == [
        "why task-1 is pending:",
        "  InsufficientResources: 0/3 nodes fit",
        "  2 node(s): offline",
        "  1 node(s): cross-tenant",
    ]


def test_other_states_print_the_first_line_of_their_message(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]
) -> None:
    server((200, [group("failed", task("failed", "engine exited 1\nlast line\nmore", "n-1"))]))
    assert cli.main(["services", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ID", "NAME", "MODEL", "STATUS", "REPLICAS", "ENDPOINT", "REASON"]
    assert out[1].split() == ["tg-1", "svc", "m", "failed", "0/1", "ep-1", "engine", "exited", "1"]
    assert len(out) == 2


@pytest.mark.feature("B2")
def test_create_waits_and_prints_each_new_pending_reason(
    server: Callable[..., Recorder],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("heteroflow.cmd.waiting.time.sleep", lambda _s: None)  # no real pauses
    created = {**group("pending", task("pending", "waiting for the scheduler")), "api_key": None}
    rec = server(
        (201, created),
        (200, group("pending", task("pending", "waiting for the scheduler"))),
        (200, group("pending", task("pending", "InsufficientResources: 0/1 nodes fit"))),
        (200, group("pending", task("pending", "InsufficientResources: 0/1 nodes fit"))),
        (200, group("running", task("running", "", "n-1"))),
    )
    assert (
        cli.main(["services", "create", "--name", "svc", "--image", "img", "--priority", "7"]) == 0
    )
    assert rec.requests[0][2]["priority"] == 7
    out = capsys.readouterr().out.splitlines()
    progress = [line for line in out if line.startswith("  ")]
    assert progress == [
        "  [0s] pending — waiting for the scheduler",
        "  [0s] pending — InsufficientResources: 0/1 nodes fit",
        "  [0s] running",
    ]
    assert out[-1] == "service tg-1 is running"


def test_up_port_range_is_checked_at_the_door(capsys: pytest.CaptureFixture[str]) -> None:
    from heteroflow.cli import build_parser

    args = build_parser().parse_args(["up", "--port-range", "30000-30999"])
    assert args.port_range == (30000, 30999)
    for bad in ("30000", "30999-30000", "80-90", "a-b", "30000-70000"):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["up", "--port-range", bad])
        assert exc.value.code == 2
        assert "--port-range" in capsys.readouterr().err
