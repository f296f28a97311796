"""A standalone gateway's routing file: backends, models, keys and limits, no server.

For edge deployments, external OpenAI-compatible backends and the benchmark,
``heteroflow gateway --routes FILE`` routes from a file instead of the server's
snapshot. JSON, or TOML when the name ends in ``.toml``::

    {
      "models": {
        "llama-8b": {"algorithm": "least_connections",
                     "backends": ["http://10.0.0.5:8000", "http://10.0.0.6:8000/v1"]},
        "chat": {"targets": [
          {"backends": ["http://10.0.0.7:8000"], "weight": 90},
          {"backends": ["http://10.0.0.8:8000"], "weight": 10, "tags": ["canary"]},
          {"backends": ["http://10.0.0.9:8000"], "priority": 1}]}
      },
      "keys": {
        "team-a": {"sha256": "<64 hex digits>", "models": ["llama-8b"],
                   "rpm_limit": 600, "tpm_limit": 100000, "tenant": "acme"}
      },
      "tenants": {"acme": {"quota_tokens": 50000000, "quota_period": "month"}}
    }

Keys are given by their sha256 only (``heteroflow hash-key`` prints it), so the file is
no secret. An external backend that wants its own key (a hosted OpenAI-compatible API)
gets ``"api_key_env": "PROVIDER_KEY"`` on its model or target: the gateway reads the
variable at load and sends ``Authorization: Bearer …`` to that backend only.
A key's name is its endpoint id (usage is attributed to it); ``tenant``
defaults to ``default``; ``models`` defaults to every model of the file. ``tenants``
(optional) gives a tenant a token quota its keys share (N2), counted over every gateway
on one Redis as the server's tenant quotas are; each tenant named there must be some
key's. A quota needs its period (``day`` or ``month``, UTC), for a key as for a tenant.
Unknown fields are errors, and every error names the field (``keys.team-a.sha256: ...``).

``RoutesFileWatcher`` publishes the file as a ``RoutingSnapshot`` and reloads it when
its mtime or size changes, or at once on ``request_reload()`` (SIGHUP). A bad file on
reload is logged and the previous routes stay in force.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from heteroflow.schemas.routing import (
    DEFAULT_ALGORITHM,
    Algorithm,
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
)

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_URL = r"^https?://[^/\s]+(/\S*)?$"
_SHA256 = r"^[0-9a-f]{64}$"
_ENV = r"^[A-Za-z_][A-Za-z0-9_]*$"
_PATTERN_HELP = {
    _NAME: "a name of letters, digits, '.', '_' and '-' (at most 32)",
    _URL: "must be an http:// or https:// URL",
    _SHA256: "must be the key's sha256, 64 lowercase hex digits (heteroflow hash-key prints it)",
    _ENV: "must be an environment variable's name",
}
Name = Annotated[str, StringConstraints(min_length=1, max_length=32, pattern=_NAME)]
Url = Annotated[str, StringConstraints(pattern=_URL)]


class RoutesFileError(Exception):
    """The file cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Target(_Strict):
    backends: list[Url] = Field(min_length=1)
    # an external backend's own key, read from this environment variable at load time
    api_key_env: Annotated[str, StringConstraints(pattern=_ENV)] | None = None
    priority: int = Field(default=0, ge=0, le=1_000_000)
    weight: int = Field(default=100, ge=0, le=100)
    algorithm: Algorithm | None = None  # default: the model's
    tags: list[str] = Field(default_factory=list)
    # M16: requests each backend's engine runs at once (llama.cpp -np, vLLM
    # --max-num-seqs): its part of the fair-share bound; unset: the gateway's setting
    slots: int | None = Field(default=None, ge=1, le=100_000)


class _Model(_Strict):
    algorithm: Algorithm = DEFAULT_ALGORITHM
    backends: list[Url] | None = Field(default=None, min_length=1)  # one target, shorthand
    api_key_env: Annotated[str, StringConstraints(pattern=_ENV)] | None = None  # shorthand
    targets: list[_Target] | None = Field(default=None, min_length=1)
    slots: int | None = Field(default=None, ge=1, le=100_000)  # shorthand, as backends


