"""``heteroflow models`` (issue 29, H9) against a scripted API (MockTransport), and the
request rules it shares with the server (``core.model_requests``): a pull takes a source,
never a path; ``--wait`` prints each change and exits 0 on done, 1 with the node's reason
on failed; a bad source is one line and exit 2 before anything is asked."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from heteroflow import cli
from heteroflow.cmd import remote
from heteroflow.core.errors import ValidationFailed
from heteroflow.core.events import EventKind
from heteroflow.core.model_requests import (
    ModelRequestStatus,
    finished_event,
    progress_text,
    pull_source,
)

Answers = dict[str, list[Any]]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Answers], list[httpx.Request]]]:
    """``"METHOD /path"`` -> answers served one by one (the last repeats)."""

    def install(table: Answers) -> list[httpx.Request]:
        asked: list[httpx.Request] = []

        def handler(request: httpx.Request) -> httpx.Response:
            asked.append(request)
            answers = table.get(f"{request.method} {request.url.path}")
            if not answers:
                return httpx.Response(404, json={"error": {"code": "not_found", "message": "no"}})
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            return answer if isinstance(answer, httpx.Response) else httpx.Response(
                202 if request.method == "POST" else 200, json=answer)

        monkeypatch.setattr(remote, "_client", lambda server=None: httpx.Client(
            base_url="http://hf.test", transport=httpx.MockTransport(handler)))
        return asked

    monkeypatch.setattr(time, "sleep", lambda s: None)
    yield install


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def request(status: str, message: str = "", **over: Any) -> dict[str, Any]:
    return {"id": "mrq-1", "node_id": "node-1", "node": "gpu-1", "action": "pull",
            "source": "hf://org/tiny@main", "key": "", "status": status, "message": message,
            "done_bytes": 0, "total_bytes": 0, **over}


# ---- the shared rules -------------------------------------------------------------------


@pytest.mark.parametrize("text", ["/models/x.gguf", "x.gguf", "models/qwen"])
def test_a_pull_refuses_a_path_naming_the_source_field(text: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        pull_source(text)
    assert caught.value.field == "source" and "a pull takes a model source" in str(caught.value)


def test_a_pull_takes_each_kind_of_source_in_its_canonical_form() -> None:
    assert pull_source("hf://org/tiny").text == "hf://org/tiny@main"
    assert pull_source("modelscope://org/tiny").text == "modelscope://org/tiny@master"
    assert pull_source("HTTPS://Host.example/m.gguf").text == "https://host.example/m.gguf"
    assert pull_source("fleet://hf--org--tiny--0123").text == "fleet://hf--org--tiny--0123"
    with pytest.raises(ValidationFailed) as caught:
        pull_source("https://u:p@host/m.gguf")
    assert caught.value.field == "source" and "user info" in caught.value.message


def test_each_end_has_its_event() -> None:
    S = ModelRequestStatus
    assert finished_event("pull", S.DONE) is EventKind.NODE_MODEL_PULLED
    assert finished_event("evict", S.DONE) is EventKind.NODE_MODEL_EVICTED
    assert finished_event("pull", S.FAILED) is EventKind.NODE_MODEL_REQUEST_FAILED
    assert finished_event("evict", S.FAILED) is EventKind.NODE_MODEL_REQUEST_FAILED


def test_progress_reads_like_a_launch_fetch() -> None:
    assert progress_text("hf://o/n@main", 1_200_000_000, 4_500_000_000, 80e6, 45) == (
        "pulling hf://o/n@main: 1.2 GB of 4.5 GB at 80.0 MB/s, ~45 s left")
    assert progress_text("hf://o/n@main", 0, 0) == "pulling hf://o/n@main: 0 B"
    assert progress_text("x", 1, 2, 1.0, 600).endswith("~10 min left")


# ---- the CLI ------------------------------------------------------------------------------


def test_list_is_a_table_of_every_node_s_models(
    api: Callable[[Answers], list[httpx.Request]], capsys: pytest.CaptureFixture[str]
) -> None:
    asked = api({"GET /api/v1/models/cache": [[
        {"node": "gpu-1", "node_id": "node-1", "key": "hf--org--tiny--abc",
         "source": "hf://org/tiny@main", "revision": "0123456789abcdef0123456789abcdef01234567",
         "size_bytes": 1_500_000_000, "state": "complete"},
        {"node": "gpu-2", "node_id": "node-2", "key": "url--h-m.gguf--def",
         "source": "https://h/m.gguf", "revision": "", "size_bytes": 5_000, "state": "downloading"},
    ]]})
    code, out, err = run(["models", "list", "--node", "gpu 1"], capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NODE", "KEY", "SOURCE", "REVISION", "SIZE", "STATE"]
    assert lines[1].split() == ["gpu-1", "hf--org--tiny--abc", "hf://org/tiny@main",
                                "0123456789ab", "1.5", "GB", "complete"]
    assert lines[2].split() == ["gpu-2", "url--h-m.gguf--def", "https://h/m.gguf", "-", "5.0",
                                "kB", "downloading"]
    assert asked[0].url.params["node"] == "gpu 1"
    api({"GET /api/v1/models/cache": [[]]})
    assert run(["models", "list"], capsys)[1] == "no cached models\n"


def test_pull_waits_prints_each_change_and_exits_0_when_done(
    api: Callable[[Answers], list[httpx.Request]], capsys: pytest.CaptureFixture[str]
) -> None:
    asked = api({
        "POST /api/v1/nodes/gpu-1/models/pull": [request("pending")],
        "GET /api/v1/model-requests/mrq-1": [
            request("running", "pulling hf://org/tiny@main: 1.0 MB of 2.0 MB"),
            request("running", "pulling hf://org/tiny@main: 1.0 MB of 2.0 MB"),
            request("done", "hf://org/tiny@main is in this node's cache as hf--k"),
        ],
    })
    code, out, err = run(["models", "pull", "hf://org/tiny", "--node", "gpu-1", "--wait"], capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "mrq-1: pull of hf://org/tiny@main on node gpu-1 (pending)"
    assert [line.split("] ", 1)[1] for line in lines[1:3]] == [
        "running — pulling hf://org/tiny@main: 1.0 MB of 2.0 MB",
        "done — hf://org/tiny@main is in this node's cache as hf--k",
    ]
    assert lines[3] == "done: hf://org/tiny@main is in this node's cache as hf--k"
    assert asked[0].read() == b'{"source":"hf://org/tiny@main"}'


def test_a_failed_evict_exits_1_with_the_node_s_reason(
    api: Callable[[Answers], list[httpx.Request]], capsys: pytest.CaptureFixture[str]
) -> None:
    evict = request("pending", action="evict", source="", key="hf--k")
    api({
        "POST /api/v1/nodes/gpu-1/models/evict": [evict],
        "GET /api/v1/model-requests/mrq-1": [{**evict, "status": "failed",
                                              "message": "refused: model hf--k is in use"}],
    })
    code, out, err = run(["models", "evict", "hf--k", "--node", "gpu-1", "--wait"], capsys)
    assert code == 1 and out.startswith("mrq-1: evict of hf--k on node gpu-1 (pending)\n")
    assert err == ("heteroflow models: evict of hf--k on node gpu-1 failed: refused: model "
                   "hf--k is in use\n")
    # without --wait: asked, and answered at once
    api({"POST /api/v1/nodes/gpu-1/models/evict": [evict]})
    assert run(["models", "evict", "hf--k", "--node", "gpu-1"], capsys) == (
        0, "mrq-1: evict of hf--k on node gpu-1 (pending)\n", "")


def test_json_answers_on_stdout_progress_on_stderr(
    api: Callable[[Answers], list[httpx.Request]], capsys: pytest.CaptureFixture[str]
) -> None:
    api({"POST /api/v1/nodes/gpu-1/models/pull": [request("pending")],
         "GET /api/v1/model-requests/mrq-1": [request("done", "held")]})
    code, out, err = run(
        ["models", "pull", "hf://org/tiny", "--node", "gpu-1", "--wait", "--json"], capsys)
    assert code == 0 and '"status": "done"' in out and "mrq-1: pull of" in err


def test_a_bad_source_is_one_line_and_exit_2_before_anything_is_asked(
    api: Callable[[Answers], list[httpx.Request]], capsys: pytest.CaptureFixture[str]
) -> None:
    asked = api({})
    code, out, err = run(["models", "pull", "/models/x.gguf", "--node", "gpu-1"], capsys)
    assert code == 2 and out == "" and asked == []
    assert len(err.splitlines()) == 1
    assert err.startswith("heteroflow models: source: '/models/x.gguf' is a path")


def test_the_node_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["models", "pull", "hf://org/tiny"])
    assert exited.value.code == 2 and "--node" in capsys.readouterr().err
