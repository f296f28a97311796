"""Fuzzing the management API from its own OpenAPI document (issue 10, item 6).

Schemathesis generates requests for every operation in ``/api/v1/openapi.json`` —
valid ones (positive) and ones that break the schema (negative: wrong types, values past
the bounds, missing fields) — and a sweep sends boundary and 64-bit values to every path
and query parameter (as the operator, who gets past every lookup). They run in process
against the real app (the TestClient's ASGI transport, no network) as an operator, as a
member, and with the node and gateway tokens where an operation is the agents' or the
gateways'. Not one answer may be a 5xx.

Deterministic (``derandomize=True``, no example database) and small: a few examples per
operation and identity. It runs on both databases — PostgreSQL is where a NUL or a
64-bit integer used to reach the driver and become a 500.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core import NotSet
from schemathesis.core.result import Err, Ok

from .conftest import NODE_TOKEN, Api
from .test_tenant_isolation_walk import World, build_world, hub_token

GATEWAY_TOKEN = "gw-token-for-tests"  # the api fixture's
EXAMPLES = 3  # per operation, identity and generation mode
# Every path and query parameter gets each of these (as text, the way a URL carries it).
BOUNDARY = (
    "0", "-1", str(2**31 - 1), str(2**31), str(2**63 - 1), str(2**63), str(2**64),
    str(-(2**63) - 1), "1e309", "NaN", "1.5", "true", "", "a\x00b", "x" * 65, "x" * 5000,
    "..", "\U0001f600", "\ud800", "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-05:00",
)
# The headers a request may carry besides the caller's Authorization.
PASSED_HEADERS = ("x-chunk-seq", "if-none-match")


def _worlds(api: Api, node_id: str) -> dict[str, World]:
    """Something of each kind for the operator and for a member, so that requests with
    real ids get past the lookups to where values reach the database."""
    admin = api.login()
    member = api.member(admin, "team-fuzz", "fuzzer")
    worlds = {
        "operator": build_world(api, admin, "admin", "op-svc", node_id),
        "member": build_world(api, member, "fuzzer", "member-svc", node_id),
    }
    sg = api.client.post("/api/v1/sharing-groups", json={"name": "fuzz"}, headers=admin)
    assert sg.status_code == 201, sg.text
    cred = api.client.post(
        "/api/v1/registry-credentials",
        json={"registry_host": "fuzz.example.com", "username": "u", "password": "fuzz-pass"},
        headers=admin,
    )
    assert cred.status_code == 201, cred.text
    hub = hub_token(api, admin, "")  # the platform's (H9)
    for w in worlds.values():
        w.sharing_group_id = sg.json()["id"]
        w.registry_credential_id = cred.json()["id"]
        w.hub_token_id = hub
    return worlds


def _real_ids(path: str, w: World) -> dict[str, str]:
    """The caller's own object for each path parameter of ``path``."""
    ids = {
        "tenant_id": w.tenant_id, "task_id": w.task_id, "endpoint_id": w.endpoint_id,
        "route_id": w.added_route_id, "request_id": w.file_request_id,
        "node_id": w.node_id, "group_id": w.group_id,
        "credential_id": w.registry_credential_id, "token_id": w.hub_token_id,
        "name": "fuzz-adapter",  # a LoRA adapter's name (none exists: a 404, never a 5xx)
    }
    if path.startswith("/api/v1/sharing-groups/"):
        ids["group_id"] = w.sharing_group_id
    return ids


def _auth_for(path: str, users: dict[str, str], node_id: str) -> dict[str, str]:
    if path.startswith("/api/v1/agent/"):
        return {"Authorization": f"Bearer {NODE_TOKEN}", "X-Heteroflow-Node": node_id}
    if path in (
        "/api/v1/gateway/snapshot", "/api/v1/gateway/usage", "/api/v1/gateway/activity",
        "/api/v1/gateway/wake",
    ):
        return {"Authorization": f"Bearer {GATEWAY_TOKEN}"}
    return users


