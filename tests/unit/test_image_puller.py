"""agent.runtime.pulls (H7) against a stand-in Engine API: pulled only when absent, one
pull per image however many launches wait on it, the login only as the pull's
auth_config, the stream's errors classified, the deadline kept. The real Engine and a
real registry: tests/docker/test_registry_pull.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import docker.errors
import pytest

from heteroflow.agent.runtime.protocol import PullFailed
from heteroflow.agent.runtime.pulls import ImagePuller
from heteroflow.core.images import PullFailure, PullProgress

pytestmark = pytest.mark.feature("H7")

LAYERS = [
    {"status": "Pulling fs layer", "progressDetail": {}, "id": "a"},
    {"status": "Downloading", "progressDetail": {"current": 50, "total": 100}, "id": "a"},
    {"status": "Download complete", "progressDetail": {}, "id": "a"},
    {"status": "Pull complete", "progressDetail": {}, "id": "a"},
]


class FakeApi:
    def __init__(self, events: list[dict[str, Any]], *, gate: threading.Event | None = None,
                 error: Exception | None = None) -> None:
        self.images: set[str] = set()
        self.events = events
        self.gate = gate
        self.error = error
        self.pulls: list[tuple[str, dict[str, Any]]] = []
        self.closed = 0

    def inspect_image(self, image: str) -> dict[str, Any]:
        if image not in self.images:
            raise docker.errors.ImageNotFound("no such image")
        return {"Id": image}

    def pull(self, image: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        self.pulls.append((image, kwargs))
        if self.error is not None:
            raise self.error
        return self._stream(image)

    def _stream(self, image: str) -> Iterator[dict[str, Any]]:
        try:
            for i, event in enumerate(self.events):
                if i == 1 and self.gate is not None:
                    self.gate.wait(5)
                yield event
            if not any("error" in e for e in self.events):
                self.images.add(image)
        finally:
            self.closed += 1


class FakeClient:
    def __init__(self, api: FakeApi) -> None:
        self.api = api


def test_a_present_image_is_not_pulled() -> None:
    api = FakeApi(LAYERS)
    api.images.add("reg:5000/e:v1")
    assert ImagePuller(FakeClient(api)).ensure("reg:5000/e:v1", None, 10) is False
    assert api.pulls == []


def test_an_absent_image_is_pulled_with_the_login_as_auth_config() -> None:
    api = FakeApi(LAYERS)
    seen: list[str] = []
    auth = {"username": "bot", "password": "pw-123456"}
    assert ImagePuller(FakeClient(api)).ensure(
        "reg:5000/e:v1", auth, 10, lambda p: seen.append(p.text())
    )
    assert api.pulls == [("reg:5000/e:v1", {"stream": True, "decode": True,
                                             "auth_config": auth})]
    assert "50 B of 100 B" in seen[1] and "100 B of 100 B (1 of 1 layers)" in seen[-1]


def test_concurrent_launches_of_one_image_share_one_pull() -> None:
    gate = threading.Event()
    api = FakeApi(LAYERS, gate=gate)
    puller = ImagePuller(FakeClient(api))
    heard: dict[int, list[PullProgress]] = {0: [], 1: [], 2: []}
    results: dict[int, bool] = {}

    def launch(i: int) -> None:
        results[i] = puller.ensure("reg:5000/e:v1", None, 10, heard[i].append)

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for _ in range(250):  # every launch waits on the one pull before it goes on
        pull = puller._pulls.get("reg:5000/e:v1")
        if pull is not None and len(pull.listeners) == 3:
            break
        time.sleep(0.02)
    gate.set()
    for t in threads:
        t.join(5)
    assert results == {0: True, 1: True, 2: True}
    assert len(api.pulls) == 1 and puller.pulls_started == 1
    assert all(heard[i] for i in heard)  # each waiter heard the progress


def test_waiters_share_the_failure_of_the_pull_they_waited_on() -> None:
    gate = threading.Event()
    events = [LAYERS[0], {"errorDetail": {"message": "manifest unknown"},
                          "error": "manifest unknown"}]
    api = FakeApi(events, gate=gate)
    puller = ImagePuller(FakeClient(api))
    errors: dict[int, PullFailed] = {}

    def launch(i: int) -> None:
        try:
            puller.ensure("reg:5000/e:nope", None, 10)
        except PullFailed as exc:
            errors[i] = exc

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(5)
    assert {e.kind for e in errors.values()} == {PullFailure.NOT_FOUND} and len(errors) == 2
    assert len(api.pulls) == 1 and api.closed == 1
    assert str(errors[0]).startswith("image pull failed (not found): reg:5000/e:nope")


def test_the_engine_refusing_the_pull_is_classified() -> None:
    refused = docker.errors.APIError(
        "500 Server Error", explanation="Head https://reg:5000/v2/e/manifests/v1: "
        "no basic auth credentials"
    )
    api = FakeApi(LAYERS, error=refused)
    with pytest.raises(PullFailed) as info:
        ImagePuller(FakeClient(api)).ensure("reg:5000/e:v1", None, 10)
    assert info.value.kind == PullFailure.UNAUTHORISED
    assert "credential for reg:5000" in str(info.value)


def test_a_pull_past_its_deadline_is_abandoned_as_a_timeout() -> None:
    clock = iter([0.0, 0.0, 5.0, 11.0, 20.0, 30.0])
    api = FakeApi(LAYERS)
    puller = ImagePuller(FakeClient(api), monotonic=lambda: next(clock))
    with pytest.raises(PullFailed) as info:
        puller.ensure("reg:5000/e:v1", None, 10)
    assert info.value.kind == PullFailure.TIMEOUT and "within 10 s" in str(info.value)
    assert api.closed == 1  # the stream was closed: the Engine cancels the pull
    assert puller._pulls == {}  # the next launch pulls afresh


def test_a_silent_stream_meets_the_socket_timeout() -> None:
    api = FakeApi(LAYERS, error=OSError("HTTPConnectionPool: Read timed out."))
    with pytest.raises(PullFailed) as info:
        ImagePuller(FakeClient(api)).ensure("reg:5000/e:v1", None, 10)
    assert info.value.kind == PullFailure.TIMEOUT
