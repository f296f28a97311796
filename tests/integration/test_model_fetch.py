"""A model source resolved to its manifest over HTTP (issue 29), against a real local
server the test starts: ``testing.model_hub`` stands in for huggingface.co and
modelscope.cn (this machine reaches no hub) with the routes their clients use."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from heteroflow.agent.model_cache import ModelCache
from heteroflow.core.clock import FakeClock
from heteroflow.core.model_sources import FIELD, parse_model_source
from heteroflow.models.fetch.manifest import SourceFailed
from heteroflow.models.fetch.resolve import SourceResolver
from heteroflow.testing.model_hub import COMMIT, ModelHub, Repo

pytestmark = pytest.mark.feature("H9")

TOKEN = "hf_secretTOKENvalue0123456789"
WEIGHTS = bytes(range(256)) * 64
CONFIG = b'{"model_type": "llama"}'


@pytest.fixture
def hub() -> ModelHub:
    return ModelHub(
        repos={
            "org/tiny": Repo({"config.json": CONFIG, "model.safetensors": WEIGHTS},
                             lfs=frozenset({"model.safetensors"}),
                             branches=("main", "master", "refs/pr/1")),
            "org/private": Repo({"model.gguf": WEIGHTS}, lfs=frozenset({"model.gguf"}),
                                token=TOKEN),
        },
        files={"m/tiny.gguf": WEIGHTS, "m/plain.bin": CONFIG, "m/模型 q4.gguf": CONFIG},
        sidecars={"m/tiny.gguf": f"{hashlib.sha256(WEIGHTS).hexdigest()}  tiny.gguf\n"},
    )


@pytest.fixture
async def base(hub: ModelHub) -> AsyncIterator[str]:
    server = TestServer(hub.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def resolver(base: str, timeout_s: float = 5.0) -> SourceResolver:
    return SourceResolver(hf_endpoint=base, modelscope_endpoint=base, timeout_s=timeout_s)


async def test_hugging_face_resolves_to_the_commit_sizes_and_lfs_checksums(
    hub: ModelHub, base: str
) -> None:
    m = await resolver(base).resolve(parse_model_source("hf://org/tiny"))
    assert m.revision == COMMIT
    files = {f.path: f for f in m.files}
    assert files["model.safetensors"].size == len(WEIGHTS)
    assert files["model.safetensors"].sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert files["config.json"].size == len(CONFIG)
    assert files["config.json"].sha256 is None  # a git blob id is not a sha256
    # fetched pinned to the commit, so a moving branch cannot mix two revisions
    assert files["config.json"].url == f"{base}/org/tiny/resolve/{COMMIT}/config.json"
    assert m.total_bytes == len(WEIGHTS) + len(CONFIG)
    assert m.cache_key == parse_model_source(f"hf://org/tiny@{COMMIT}").cache_key
    assert ("GET", "/api/models/org/tiny/revision/main?blobs=true", "") in hub.requests


async def test_a_revision_with_a_slash_is_one_path_segment(hub: ModelHub, base: str) -> None:
    m = await resolver(base).resolve(parse_model_source("hf://org/tiny@refs/pr/1"))
    assert m.revision == COMMIT
    assert hub.requests[-1][1] == "/api/models/org/tiny/revision/refs%2Fpr%2F1?blobs=true"


async def test_modelscope_resolves_with_checksums(base: str) -> None:
    m = await resolver(base).resolve(parse_model_source("modelscope://org/tiny"))
    files = {f.path: f for f in m.files}
    assert files["config.json"].sha256 == hashlib.sha256(CONFIG).hexdigest()
    assert files["config.json"].url == (
        f"{base}/api/v1/models/org/tiny/repo?Revision=master&FilePath=config.json"
    )
    assert m.revision == ""  # ModelScope's listing names no commit


async def test_a_url_resolves_by_head_and_its_sha256_sidecar(base: str) -> None:
    m = await resolver(base).resolve(parse_model_source(f"{base}/files/m/tiny.gguf"))
    (f,) = m.files
    assert (f.path, f.size) == ("tiny.gguf", len(WEIGHTS))
    assert f.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    plain = await resolver(base).resolve(parse_model_source(f"{base}/files/m/plain.bin"))
    assert plain.files[0].sha256 is None and plain.files[0].size == len(CONFIG)


async def test_a_server_that_answers_no_head_is_asked_for_one_byte(
    hub: ModelHub, base: str
) -> None:
    hub.head = False
    m = await resolver(base).resolve(parse_model_source(f"{base}/files/m/tiny.gguf"))
    assert m.files[0].size == len(WEIGHTS)
    assert ("GET", "/files/m/tiny.gguf", "bytes=0-0") in hub.requests


async def test_a_url_spelled_with_escapes_or_unicode_names_its_file(
    base: str, tmp_path: Path
) -> None:
    for spelled in ("m/模型%20q4.gguf", "m/%E6%A8%A1%E5%9E%8B%20q4.gguf"):
        m = await resolver(base).resolve(parse_model_source(f"{base}/files/{spelled}"))
        assert [f.path for f in m.files] == ["模型 q4.gguf"]
        entry = ModelCache(tmp_path / str(len(spelled)), clock=FakeClock())
        await entry.ensure(m)
        assert entry.entry_path(m).read_bytes() == CONFIG


@pytest.mark.parametrize(
    ("source", "reason", "says"),
    [
        ("hf://org/missing", "not_found", "hf://org/missing@main was not found or is private"),
        ("hf://org/tiny@nope", "not_found", "hf://org/tiny@nope was not found"),
        ("hf://org/private", "not_found", "or is private and the token cannot read it"),
        ("modelscope://org/missing", "not_found", "was not found"),
        ("{base}/files/m/gone.gguf", "not_found", "was not found"),
        ("fleet://some-model", "unsupported", "has no origin to ask"),
    ],
)
async def test_each_failure_has_its_reason_and_names_the_field(
    base: str, source: str, reason: str, says: str
) -> None:
    with pytest.raises(SourceFailed) as info:
        await resolver(base).resolve(parse_model_source(source.format(base=base)))
    assert (info.value.reason, info.value.field) == (reason, FIELD)
    assert says in info.value.message


async def test_a_private_repository_resolves_with_its_token(hub: ModelHub, base: str) -> None:
    m = await resolver(base).resolve(parse_model_source("hf://org/private"), token=TOKEN)
    assert [f.path for f in m.files] == ["model.gguf"]
    assert hub.auth_seen["/api/models/org/private/revision/main"] == [f"Bearer {TOKEN}"]


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


async def test_unreachable_and_timeout_are_told_apart(closed_port: int, silent_port: int) -> None:
    with pytest.raises(SourceFailed) as info:
        await resolver(f"http://127.0.0.1:{closed_port}").resolve(
            parse_model_source("hf://org/tiny"))
    assert info.value.reason == "unreachable"
    assert "could not be reached" in info.value.message
    with pytest.raises(SourceFailed) as info:
        await resolver(f"http://127.0.0.1:{silent_port}", timeout_s=0.3).resolve(
            parse_model_source("hf://org/tiny"))
    assert info.value.reason == "timeout"
    assert "did not answer in time" in info.value.message


async def test_a_token_never_travels_in_clear() -> None:
    with pytest.raises(SourceFailed) as info:
        await resolver("http://hub.mirror.internal").resolve(
            parse_model_source("hf://org/tiny"), token=TOKEN)
    assert info.value.reason == "insecure"
    assert TOKEN not in info.value.message


async def test_the_token_is_in_no_log_and_no_error(
    hub: ModelHub, base: str, caplog: pytest.LogCaptureFixture, silent_port: int
) -> None:
    caplog.set_level(logging.DEBUG)
    errors: list[str] = []
    for endpoint, source in [
        (base, "hf://org/private"), (base, "hf://org/tiny@nope"),
        (f"http://127.0.0.1:{silent_port}", "hf://org/tiny"),
    ]:
        try:
            await resolver(endpoint, timeout_s=0.3).resolve(
                parse_model_source(source), token=TOKEN + "x")
        except SourceFailed as e:
            errors.append(f"{e} {e.message!r} {e.args!r}")
    assert len(errors) == 3
    assert all(TOKEN not in text for text in errors)
    assert caplog.records  # aiohttp's access log, at least
    assert all(TOKEN not in r.getMessage() for r in caplog.records)


async def test_the_stand_in_serves_what_huggingface_hub_asks(
    tmp_path: Path, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's own client, pointed at the stand-in, lists and downloads what the
    resolver lists: the stand-in's routes are the hub's, not only the resolver's."""
    import huggingface_hub
    from huggingface_hub import HfApi, snapshot_download

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    ours = await resolver(base).resolve(parse_model_source("hf://org/tiny"))

    def with_the_client() -> tuple[str | None, dict[str, tuple[int | None, str | None]], str]:
        info = HfApi(endpoint=base, token=False).model_info("org/tiny", files_metadata=True)
        listed = {s.rfilename: (s.size, s.lfs.sha256 if s.lfs else None)
                  for s in info.siblings or []}
        folder = snapshot_download("org/tiny", endpoint=base, cache_dir=tmp_path, token=False)
        return info.sha, listed, folder

    sha, listed, folder = await asyncio.to_thread(with_the_client)
    assert sha == ours.revision
    assert listed == {f.path: (f.size, f.sha256) for f in ours.files}
    assert (Path(folder) / "model.safetensors").read_bytes() == WEIGHTS
    assert Path(folder).name == ours.revision


