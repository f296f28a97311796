"""issue 33, the CLI's part of "the first week without surprises": every input error is
one line with its exit code (never a traceback), ``login`` asks the server before the
password and reads it without a terminal, ``services scale N`` does what it says,
``autoscale --max N`` changes only the range, ``status`` does not list a stopped
instance, ``keys`` and ``usage`` verbs. Against a scripted API (httpx MockTransport)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from heteroflow import cli
from heteroflow.cmd import remote, status

Asked = list[tuple[str, str, Any]]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[str, Any]], Asked]]:
    """``"METHOD /path"`` -> JSON answer (a list: one after the other); what was asked."""

    def install(table: dict[str, Any]) -> Asked:
        asked: Asked = []

        def handler(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content) if request.content else None
            asked.append((request.method, request.url.path, body))
            answer = table.get(f"{request.method} {request.url.path}")
            if isinstance(answer, list) and answer and isinstance(answer[0], tuple):
                answer = answer.pop(0) if len(answer) > 1 else answer[0]
                return httpx.Response(answer[0], json=answer[1])
            if answer is None:
                return httpx.Response(404, json={"error": {"message": "no"}})
            return httpx.Response(200, json=answer)

        monkeypatch.setattr(
            remote, "_client",
            lambda server=None: httpx.Client(
                base_url="http://hf.test", transport=httpx.MockTransport(handler)
            ),
        )
        return asked

    yield install


# ---- input errors: one line, exit 2, at the door ----


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["up", "--port", "99999"], "--port"),  # was an OverflowError traceback
        (["up", "--port", "-1"], "--port"),
        (["server", "--port", "65536"], "--port"),
        (["gateway", "--port", "http"], "--port"),
        (["up", "--threads", "0"], "--threads"),
        (["services", "create", "--name", "x", "--gpus", "-1"], "--gpus"),
        (["services", "scale", "tg-1", "0"], "replicas"),
        (["services", "autoscale", "tg-1", "--max", "0"], "--max"),
        (["tenants", "update", "tn-1", "--quota-cards", "-2"], "--quota-cards"),
        (["services", "start", "tg-1", "--wait", "--timeout", "nan"], "--timeout"),
    ],
)
def test_bad_numbers_are_one_line_naming_the_argument(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert flag in one_line(err)


def test_port_zero_still_means_any_free_port() -> None:
    assert cli.build_parser().parse_args(["up", "--port", "0"]).port == 0
    assert cli.build_parser().parse_args(["server", "--port", "65535"]).port == 65535


def test_a_mistyped_flag_is_named_before_a_missing_required_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(["services", "create", "--nmae", "chat", "--model-path", "m.gguf"], capsys)
    line = one_line(err)
    assert code == 2 and "unrecognized arguments: --nmae chat" in line
    assert "did you mean --name?" in line and "required" not in line
    # nothing mistyped: the missing one is still what is said
    code, _, err = run(["services", "create", "--model-path", "m.gguf"], capsys)
    assert code == 2 and "the following arguments are required: --name" in one_line(err)
    code, _, err = run(["services", "show"], capsys)
    assert code == 2 and "required: id" in one_line(err)
    # a command without required arguments: its own parser names it, and the nearest flag
    code, _, err = run(["login", "--pasword", "x"], capsys)
    assert code == 2 and one_line(err) == (
        "heteroflow login: error: unrecognized arguments: --pasword x (did you mean --password?)"
    )


# ---- login ----


class NoTerminal(io.StringIO):
    def isatty(self) -> bool:
        return False


@pytest.fixture
def login_api(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> list[str]:
    """httpx.get / httpx.post of ``remote``: the health route answers, the login route
    takes the password "right"."""
    monkeypatch.setenv("HETEROFLOW_CLI_DIR", str(tmp_path))
    monkeypatch.delenv("HETEROFLOW_PASSWORD", raising=False)
    asked: list[str] = []

    def get(url: str, **_: Any) -> httpx.Response:
        asked.append(f"GET {url}")
        return httpx.Response(200, json={"status": "ok"})

    def post(url: str, json: dict[str, str], **_: Any) -> httpx.Response:
        asked.append(f"POST {url} {json['password']}")
        req = httpx.Request("POST", url)
        if json["password"] != "right":
            return httpx.Response(401, json={"error": {"message": "bad password"}}, request=req)
        return httpx.Response(200, json={"access_token": "t"}, request=req)

    monkeypatch.setattr(httpx, "get", get)
    monkeypatch.setattr(httpx, "post", post)
    return asked


def test_login_without_a_terminal_reads_one_line_of_stdin(
    login_api: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", NoTerminal("right\n"))
    code, out, _ = run(["login", "--server", "http://hf.test"], capsys)
    assert code == 0 and "logged in to http://hf.test as admin" in out
    assert login_api == [
        "GET http://hf.test/healthz", "POST http://hf.test/api/v1/auth/login right"
    ]


def test_login_with_nothing_on_stdin_is_one_line_not_an_eoferror(
    login_api: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", NoTerminal(""))
    code, _, err = run(["login", "--server", "http://hf.test"], capsys)
    assert code == 2 and "--password-stdin" in one_line(err)
    assert login_api == ["GET http://hf.test/healthz"]  # nothing sent without a password


def test_login_asks_the_server_before_the_password(
    login_api: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(url: str, **_: Any) -> httpx.Response:
        raise httpx.ConnectError("Connection refused")

    monkeypatch.setattr(httpx, "get", refused)

    class Untouchable:
        def isatty(self) -> bool:
            return False

        def readline(self) -> str:
            raise AssertionError("the password was asked before the server was")

    monkeypatch.setattr("sys.stdin", Untouchable())
    code, _, err = run(["login", "--server", "http://127.0.0.1:9"], capsys)
    assert code == 2 and "cannot reach the server at http://127.0.0.1:9" in one_line(err)


# ---- scale and autoscale ----


def group(lo: int, hi: int, autoscaling: bool = False, now: int = 1) -> dict[str, Any]:
    policy = {"enabled": autoscaling, "metric": "inflight", "target": 4.0} if autoscaling else {}
    return {
        "id": "tg-1", "name": "chat", "status": "running", "min_replicas": lo,
        "max_replicas": hi, "current_replicas": now, "scale_policy": policy, "tasks": [],
    }


def test_scale_above_the_range_widens_it_when_autoscaling_is_off(
    api: Callable[[dict[str, Any]], Asked], capsys: pytest.CaptureFixture[str]
) -> None:
    asked = api({
        "GET /api/v1/task-groups/tg-1": group(1, 1),
        "PUT /api/v1/task-groups/tg-1/scale-policy": group(1, 2),
        "PUT /api/v1/task-groups/tg-1/scale": group(1, 2, now=2),
    })
    code, out, _ = run(["services", "scale", "tg-1", "2"], capsys)
    assert code == 0
    assert asked[1:] == [
        ("PUT", "/api/v1/task-groups/tg-1/scale-policy",
         {"enabled": False, "min_replicas": 1, "max_replicas": 2}),
        ("PUT", "/api/v1/task-groups/tg-1/scale", {"replicas": 2}),
    ]
    assert "widened to 1-2" in out and "scaling tg-1 to 2 replica(s)" in out


def test_scale_within_the_range_only_scales(
    api: Callable[[dict[str, Any]], Asked], capsys: pytest.CaptureFixture[str]
) -> None:
    asked = api({
        "GET /api/v1/task-groups/tg-1": group(1, 3),
        "PUT /api/v1/task-groups/tg-1/scale": group(1, 3, now=2),
    })
    assert run(["services", "scale", "tg-1", "2"], capsys)[0] == 0
    assert [a[:2] for a in asked] == [
        ("GET", "/api/v1/task-groups/tg-1"), ("PUT", "/api/v1/task-groups/tg-1/scale")
    ]


def test_scale_outside_an_autoscaling_range_says_how_to_widen_it(
    api: Callable[[dict[str, Any]], Asked], capsys: pytest.CaptureFixture[str]
) -> None:
    asked = api({"GET /api/v1/task-groups/tg-1": group(1, 3, autoscaling=True)})
    code, _, err = run(["services", "scale", "tg-1", "5"], capsys)
    line = one_line(err)
    assert code == 1 and "services autoscale tg-1 --max 5" in line and "[1, 3]" in line
    assert [a[0] for a in asked] == ["GET"]  # the autoscaler's range is not moved


def test_autoscale_max_alone_changes_only_the_range(
    api: Callable[[dict[str, Any]], Asked], capsys: pytest.CaptureFixture[str]
) -> None:
    asked = api({
        "GET /api/v1/task-groups/tg-1": group(1, 1),
        "PUT /api/v1/task-groups/tg-1/scale-policy": group(1, 2),
    })
    code, out, _ = run(["services", "autoscale", "tg-1", "--max", "2"], capsys)
    assert code == 0 and "autoscaling off; replicas 1-2" in out
    assert asked[-1] == (
        "PUT", "/api/v1/task-groups/tg-1/scale-policy", {"enabled": False, "max_replicas": 2}
    )
    # a metric turns it on, as before (no read needed)
    asked.clear()
    run(["services", "autoscale", "tg-1", "--metric", "inflight", "--target", "4"], capsys)
    assert asked == [("PUT", "/api/v1/task-groups/tg-1/scale-policy",
                      {"enabled": True, "metric": "inflight", "target": 4.0})]


# ---- status: a stopped instance is not a server ----


def instance(iid: str, started: str, port: int = 3333) -> dict[str, Any]:
    return {"id": iid, "hostname": "h1", "address": "127.0.0.1", "port": port, "pid": 9,
            "version": "0.2.0", "is_leader": iid == "srv-new", "started_at": started,
            "last_seen_at": "2026-01-01T10:05:00Z"}


def test_status_does_not_list_the_process_a_restart_replaced() -> None:
    raw = {
        "url": "http://hf.test", "health_code": 200, "health": {"status": "ok"},
        "servers": {"leader": "srv-new", "instances": [
            instance("srv-old", "2026-01-01T10:00:00Z"),
            instance("srv-new", "2026-01-01T10:05:00Z"),
            instance("srv-other", "2026-01-01T09:00:00Z", port=3334),  # HA: a second one
        ]},
        "nodes": [], "groups": [],
    }
    summary = status.summarize(raw)
    assert [i["id"] for i in summary["servers"]["instances"]] == ["srv-new", "srv-other"]
    assert summary["servers"]["stopped_instances"] == 1
    text = status.render(summary)
    assert "2 instances, leader srv-new (1 stopped one(s) not listed" in text
    assert "srv-old" not in text


def test_status_does_not_list_an_instance_silent_for_over_a_lease_ttl() -> None:
    """A restart on another port (``up --port 0``): the old process's address is not
    reused, but it stopped heartbeating; the TTL is the leader's (lease end - its last
    heartbeat), here 10 s."""
    raw = {
        "url": "http://hf.test", "health_code": 200, "health": {"status": "ok"},
        "servers": {
            "leader": "srv-new", "lease_expires_at": "2026-01-01T10:05:10+00:00",
            "instances": [
                {**instance("srv-old", "2026-01-01T10:00:00Z", port=40001),
                 "last_seen_at": "2026-01-01T10:04:49Z"},  # 11 s before the newest
                {**instance("srv-slow", "2026-01-01T10:00:00Z", port=40003),
                 "last_seen_at": "2026-01-01T10:04:52Z"},  # 8 s: late, still running
                {**instance("srv-new", "2026-01-01T10:04:00Z", port=40002),
                 "last_seen_at": "2026-01-01T10:05:00Z"},
            ],
        },
        "nodes": [], "groups": [],
    }
    summary = status.summarize(raw)
    assert [i["id"] for i in summary["servers"]["instances"]] == ["srv-slow", "srv-new"]
    assert summary["servers"]["stopped_instances"] == 1


# ---- keys and usage ----


ENDPOINT = {"id": "ep-1", "tenant_id": "tn-1", "group_id": "tg-1", "name": "chat", "port": 0,
            "external_port": 0, "key_prefix": "sk-ab12…", "rpm_limit": 60, "tpm_limit": 0,
            "quota_tokens": 0, "quota_period": "", "created_at": "2026-01-01T10:00:00Z",
            "updated_at": "2026-01-01T10:00:00Z"}


def test_keys_list_and_rotate(
    api: Callable[[dict[str, Any]], Asked], capsys: pytest.CaptureFixture[str]
) -> None:
    asked = api({
        "GET /api/v1/gateway/endpoints": [ENDPOINT, {**ENDPOINT, "id": "ep-2", "group_id": "tg-2"}],
        "GET /api/v1/task-groups/tg-1": {**group(1, 1), "endpoint": "ep-1"},
        "PATCH /api/v1/gateway/endpoints/ep-1": {**ENDPOINT, "api_key": "sk-new"},
    })
    code, out, _ = run(["keys", "list", "--service", "tg-1"], capsys)
    assert code == 0 and "sk-ab12…" in out and "rpm 60" in out and "ep-2" not in out
    code, out, _ = run(["keys", "rotate", "tg-1"], capsys)
    assert code == 0 and "shown once: sk-new" in out
    assert asked[-1] == ("PATCH", "/api/v1/gateway/endpoints/ep-1", {"rotate_key": True})
    code, out, _ = run(["keys", "revoke", "ep-1"], capsys)  # no key works: none printed
    assert code == 0 and "revoked the API key of chat" in out and "sk-new" not in out
    assert asked[-1] == ("PATCH", "/api/v1/gateway/endpoints/ep-1", {"rotate_key": True})


def test_usage_prints_the_report_as_a_table(
    api: Callable[[dict[str, Any]], Asked], capsys: pytest.CaptureFixture[str]
) -> None:
    sums = {"requests": 3, "prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}
    asked = api({"GET /api/v1/usage": {
        "start": None, "end": None, "group_by": ["service", "model"],
        "rows": [{"service_id": "tg-1", "model": "chat", **sums}], "total": sums,
    }})
    code, out, _ = run(["usage", "--service", "tg-1"], capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0] == "usage from the first record to now"
    assert lines[1].split()[:3] == ["SERVICE", "MODEL", "REQUESTS"]
    assert lines[2].split() == ["tg-1", "chat", "3", "10", "20", "30"]
    assert lines[3].split()[0] == "total" and lines[3].split()[-4:] == ["3", "10", "20", "30"]
    assert asked[0][:2] == ("GET", "/api/v1/usage")


def test_a_setting_that_does_not_parse_is_one_line_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HETEROFLOW_PORT", "abc")
    code, out, err = run(["server"], capsys)
    line = one_line(err)
    assert code == 2 and out == ""
    assert line.startswith("heteroflow server: setting HETEROFLOW_PORT") and "'abc'" in line