class _Key(_Strict):
    sha256: Annotated[str, StringConstraints(pattern=_SHA256)]
    tenant: Name = DEFAULT_TENANT
    models: list[str] | None = None  # None: every model of the file
    rpm_limit: int = Field(default=0, ge=0)
    tpm_limit: int = Field(default=0, ge=0)
    quota_tokens: int = Field(default=0, ge=0)
    quota_period: Literal["", "day", "month"] = ""


class _Tenant(_Strict):
    quota_tokens: int = Field(default=0, ge=0)
    quota_period: Literal["", "day", "month"] = ""


class _File(_Strict):
    models: dict[Annotated[str, StringConstraints(min_length=1, max_length=256)], _Model]
    keys: dict[Name, _Key]
    tenants: dict[Name, _Tenant] = Field(default_factory=dict)


def load_routes(path: Path, version: int) -> RoutingSnapshot:
    """Read and check the file; raises ``RoutesFileError`` naming the field."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RoutesFileError(f"routes file {path}: cannot read it: {exc.strerror}") from None
    try:
        data: Any = tomllib.loads(raw.decode()) if path.suffix == ".toml" else orjson.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # JSON/TOML decode errors are ValueErrors
        raise RoutesFileError(f"routes file {path}: not valid {_kind(path)}: {exc}") from None
    try:
        spec = _File.model_validate(data)
    except ValidationError as exc:
        errs = exc.errors()
        # a plaintext key explains a missing sha256 better than "Field required"
        err = next((e for e in errs if _plaintext_key(e)), errs[0])
        raise RoutesFileError(
            f"routes file {path}: {_field(err['loc']) or '(top level)'}: {_message(err)}"
        ) from None
    try:
        return _snapshot(spec, version)
    except ValueError as exc:
        raise RoutesFileError(f"routes file {path}: {exc}") from None


def _snapshot(spec: _File, version: int) -> RoutingSnapshot:
    targets_of: dict[str, tuple[RouteTarget, ...]] = {}
    for model, m in spec.models.items():
        if (m.backends is None) == (m.targets is None):
            raise ValueError(f"models.{model}: give either backends or targets")
        for shorthand in ("api_key_env", "slots"):
            if m.targets is not None and getattr(m, shorthand) is not None:
                raise ValueError(f"models.{model}.{shorthand}: with targets, give it per target")
        targets = m.targets or [
            _Target(backends=m.backends or [], api_key_env=m.api_key_env, slots=m.slots)
        ]
        built = []
        for i, t in enumerate(targets):
            where = f"models.{model}" + ("" if m.targets is None else f".targets[{i}]")
            auth = _auth(t.api_key_env, f"{where}.api_key_env")
            built.append(
                RouteTarget(
                    route_id=f"{model}#{i}",
                    group_id=f"{model}#{i}",
                    priority=t.priority,
                    weight=t.weight,
                    backends=tuple(
                        Backend(
                            task_id=u, base_url=u, auth=auth, auth_local=True, slots=t.slots or 0
                        )
                        for u in map(_base_url, t.backends)
                    ),
                    algorithm=t.algorithm or m.algorithm,
                    tags=tuple(t.tags),
                )
            )
        built.sort(key=lambda t: (t.priority, -t.weight, t.route_id))
        targets_of[model] = tuple(built)
    named = {k.tenant for k in spec.keys.values()}
    for tenant, quota in spec.tenants.items():
        _check_quota(f"tenants.{tenant}", quota.quota_tokens, quota.quota_period)
        if tenant not in named:
            raise ValueError(f"tenants.{tenant}: no key of the file names this tenant")
    keys: dict[str, KeyEntry] = {}
    for name, k in spec.keys.items():
        _check_quota(f"keys.{name}", k.quota_tokens, k.quota_period)
        tenant_quota = spec.tenants.get(k.tenant, _Tenant())
        if k.sha256 in keys:
            other = keys[k.sha256].endpoint_id
            raise ValueError(f"keys.{name}.sha256: the same key as keys.{other}")
        models = list(spec.models) if k.models is None else k.models
        for i, model in enumerate(models):
            if model not in targets_of:
                raise ValueError(f"keys.{name}.models[{i}]: no model {model!r} in the file")
        keys[k.sha256] = KeyEntry(
            endpoint_id=name,
            tenant_id=k.tenant,
            group_id=None,
            models=frozenset(models),
            rpm_limit=k.rpm_limit,
            tpm_limit=k.tpm_limit,
            quota_tokens=k.quota_tokens,
            quota_period=k.quota_period,
            tenant_quota_tokens=tenant_quota.quota_tokens,
            tenant_quota_period=tenant_quota.quota_period,
        )
    tenants = {k.tenant_id for k in keys.values()}
    routes = {(t, model): targets for t in tenants for model, targets in targets_of.items()}
    return RoutingSnapshot(version=version, keys=keys, routes=routes)


def _check_quota(where: str, tokens: int, period: str) -> None:
    """A quota needs its period (the API's rule for keys and tenants): without one it
    would be silently no quota at all."""
    if tokens > 0 and period not in ("day", "month"):
        raise ValueError(f"{where}.quota_period: quota_tokens needs quota_period 'day' or 'month'")


def _auth(env_name: str | None, where: str) -> str:
    """The Authorization value for an external backend, from the environment (the file
    names the variable, never the secret)."""
    if env_name is None:
        return ""
    value = os.environ.get(env_name, "").strip()
    if not value:
        raise ValueError(f"{where}: the environment variable {env_name} is not set")
    if not all("!" <= c <= "~" for c in value):  # the value itself is never echoed
        raise ValueError(
            f"{where}: the environment variable {env_name} holds a character an HTTP "
            "header cannot carry (a line break, a control character, a space or one "
            "outside ASCII)"
        )
    return f"Bearer {value}"


def _base_url(url: str) -> str:
    """Backends are named with or without /v1; the snapshot holds the server's root."""
    return url.rstrip("/").removesuffix("/v1").rstrip("/")


def _field(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "[key]":  # pydantic's marker for a bad dict key: the key names it
            out += f".{part}" if out else str(part)
    return out


def _message(err: Any) -> str:
    if err["type"] == "string_pattern_mismatch":
        return _PATTERN_HELP.get(err["ctx"]["pattern"], str(err["msg"]))
    if _plaintext_key(err):
        return "plaintext keys are not accepted; give sha256 (heteroflow hash-key prints it)"
    if err["type"] == "model_type" and not err["loc"]:
        return "must be an object with models and keys"
    return str(err["msg"])


def _plaintext_key(err: Any) -> bool:
    return bool(err["type"] == "extra_forbidden" and err["loc"][-1] == "key")


def _kind(path: Path) -> str:
    return "TOML" if path.suffix == ".toml" else "JSON"


class RoutesFileWatcher:
    """Publishes the routing file and keeps it current."""

    def __init__(self, path: Path, holder: SnapshotHolder, *, interval_s: float = 1.0) -> None:
        self.path = path
        self._holder = holder
        self._interval = interval_s
        self._stamp: tuple[int, int] | None = None
        self._reload = asyncio.Event()

    def load(self) -> None:
        """(Re)load the file now; raises ``RoutesFileError`` and keeps the old routes."""
        stamp = self._file_stamp()
        snapshot = load_routes(self.path, self._holder.current.version + 1)
        self._stamp = stamp
        self._holder.publish(snapshot)

    def request_reload(self) -> None:
        """Reload at once (the SIGHUP handler)."""
        self._reload.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Reload on a changed mtime/size or on request, until ``stop`` is set."""
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while True:
                asked = asyncio.ensure_future(self._reload.wait())
                await asyncio.wait(
                    {stopping, asked}, timeout=self._interval, return_when=asyncio.FIRST_COMPLETED
                )
                asked.cancel()
                if stopping.done():
                    return
                forced = self._reload.is_set()
                self._reload.clear()
                if forced or self._file_stamp() != self._stamp:
                    self._reload_logged()
        finally:
            stopping.cancel()

    def _reload_logged(self) -> None:
        try:
            self.load()
        except RoutesFileError as exc:
            self._stamp = self._file_stamp()  # report a bad file once, not every interval
            logger.error("%s; keeping the routes loaded before", exc)
            return
        snap = self._holder.current
        n_models = len({m for _, m in snap.routes})
        logger.info(
            "routes file %s: loaded (%d keys, %d models)", self.path, len(snap.keys), n_models
        )

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)