async def test_modelscope_takes_the_token_as_its_session_cookie(
    hub: ModelHub, base: str, tmp_path: Path
) -> None:
    source = parse_model_source("modelscope://org/private")
    with pytest.raises(SourceFailed) as info:
        await resolver(base).resolve(source)
    assert info.value.reason == "not_found"
    m = await resolver(base).resolve(source, token=TOKEN)
    assert hub.auth_seen["/api/v1/models/org/private/repo/files"] == [f"m_session_id={TOKEN}"]
    path = await ModelCache(tmp_path, clock=FakeClock()).ensure(m, token=TOKEN)
    assert (path / "model.gguf").read_bytes() == WEIGHTS
    assert hub.auth_seen["/api/v1/models/org/private/repo"] == [f"m_session_id={TOKEN}"]


async def test_a_hub_files_url_is_checked_by_the_sha256_the_hub_names(
    hub: ModelHub, base: str
) -> None:
    """A Hugging Face ``resolve`` URL of a file in LFS carries its SHA-256 in
    ``X-Linked-Etag`` — on the redirect to the CDN, which the token never follows — so
    the file is checked by checksum, not by size alone; a file in git (a blob id) is not."""
    weights = f"{base}/org/tiny/resolve/main/model.safetensors"
    expected = hashlib.sha256(WEIGHTS).hexdigest()
    assert (await resolver(base).resolve(parse_model_source(weights))).files[0].sha256 == expected
    hub.cdn_base = base  # the hub answers with a redirect to its CDN, as huggingface.co does
    (f,) = (await resolver(base).resolve(parse_model_source(weights))).files
    assert (f.sha256, f.size) == (expected, len(WEIGHTS))
    config = f"{base}/org/tiny/resolve/main/config.json"
    assert (await resolver(base).resolve(parse_model_source(config))).files[0].sha256 is None
