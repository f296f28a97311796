"""What ``task.model_path`` may name (issue 29, FEATURES H9): a path or a model source.

Pure: ``parse_model_source`` turns the text into a frozen ``ModelSource`` or raises
``ValidationFailed`` naming the field, with a message that lists what is accepted:

- a path (no scheme): the node reads it as today (the C4 form rule, ``core.paths``);
- ``hf://org/name[@revision]``: the Hugging Face hub (or the operator's mirror of it),
  revision ``main`` when none is given;
- ``modelscope://org/name[@revision]``: ModelScope, revision ``master`` when none is
  given (ModelScope's default branch, not Hugging Face's);
- ``https://host/path``: one file, or an archive the node unpacks when the path ends in
  ``.tar``, ``.tar.gz``, ``.tgz`` or ``.zip``;
- ``fleet://<model id>``: a copy another node of the fleet already holds, named by its
  cache key (``cache_key``: the folder name, the same on every node that holds it, as
  ``heteroflow models list`` shows it); the node copies it from a holder's agent.

Decisions, made here once:

- ``http://`` is refused except to a loopback host (``localhost``, 127.0.0.0/8, ``::1``):
  a model fetched in clear can be swapped on the way, and the loopback exception is a
  mirror on the node itself. Hub tokens never travel in clear: the resolver refuses to
  send one to a non-loopback ``http://`` endpoint (``models.fetch``).
- A URL with user info (``user:pass@host``) or a query string is refused: the model path
  is stored, listed and written into events, and signed URLs and passwords are secrets.
- ``hf://name`` without an organisation is refused: the hub's legacy names redirect to
  ``org/name`` ids, and the id is what the cache key must be stable on.

``cache_key`` is a directory name (letters, digits, ``.``, ``_``, ``-``; at most 120
characters) that is stable for one source text's canonical form and distinct per
revision: a readable slug plus 16 hex digits of the SHA-256 of the canonical text, so two
texts that slug alike (``a/b`` vs ``a-b``) still get different keys.
"""

from __future__ import annotations

import hashlib
import ipaddress
import posixpath
import re
from dataclasses import dataclass, replace
from enum import StrEnum
from urllib.parse import urlsplit

from heteroflow.core.errors import ValidationFailed
from heteroflow.core.paths import model_path_problem

FIELD = "task.model_path"
ACCEPTED = (
    "accepted: a path on the node, hf://org/name[@revision], "
    "modelscope://org/name[@revision], https://host/path (a file, or an archive ending "
    ".tar, .tar.gz, .tgz or .zip), fleet://<model id>"
)
HF_DEFAULT_REVISION = "main"
MODELSCOPE_DEFAULT_REVISION = "master"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
MAX_KEY_CHARS = 120
MAX_SOURCE_CHARS = 2048

_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$", re.DOTALL)
# a hub repo id: org/name, each part a letter or digit then letters, digits, . _ -
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# a branch, tag or commit: git's ref characters that need no quoting, / for refs/pr/1
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
# a cache key (``ModelSource.cache_key``: a folder's name on a node), which is also what a
# fleet:// source names
CACHE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,119}$")
_FLEET_ID = CACHE_KEY
_SLUG_BAD = re.compile(r"[^A-Za-z0-9._-]+")


class SourceKind(StrEnum):
    PATH = "path"
    HF = "hf"
    MODELSCOPE = "modelscope"
    URL = "url"  # https (or http to loopback)
    FLEET = "fleet"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """One parsed model source. ``location``: the path, the hub repo id, the URL or the
    fleet model id; ``revision``: the hub revision (None for the other kinds);
    ``archive``: the archive suffix of a URL source (``.tar.gz``…) or ''."""

    kind: SourceKind
    location: str
    revision: str | None = None
    archive: str = ""

    @property
    def remote(self) -> bool:
        """Whether the node has to fetch it (everything but a path)."""
        return self.kind is not SourceKind.PATH

    @property
    def text(self) -> str:
        """The canonical source text (what parsing it again gives back)."""
        if self.kind is SourceKind.PATH or self.kind is SourceKind.URL:
            return self.location
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.kind.value}://{self.location}{rev}"

    @property
    def cache_key(self) -> str:
        digest = hashlib.sha256(self.text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        slug = _SLUG_BAD.sub("-", self._slug_text()).strip("-.") or "model"
        room = MAX_KEY_CHARS - len(self.kind.value) - len(digest) - 4
        return f"{self.kind.value}--{slug[:room]}--{digest}"

    def pinned(self, revision: str) -> ModelSource:
        """The same source at ``revision`` (a hub's resolved commit): the cache keeps one
        copy per resolved revision, so ``@main`` and ``@<its commit>`` share it."""
        if self.revision is None or not revision:
            return self
        return replace(self, revision=revision)

    def _slug_text(self) -> str:
        if self.kind is SourceKind.URL:
            parts = urlsplit(self.location)
            return f"{parts.hostname or ''}-{posixpath.basename(parts.path)}"
        if self.kind is SourceKind.PATH:
            return posixpath.basename(self.location.rstrip("/"))
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.location}{rev}".replace("/", "--").replace("@", "--")