def _send(api: Api, method: str, path: str, headers: dict[str, str], *, params: Any = None,
          body: Any = NotSet, media_type: str | None = None) -> int:
    """The status of one request; an exception out of the app counts as a 500."""
    kwargs: dict[str, Any] = {"params": params, "headers": headers}
    if not isinstance(body, NotSet):
        if media_type and "json" not in media_type:
            kwargs["content"] = body if isinstance(body, bytes) else str(body).encode()
        else:
            kwargs["json"] = body
    try:
        request = api.client.build_request(method.upper(), path, **kwargs)
    except (UnicodeError, ValueError, TypeError):
        return 0  # not a request HTTP can carry (the client cannot encode it)
    try:
        return int(api.client.send(request).status_code)
    except Exception:  # the app raised instead of answering
        return 500


def _encodable(value: Any) -> bool:
    try:
        str(value).encode("ascii")
    except UnicodeEncodeError:
        return False
    return True


def _fuzz(api: Api, op: Any, mode: GenerationMode, auth: dict[str, str], world: World,
          failures: list[str]) -> None:
    """Generated cases; positive ones name the caller's real objects in the path (and in
    a body's ``group_id``/``task_id``), negative ones keep what was generated."""
    real = _real_ids(op.path, world)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        headers = {k: str(v) for k, v in (case.headers or {}).items()
                   if k.lower() in PASSED_HEADERS and _encodable(v)}
        values = dict(case.path_parameters or {})
        body = case.body
        if mode is GenerationMode.POSITIVE:
            values = {k: real.get(k, v) for k, v in values.items()}
            if isinstance(body, dict):
                body = {k: real.get(k, v) if k in ("group_id", "task_id") else v
                        for k, v in body.items()}
        path = op.path.format(**{k: quote(str(v), safe="", errors="surrogatepass")
                                 for k, v in values.items()})
        status = _send(api, case.method, path, {**headers, **auth}, params=case.query or None,
                       body=body, media_type=case.media_type)
        if status >= 500:
            failures.append(f"{case.method} {path} query={case.query!r} "
                            f"body={str(body)[:300]!r} -> {status}")

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE, op.label  # nothing to break in it


def _modes(op: Any) -> tuple[GenerationMode, ...]:
    """Negative cases only where there is something to break: a path or query parameter
    or a body (hypothesis would search in vain, slowly, elsewhere)."""
    breakable = any(p.location in ("path", "query") for p in op.iter_parameters())
    if breakable or op.get_request_payload_content_types():
        return (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    return (GenerationMode.POSITIVE,)


def _sweep(api: Api, op: Any, auth: dict[str, str], world: World,
           failures: list[str]) -> None:
    """Each boundary value in each path and query parameter, the others the caller's
    real objects."""
    params = [p for p in op.iter_parameters() if p.location in ("path", "query")]
    path_names = [p.name for p in params if p.location == "path"]
    real = _real_ids(op.path, world)
    body: Any = {} if op.method.lower() in ("post", "put", "patch") else NotSet()
    for p in params:
        for value in BOUNDARY:
            path_values = {n: real[n] for n in path_names}
            query: dict[str, str] = {}
            if p.location == "path":
                path_values[p.name] = value
            else:
                query[p.name] = value
            path = op.path.format(
                **{k: quote(v, safe="", errors="surrogatepass") for k, v in path_values.items()}
            )
            status = _send(api, op.method, path, auth, params=query or None, body=body)
            if status >= 500:
                failures.append(f"{op.method.upper()} {path} {query} -> {status}")


def test_no_request_from_the_openapi_document_is_answered_5xx(api: Api) -> None:
    api.app.settings.log_follow_poll_s = 0.0  # ?follow=true: one poll, not an hour's wait
    node_id = api.heartbeat()
    worlds = _worlds(api, node_id)
    doc = api.client.get("/api/v1/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    results = list(schema.get_all_operations())
    assert not [r.err() for r in results if isinstance(r, Err)]
    operations = [r.ok() for r in results if isinstance(r, Ok)]
    assert len(operations) > 40
    # what ends objects (delete, stop) goes last, so the rest still finds them
    operations.sort(key=lambda op: (op.method == "delete", op.path.endswith("/stop")))
    failures: list[str] = []
    for op in operations:
        for who, world in worlds.items():
            auth = _auth_for(op.path, world.who, node_id)
            if auth is not world.who and who == "member":
                continue  # agent and gateway operations: their own token, once
            if who == "operator":  # a member's values meet the same code, behind 404s
                _sweep(api, op, auth, world, failures)
            for mode in _modes(op):
                _fuzz(api, op, mode, auth, world, failures)
    assert failures == []
