"""Requests between agents, signed with the node token (issue 29: copies between nodes).

A node copies a model from another node's agent. Both hold the cluster's node token
(issue 18); neither sends it. A request carries

    Authorization: HeteroFlow-Node <node>:<unix seconds>:<hex HMAC-SHA256>

over ``METHOD\\nPATH\\nNODE\\nSECONDS`` (the path as sent, query included), keyed by the
token. The holder recomputes it with its own token and accepts it within ``MAX_SKEW_S`` of
its clock, compared in constant time. So a copy over plain HTTP inside a fleet never shows
the token to the network, and a captured header opens only the same path for a few
minutes (the bytes themselves are checked against the source's checksums where it gave
them; serve the peers over TLS where the network is not trusted). During a rotation of
the token, two nodes on different tokens cannot copy from each other: the copy fails
over to the next holder or the origin.

Pure: the clock's seconds are the caller's.
"""

from __future__ import annotations

import hashlib
import hmac
import re

SCHEME = "HeteroFlow-Node"
MAX_SKEW_S = 300
_HEADER = re.compile(rf"^{SCHEME} (?P<node>[A-Za-z0-9][A-Za-z0-9._-]{{0,252}}):"
                     r"(?P<ts>[0-9]{1,12}):(?P<mac>[0-9a-f]{64})$")


class BadSignature(Exception):
    """The request is not signed by a node of this fleet (the message says why, never
    with the header's value)."""


def _mac(token: str, method: str, path: str, node: str, ts: int) -> str:
    msg = f"{method.upper()}\n{path}\n{node}\n{ts}".encode("utf-8", "surrogatepass")
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def sign(token: str, method: str, path: str, node: str, now_s: float) -> str:
    """The ``Authorization`` value for one request by ``node`` at ``now_s``."""
    ts = int(now_s)
    return f"{SCHEME} {node}:{ts}:{_mac(token, method, path, node, ts)}"


def verify(header: str, token: str, method: str, path: str, now_s: float) -> str:
    """The signing node's name, or ``BadSignature``."""
    if not token:
        raise BadSignature("this node has no node token to check a signature with")
    m = _HEADER.match(header or "")
    if m is None:
        raise BadSignature(f"needs an Authorization header '{SCHEME} <node>:<time>:<mac>'")
    node, ts = m["node"], int(m["ts"])
    if abs(now_s - ts) > MAX_SKEW_S:
        raise BadSignature(f"the signature's time is more than {MAX_SKEW_S} s from this "
                           "node's clock (check the nodes' clocks)")
    if not hmac.compare_digest(m["mac"], _mac(token, method, path, node, ts)):
        raise BadSignature("the signature does not match this node's token")
    return node