def _refuse(message: str, field: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}; {ACCEPTED}", field=field)


def parse_model_source(text: str, field: str = FIELD) -> ModelSource:
    """``text`` as a ``ModelSource``, or ``ValidationFailed`` naming ``field``."""
    if not text:
        raise _refuse("is empty", field)
    if len(text) > MAX_SOURCE_CHARS and _SCHEME.match(text):
        raise _refuse(f"is longer than {MAX_SOURCE_CHARS} characters", field)
    m = _SCHEME.match(text)
    if m is None:
        problem = model_path_problem(text, field)
        if problem:
            raise _refuse(problem, field)
        return ModelSource(SourceKind.PATH, text)
    scheme, rest = m["scheme"].lower(), m["rest"]
    if text != text.strip() or re.search(r"[\s\x00-\x1f\x7f]", text):
        raise _refuse("may not contain whitespace or control characters", field)
    if scheme in ("hf", "modelscope"):
        kind = SourceKind.HF if scheme == "hf" else SourceKind.MODELSCOPE
        return _hub(kind, rest, field)
    if scheme == "fleet":
        return _fleet(rest, field)
    if scheme in ("https", "http"):
        return _url(text, field)
    raise _refuse(f"has an unknown scheme {scheme + '://'!r}", field)


def _hub(kind: SourceKind, rest: str, field: str) -> ModelSource:
    repo, at, revision = rest.partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.match(p) for p in parts):
        raise _refuse(
            f"{kind.value}:// needs a repository id org/name (letters, digits, '.', '_', "
            f"'-'), got {repo!r}",
            field,
        )
    if any(".." in p or "--" in p or p.endswith(".") for p in parts):
        raise _refuse(f"repository id {repo!r} may not contain '..' or '--'", field)
    if at:
        bad = not _REVISION.match(revision) or ".." in revision or revision.endswith("/")
        if bad or "//" in revision or revision.endswith(".lock"):
            raise _refuse(f"revision {revision!r} is not a branch, tag or commit", field)
    else:
        default = HF_DEFAULT_REVISION if kind is SourceKind.HF else MODELSCOPE_DEFAULT_REVISION
        revision = default
    return ModelSource(kind, repo, revision)


def _fleet(rest: str, field: str) -> ModelSource:
    if not _FLEET_ID.match(rest) or rest.endswith("."):
        raise _refuse(
            f"fleet:// needs a model id: a cache key as `heteroflow models list` shows it "
            f"(letters, digits, '.', '_', '-'; at most {MAX_KEY_CHARS}), got {rest!r}",
            field,
        )
    return ModelSource(SourceKind.FLEET, rest)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url(text: str, field: str) -> ModelSource:
    try:
        parts = urlsplit(text)
        port = parts.port  # raises on a bad port
    except ValueError as e:
        raise _refuse(f"is not a valid URL ({e})", field) from None
    del port
    host = (parts.hostname or "").lower()
    if not host:
        raise _refuse("is a URL without a host", field)
    if parts.username is not None or parts.password is not None:
        raise _refuse(
            "may not carry user info in the URL (the model path is stored and shown): "
            "give credentials as a token",
            field,
        )
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise _refuse(
            "may not carry a query string or fragment (signed URLs are secrets; the "
            "model path is stored and shown)",
            field,
        )
    if parts.scheme.lower() == "http" and not _loopback(host):
        raise _refuse(
            "http:// is accepted only to a loopback host (a model fetched in clear can "
            "be swapped on the way): use https://",
            field,
        )
    name = posixpath.basename(parts.path)
    if not name or name in (".", ".."):
        raise _refuse("is a URL that names no file (its path must end in a file name)", field)
    segments = parts.path.split("/")
    if ".." in segments or "." in segments:
        raise _refuse("is a URL whose path has a '.' or '..' segment", field)
    archive = next((s for s in ARCHIVE_SUFFIXES if name.lower().endswith(s)), "")
    # the canonical form: scheme and host lower-case, the rest as written
    canonical = f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path}"
    return ModelSource(SourceKind.URL, canonical, None, archive)


def is_source_url(text: str) -> bool:
    """Whether ``text`` is written as a source (``scheme://``) rather than a path."""
    return _SCHEME.match(text) is not None
