"""Image pulls from a real registry (H7): Debian's docker-registry with htpasswd auth and
TLS under a CA the private dockerd trusts (``heteroflow.testing.registry``), images the
tests build (a unique layer on the engine image) and push, then remove locally — so a
launch really downloads them.

Proved here: the runtime's pull shares one pull between concurrent launches and sums the
layers' progress; each failure class comes out of the real Engine and registry
(unauthorised, not found, untrusted certificate); end to end, a launch on a node without
the image pulls it with the tenant's credential and serves, two replicas share one pull,
a wrong password and a missing tag fail the task with that reason in its status (and are
not rebuilt), the password appears in no answer, event or log; a rolling update pulls the
new tag before anything drains, and one to a missing tag fails with nothing drained.
"""

from __future__ import annotations

import io
import secrets
import tarfile
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from heteroflow.agent.runtime.protocol import PullFailed
from heteroflow.agent.runtime.pulls import ImagePuller
from heteroflow.core.images import PullFailure, PullProgress
from heteroflow.testing.registry import PrivateRegistry, RegistryUnavailable, start_registry
from tests.docker.conftest import DOCKERD_DIR, _unavailable
from tests.docker.test_agent_on_docker import body, dstack  # noqa: F401 (a fixture)
from tests.e2e.conftest import Stack, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.feature("H7")]

USER = "puller"
PASSWORD = "reg-pass-" + secrets.token_hex(6)
BLOB_BYTES = 6_000_000  # a layer of its own, so a pull downloads something


@pytest.fixture(scope="module")
def registry(
    docker_client: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PrivateRegistry]:
    bridge = Path(DOCKERD_DIR) / "bridge"
    if not bridge.exists():
        _unavailable(f"the private dockerd's bridge is not recorded in {bridge}")
    address = bridge.read_text().split()[1].split("/")[0]  # "hft-x 10.213.N.1/24"
    try:
        reg = start_registry(tmp_path_factory.mktemp("registry"), address, USER, PASSWORD)
    except RegistryUnavailable as exc:
        _unavailable(str(exc))
    try:
        yield reg
    finally:
        reg.stop()


