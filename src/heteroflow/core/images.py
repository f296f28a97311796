"""Container images as the pull sees them (H7), pure: which registry an image reference
names, the progress of a pull summed over its layers, and why a pull failed.

**Registry of a reference** (Docker's rule): the first path component is a registry host
when it holds a ``.`` or a ``:`` or is ``localhost``; otherwise the image is on Docker Hub,
whose credentials are kept under ``docker.io``. ``registry_host`` answers the key the
credentials are stored under (``registry_credentials.registry_host``).

**Progress.** Docker's pull stream says, per layer, ``Downloading`` with its bytes so
far and its size, then ``Download complete`` / ``Extracting`` / ``Pull complete``; a layer
the node already holds says ``Already exists`` and is not counted. ``PullProgress`` sums
what was downloaded over what is known of the total — a layer's size is known once its
download starts, so the total can grow while the first layers come in.

**Failures** are named by what the operator must do (``PullFailure``): ``unauthorised``
(the credential is wrong or missing), ``not_found`` (the repository or tag does not exist,
or the credential may not see it), ``disk_full``, ``timeout``, ``unreachable`` (the
registry cannot be reached), ``untrusted`` (its TLS certificate is not trusted by the
node's Docker), ``other``. The first two are *permanent*: pulling again changes nothing
until someone pushes the tag or fixes the credential, so recovery does not rebuild the
task for them and a rolling update fails at once (``PERMANENT``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from heteroflow.core.states import WireEnum

DOCKER_HUB = "docker.io"
# the names Docker Hub is reached by, stored under one key
_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
# a registry host as credentials are keyed: host[:port], lower case, no scheme, no path
REGISTRY_HOST = re.compile(
    r"^(?=.{1,255}$)[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*"
    r"(?::[0-9]{1,5})?$"
)


def normalise_host(host: str) -> str:
    """``host[:port]`` as credentials are keyed (lower case; Docker Hub's aliases as
    ``docker.io``)."""
    host = host.strip().lower()
    return DOCKER_HUB if host in _HUB_ALIASES else host


def registry_host(image: str) -> str:
    """The registry an image reference names (``docker.io`` for Docker Hub's)."""
    name = image.split("@", 1)[0]
    first, sep, _rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return normalise_host(first)
    return DOCKER_HUB


class PullFailure(WireEnum):
    UNAUTHORISED = "unauthorised"
    NOT_FOUND = "not_found"
    DISK_FULL = "disk_full"
    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    UNTRUSTED = "untrusted"
    OTHER = "other"


# pulling again cannot help until a person acts (pushes the tag, fixes the credential)
PERMANENT = frozenset({PullFailure.UNAUTHORISED, PullFailure.NOT_FOUND})

# (failure, words in Docker's or the registry's message), the first match wins: the
# order matters ("pull access denied ... does not exist" is a missing repository on
# Docker Hub, reported as a denial; a dial that timed out is an unreachable registry)
_MARKERS: tuple[tuple[PullFailure, tuple[str, ...]], ...] = (
    (PullFailure.DISK_FULL, ("no space left on device", "disk quota exceeded")),
    (PullFailure.UNTRUSTED, ("x509:", "certificate signed by unknown authority",
                             "certificate is not valid", "tls: failed to verify")),
    (PullFailure.NOT_FOUND, ("manifest unknown", "name unknown", "not found",
                             "does not exist", "no such image", "repository name not known")),
    (PullFailure.UNAUTHORISED, ("unauthorized", "unauthorised", "authentication required",
                                "no basic auth credentials", "incorrect username or password",
                                "access denied", "access to the resource is denied",
                                "denied:")),
    (PullFailure.UNREACHABLE, ("connection refused", "no such host", "network is unreachable",
                               "no route to host", "dial tcp", "server misbehaving",
                               "connection reset", "eof")),
    (PullFailure.TIMEOUT, ("timeout", "timed out", "deadline exceeded")),
)

_ADVICE: Mapping[PullFailure, str] = {
    PullFailure.UNAUTHORISED: "the registry refused the credential: set or fix the registry "
    "credential for {host} (POST /api/v1/registry-credentials)",
    PullFailure.NOT_FOUND: "the image does not exist in {host} (check the repository and "
    "tag), or the credential may not see it",
    PullFailure.DISK_FULL: "the node's Docker has no space left for the image: free space "
    "on the node (docker image prune)",
    PullFailure.TIMEOUT: "the pull did not finish in time",
    PullFailure.UNREACHABLE: "the node cannot reach the registry {host}",
    PullFailure.UNTRUSTED: "the node's Docker does not trust the TLS certificate of {host}: "
    "put its CA in /etc/docker/certs.d/{host}/ca.crt on the node",
    PullFailure.OTHER: "",
}


def classify(text: str) -> PullFailure:
    """What a pull's error text (Docker's or the registry's words) means."""
    low = text.lower()
    for failure, words in _MARKERS:
        if any(w in low for w in words):
            return failure
    return PullFailure.OTHER


def failure_text(image: str, failure: PullFailure, detail: str) -> str:
    """The task's status line for a failed pull: the kind first (it is what people and
    tests look for), then what to do, then Docker's own words."""
    advice = _ADVICE[failure].format(host=registry_host(image))
    label = failure.value.replace("_", " ")
    parts = [f"image pull failed ({label}): {image}"]
    if advice:
        parts.append(advice)
    if detail:
        parts.append(detail.strip()[:500])
    return "; ".join(parts)


def size_text(n: float) -> str:
    """Bytes in decimal units with one decimal (``1.2 GB``, ``340.0 MB``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass
class PullProgress:
    """A pull's progress summed over its layers, fed Docker's stream line by line."""

    image: str
    done: dict[str, int] = field(default_factory=dict)  # layer -> bytes downloaded
    total: dict[str, int] = field(default_factory=dict)  # layer -> its size, once known
    complete: set[str] = field(default_factory=set)
    present: set[str] = field(default_factory=set)  # already on the node: not counted
    error: str = ""

    def feed(self, event: Mapping[str, Any]) -> None:
        """One decoded line of Docker's pull stream."""
        if event.get("error") or event.get("errorDetail"):
            detail = event.get("errorDetail") or {}
            self.error = str(event.get("error") or detail.get("message") or "pull failed")
            return
        layer = str(event.get("id") or "")
        status = str(event.get("status") or "")
        if not layer or not status or status.startswith("Pulling from"):
            return
        detail = event.get("progressDetail") or {}
        if status == "Already exists":
            self.present.add(layer)
            return
        if status == "Downloading":
            total = _int(detail.get("total"))
            if total > 0:
                self.total[layer] = total
            self.done[layer] = min(_int(detail.get("current")), self.total.get(layer, 1 << 62))
        elif status in ("Download complete", "Verifying Checksum", "Extracting",
                        "Pull complete"):
            if layer in self.total:
                self.done[layer] = self.total[layer]
            if status == "Pull complete":
                self.complete.add(layer)
        elif status == "Pulling fs layer" or status == "Waiting":
            self.done.setdefault(layer, 0)

    @property
    def downloaded(self) -> int:
        return sum(self.done.get(layer, 0) for layer in self.total)

    @property
    def size(self) -> int:
        return sum(self.total.values())

    @property
    def layers(self) -> int:
        return len(set(self.done) | self.complete)

    def text(self) -> str:
        """``pulling image X: 1.2 of 4.5 GB (3 of 7 layers)``."""
        head = f"pulling image {self.image}"
        if not self.size:
            return f"{head}: starting"
        counted = f"{len(self.complete)} of {self.layers} layers"
        return f"{head}: {size_text(self.downloaded)} of {size_text(self.size)} ({counted})"


def _int(value: Any) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0
