"""core.images (H7): an image's registry, a pull's progress over its layers, and the
failure classes a pull ends with — from Docker's and the registry's own words."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.core.images import (
    PERMANENT,
    PullFailure,
    PullProgress,
    classify,
    failure_text,
    registry_host,
    size_text,
)

pytestmark = pytest.mark.feature("H7")


@pytest.mark.parametrize(
    ("image", "host"),
    [
        ("vllm/vllm-openai:v0.11.0", "docker.io"),
        ("ubuntu", "docker.io"),
        ("library/ubuntu@sha256:" + "a" * 64, "docker.io"),
        ("ghcr.io/ggml-org/llama.cpp:server", "ghcr.io"),
        ("Registry.Example.com:5000/team/engine:v1", "registry.example.com:5000"),
        ("localhost/engine:v1", "localhost"),
        ("localhost:5000/engine", "localhost:5000"),
        ("10.0.0.5:443/x/y:z", "10.0.0.5:443"),
        ("index.docker.io/library/busybox", "docker.io"),
    ],
)
def test_the_registry_of_an_image_reference(image: str, host: str) -> None:
    assert registry_host(image) == host


def test_progress_is_summed_over_the_layers_docker_reports() -> None:
    p = PullProgress("reg:5000/engine:v2")
    assert p.text() == "pulling image reg:5000/engine:v2: starting"
    stream: list[dict[str, Any]] = [
        {"status": "Pulling from engine", "id": "v2"},
        {"status": "Pulling fs layer", "progressDetail": {}, "id": "a"},
        {"status": "Pulling fs layer", "progressDetail": {}, "id": "b"},
        {"status": "Already exists", "progressDetail": {}, "id": "c"},
        {"status": "Waiting", "progressDetail": {}, "id": "b"},
        {"status": "Downloading", "progressDetail": {"current": 1_000_000_000,
                                                     "total": 3_000_000_000}, "id": "a"},
        {"status": "Downloading", "progressDetail": {"current": 200_000_000,
                                                     "total": 1_500_000_000}, "id": "b"},
    ]
    for event in stream:
        p.feed(event)
    assert (p.downloaded, p.size) == (1_200_000_000, 4_500_000_000)
    assert p.text() == "pulling image reg:5000/engine:v2: 1.2 GB of 4.5 GB (0 of 2 layers)"
    p.feed({"status": "Download complete", "progressDetail": {}, "id": "a"})
    p.feed({"status": "Extracting", "progressDetail": {"current": 5, "total": 9}, "id": "a"})
    p.feed({"status": "Pull complete", "progressDetail": {}, "id": "a"})
    assert p.downloaded == 3_200_000_000 and p.complete == {"a"}
    assert "3.2 GB of 4.5 GB (1 of 2 layers)" in p.text()
    p.feed({"status": "Digest: sha256:abc"})  # no layer id: ignored
    p.feed({"status": "Status: Downloaded newer image for reg:5000/engine:v2"})
    assert p.error == ""


def test_an_error_line_in_the_stream_is_kept() -> None:
    p = PullProgress("x")
    p.feed({"errorDetail": {"message": "write /var/lib: no space left on device"},
            "error": "write /var/lib: no space left on device"})
    assert classify(p.error) == PullFailure.DISK_FULL


def test_junk_in_the_stream_does_not_break_the_sum() -> None:
    p = PullProgress("x")
    p.feed({"status": "Downloading", "progressDetail": {"current": "?", "total": None}, "id": "a"})
    p.feed({"status": "Downloading", "progressDetail": {"current": -5, "total": 10}, "id": "b"})
    assert (p.downloaded, p.size) == (0, 10)


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        # docker-registry (distribution 2.8) behind htpasswd, through Docker 20.10
        ('Head "https://10.0.0.1:5000/v2/engine/manifests/v1": no basic auth credentials',
         PullFailure.UNAUTHORISED),
        ("unauthorized: authentication required", PullFailure.UNAUTHORISED),
        ("Get https://r/v2/: unauthorized: incorrect username or password",
         PullFailure.UNAUTHORISED),
        ("manifest for 10.0.0.1:5000/engine:nope not found: manifest unknown: manifest unknown",
         PullFailure.NOT_FOUND),
        ("pull access denied for nosuch, repository does not exist or may require "
         "'docker login': denied: requested access to the resource is denied",
         PullFailure.NOT_FOUND),
        ("failed to register layer: write /x: no space left on device", PullFailure.DISK_FULL),
        ('Get "https://r:5000/v2/": dial tcp 10.0.0.9:5000: connect: connection refused',
         PullFailure.UNREACHABLE),
        ('Get "https://r:5000/v2/": dial tcp: lookup r: no such host', PullFailure.UNREACHABLE),
        ('Get "https://r:5000/v2/": dial tcp 10.0.0.9:5000: i/o timeout',
         PullFailure.UNREACHABLE),
        ("net/http: TLS handshake timeout", PullFailure.TIMEOUT),
        ("x509: certificate signed by unknown authority", PullFailure.UNTRUSTED),
        ("something else entirely", PullFailure.OTHER),
    ],
)
def test_failures_are_classified_by_the_registrys_words(text: str, kind: PullFailure) -> None:
    assert classify(text) == kind


def test_only_what_a_person_must_fix_is_permanent() -> None:
    assert {PullFailure.UNAUTHORISED, PullFailure.NOT_FOUND} == PERMANENT


def test_the_status_line_names_the_kind_first_and_what_to_do() -> None:
    text = failure_text("r:5000/e:v1", PullFailure.UNAUTHORISED, "no basic auth credentials")
    assert text.startswith("image pull failed (unauthorised): r:5000/e:v1; ")
    assert "registry credential for r:5000" in text and text.endswith("no basic auth credentials")
    assert failure_text("e", PullFailure.NOT_FOUND, "").startswith("image pull failed (not found)")
    untrusted = failure_text("r:5000/e", PullFailure.UNTRUSTED, "")
    assert "/etc/docker/certs.d/r:5000/ca.crt" in untrusted


def test_sizes_in_decimal_units() -> None:
    assert [size_text(n) for n in (0, 999, 1500, 2_500_000, 4_500_000_000)] == [
        "0 B", "999 B", "1.5 kB", "2.5 MB", "4.5 GB",
    ]