def push(docker_client: Any, reg: PrivateRegistry, base: str, tag: str) -> str:
    """An image FROM ``base`` with a random layer of its own, pushed to ``reg`` with the
    login and removed locally again (its own layer with it): absent on the node."""
    ref = reg.image(f"team/engine:{tag}")
    ctx = io.BytesIO()
    with tarfile.open(fileobj=ctx, mode="w") as tar:
        for name, data in (
            ("Dockerfile", f"FROM {base}\nCOPY blob /opt/blob-{tag}\n".encode()),
            ("blob", secrets.token_bytes(BLOB_BYTES)),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ctx.seek(0)
    docker_client.images.build(fileobj=ctx, custom_context=True, tag=ref, rm=True)
    auth = {"username": USER, "password": PASSWORD}
    for line in docker_client.api.push(ref, stream=True, decode=True, auth_config=auth):
        assert "error" not in line, line
    docker_client.images.remove(ref)
    return ref


# -- the runtime's pull against the real Engine ---------------------------------------


def test_concurrent_launches_share_one_pull_and_hear_its_progress(
    docker_client: Any, registry: PrivateRegistry, engine_image: str
) -> None:
    ref = push(docker_client, registry, engine_image, "shared-" + secrets.token_hex(3))
    puller = ImagePuller(docker_client)
    heard: dict[int, list[PullProgress]] = {0: [], 1: [], 2: []}
    pulled: dict[int, bool] = {}
    auth = {"username": USER, "password": PASSWORD}

    def launch(i: int) -> None:
        pulled[i] = puller.ensure(ref, auth, 120, heard[i].append)

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert puller.present(ref)
    assert puller.pulls_started == 1 and pulled == {0: True, 1: True, 2: True}
    last = max((p for ps in heard.values() for p in ps), key=lambda p: p.downloaded)
    assert last.size >= BLOB_BYTES and last.downloaded == last.size  # summed over layers
    assert "MB of" in last.text()
    assert puller.ensure(ref, auth, 120) is False  # present now: no pull
    docker_client.images.remove(ref)


def test_each_failure_is_named_by_what_the_registry_said(
    docker_client: Any, registry: PrivateRegistry, engine_image: str
) -> None:
    ref = push(docker_client, registry, engine_image, "fail-" + secrets.token_hex(3))
    puller = ImagePuller(docker_client)
    cases = [
        (ref, {"username": USER, "password": "wrong-" + PASSWORD}, PullFailure.UNAUTHORISED),
        (ref, None, PullFailure.UNAUTHORISED),
        (ref.rsplit(":", 1)[0] + ":no-such-tag", {"username": USER, "password": PASSWORD},
         PullFailure.NOT_FOUND),
    ]
    for image, auth, kind in cases:
        with pytest.raises(PullFailed) as info:
            puller.ensure(image, auth, 60)
        assert info.value.kind == kind, str(info.value)
        assert PASSWORD not in str(info.value)
    # the registry's certificate, no longer trusted by the Engine
    assert registry.ca_dir is not None
    kept = (registry.ca_dir / "ca.crt").read_bytes()
    (registry.ca_dir / "ca.crt").unlink()
    try:
        with pytest.raises(PullFailed) as info:
            puller.ensure(ref, {"username": USER, "password": PASSWORD}, 60)
        assert info.value.kind == PullFailure.UNTRUSTED, str(info.value)
    finally:
        (registry.ca_dir / "ca.crt").write_bytes(kept)
    assert not puller.present(ref)


# -- end to end: server, agent on Docker, the tenant's credential ---------------------


def tenant_admin(st: Stack, name: str) -> dict[str, str]:
    t = st.api("POST", "/api/v1/tenants", json={"name": name})
    assert t.status_code == 201, t.text
    u = st.api("POST", "/api/v1/users", json={
        "username": f"{name}-admin", "password": "tenant-admin-pass", "role": "tenant_admin",
        "tenant_id": t.json()["id"],
    })
    assert u.status_code == 201, u.text
    r = httpx.post(st.server_url + "/api/v1/auth/login",
                   json={"username": f"{name}-admin", "password": "tenant-admin-pass"})
    return {"Authorization": f"Bearer {r.json()['access_token']}"}


def call(st: Stack, headers: dict[str, str], method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, st.server_url + path, headers=headers, timeout=30, **kw)


def events(st: Stack, group_id: str) -> list[dict[str, Any]]:
    return list(st.api("GET", f"/api/v1/task-groups/{group_id}/events").json())


def make(st: Stack, headers: dict[str, str], b: dict[str, Any]) -> dict[str, Any]:
    b["task"].setdefault("model_path", str(st.model_file))
    b["task"]["engine"] = "llamacpp"
    # on the CPU: the load gate of GPU work (other programs' CPU use) is not this test's
    b["task"]["gpu_required"] = 0
    r = call(st, headers, "POST", "/api/v1/task-groups", json=b)
    assert r.status_code == 201, r.text
    return dict(r.json())


def no_password_anywhere(st: Stack, *answers: str) -> None:
    for text in answers:
        assert PASSWORD not in text
    assert PASSWORD not in st.logs()
    for p in st.procs:  # every line each process logged, not only the tail
        assert PASSWORD not in p.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def team(dstack: Stack, registry: PrivateRegistry) -> dict[str, str]:  # noqa: F811
    headers = tenant_admin(dstack, "pullers")
    r = call(dstack, headers, "POST", "/api/v1/registry-credentials",
             json={"registry_host": registry.host, "username": USER, "password": PASSWORD})
    assert r.status_code == 201, r.text
    return headers


def test_a_launch_pulls_with_the_tenants_credential_and_two_replicas_share_the_pull(
    dstack: Stack, docker_client: Any, registry: PrivateRegistry, engine_image: str,  # noqa: F811
    team: dict[str, str],
) -> None:
    ref = push(docker_client, registry, engine_image, "e2e-" + secrets.token_hex(3))
    made = make(dstack, team, body("pulled", parallelism="split", world_size=2,
                                   task={"image": ref}))
    g = dstack.wait_status(made["id"], "running", 120)
    assert len(g["tasks"]) == 2
    for t in g["tasks"]:
        assert ref in docker_client.containers.get(t["id"]).image.tags
    notes = [e for e in events(dstack, g["id"]) if e["kind"] == "task.image_pull"]
    pulled = [e for e in notes if e["message"].startswith(f"pulled image {ref}: ")]
    assert {e["task_id"] for e in pulled} == {t["id"] for t in g["tasks"]}, notes
    assert any(" MB in " in e["message"] for e in pulled)  # its size, from the layers
    agent_log = dstack.procs[1].log.read_text()
    assert agent_log.count(f"pulling image {ref}") == 1  # one pull for both launches
    client = openai.OpenAI(base_url=dstack.server_url + "/v1", api_key=made["api_key"],
                           max_retries=0, timeout=30)

    def answers() -> bool:
        try:
            return bool(client.chat.completions.create(
                model="pulled-model", messages=[{"role": "user", "content": "hi"}],
                max_tokens=4).choices[0].message.content)
        except openai.APIStatusError as exc:
            if exc.status_code in (401, 503):
                return False
            raise

    wait_for(answers, 20, "chat through the gateway")
    listed = call(dstack, team, "GET", "/api/v1/registry-credentials")
    no_password_anywhere(dstack, listed.text, dstack.api("GET", "/api/v1/task-groups").text,
                         str(events(dstack, g["id"])))
    assert dstack.api("DELETE", f"/api/v1/task-groups/{g['id']}").status_code == 204


def failed_with(st: Stack, group_id: str, what: str) -> dict[str, Any]:
    def failed() -> dict[str, Any] | None:
        g = st.group(group_id)
        t = g["tasks"][0] if g["tasks"] else {}
        return t if t.get("status") == "failed" else None

    try:
        t = wait_for(failed, 60, f"the launch to fail with {what}", 0.3)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {st.group(group_id)}") from None
    assert t["status_message"].startswith(f"image pull failed ({what})"), t
    return dict(t)


def test_a_wrong_password_and_a_missing_tag_fail_with_their_reason_and_stay_failed(
    dstack: Stack, docker_client: Any, registry: PrivateRegistry, engine_image: str,  # noqa: F811
    team: dict[str, str],
) -> None:
    ref = push(docker_client, registry, engine_image, "bad-" + secrets.token_hex(3))
    wrong = tenant_admin(dstack, "wrong-pass")
    r = call(dstack, wrong, "POST", "/api/v1/registry-credentials",
             json={"registry_host": registry.host, "username": USER,
                   "password": "not-" + PASSWORD})
    assert r.status_code == 201, r.text
    g1 = make(dstack, wrong, body("badpass", task={"image": ref}))
    t1 = failed_with(dstack, g1["id"], "unauthorised")
    assert f"registry credential for {registry.host}" in t1["status_message"]
    missing = ref.rsplit(":", 1)[0] + ":never-pushed"
    g2 = make(dstack, team, body("badtag", task={"image": missing}))  # the right login
    failed_with(dstack, g2["id"], "not found")
    # not pulled again: the recovery loop gives up at once, saying why
    for gid in (g1["id"], g2["id"]):
        wait_for(lambda gid=gid: any(e["kind"] == "fault.rebuild_gave_up"
                                     for e in events(dstack, gid)), 30, "the give-up")
        kinds = [e["kind"] for e in events(dstack, gid)]
        assert "fault.image_unavailable" in kinds and "fault.rebuilt" not in kinds
        assert len(dstack.group(gid)["tasks"]) == 1
        assert dstack.api("DELETE", f"/api/v1/task-groups/{gid}").status_code == 204
    no_password_anywhere(dstack)


def test_a_rolling_update_pulls_before_it_drains_and_a_missing_tag_drains_nothing(
    dstack: Stack, docker_client: Any, registry: PrivateRegistry, engine_image: str,  # noqa: F811
    team: dict[str, str],
) -> None:
    v1 = push(docker_client, registry, engine_image, "roll1-" + secrets.token_hex(3))
    v2 = push(docker_client, registry, engine_image, "roll2-" + secrets.token_hex(3))
    g = make(dstack, team, body("rolled", task={"image": v1}))
    gid = g["id"]
    old = dstack.wait_status(gid, "running", 120)["tasks"][0]["id"]

    def ended() -> dict[str, Any] | None:
        x = dstack.group(gid)
        return x if x["rolling_update_state"] in ("done", "failed") else None

    r = call(dstack, team, "PUT", f"/api/v1/task-groups/{gid}/update",
             json={"image": v1.rsplit(":", 1)[0] + ":never-pushed"})
    assert r.status_code == 200, r.text
    final = wait_for(ended, 120, "the update to a missing tag to end", 0.3)
    assert final["rolling_update_state"] == "failed", final
    assert "not found" in final["rolling_update_message"], final
    evs = events(dstack, gid)
    assert not [e for e in evs if e["kind"] == "drain"], evs  # the old replica never drained
    assert not [e for e in evs if e["kind"] == "rollout.retry"]  # no attempt again
    now = dstack.group(gid)
    assert [t["id"] for t in now["tasks"]] == [old] and now["tasks"][0]["status"] == "running"

    r = call(dstack, team, "PUT", f"/api/v1/task-groups/{gid}/update", json={"image": v2})
    assert r.status_code == 200, r.text
    final = wait_for(ended, 180, "the update to the new tag to end", 0.3)
    assert final["rolling_update_state"] == "done", f"{final}\n{dstack.logs()}"
    evs = events(dstack, gid)
    new = final["tasks"][0]["id"]
    pulled_at = next(datetime.fromisoformat(e["created_at"]) for e in evs
                     if e["kind"] == "task.image_pull" and e["task_id"] == new
                     and e["message"].startswith(f"pulled image {v2}"))
    drained_at = [datetime.fromisoformat(e["created_at"]) for e in evs
                  if e["kind"] == "drain" and e["task_id"] == old]
    assert drained_at and min(drained_at) > pulled_at  # pulled on its node, then drained
    assert v2 in docker_client.containers.get(new).image.tags
    assert dstack.api("DELETE", f"/api/v1/task-groups/{gid}").status_code == 204
