"""Requests between agents are signed with the node token, never carry it (issue 29)."""

from __future__ import annotations

import pytest

from heteroflow.core.node_signature import MAX_SKEW_S, BadSignature, sign, verify

TOKEN = "node-token-0123456789abcdef"
PATH = "/v1/models/hf--org--tiny--00/files/model.safetensors"


def test_a_signature_names_its_node_and_holds_no_token() -> None:
    header = sign(TOKEN, "GET", PATH, "node-b", 1_000.0)
    assert TOKEN not in header
    assert verify(header, TOKEN, "get", PATH, 1_000.0 + MAX_SKEW_S) == "node-b"


@pytest.mark.parametrize(
    ("token", "method", "path", "now", "says"),
    [
        ("another-token", "GET", PATH, 1_000.0, "does not match"),
        (TOKEN, "POST", PATH, 1_000.0, "does not match"),
        (TOKEN, "GET", PATH + "x", 1_000.0, "does not match"),
        (TOKEN, "GET", PATH, 1_000.0 + MAX_SKEW_S + 1, "clock"),
        (TOKEN, "GET", PATH, 1_000.0 - MAX_SKEW_S - 1, "clock"),
        ("", "GET", PATH, 1_000.0, "no node token"),
    ],
)
def test_what_another_token_path_or_time_signed_is_refused(
    token: str, method: str, path: str, now: float, says: str
) -> None:
    header = sign(TOKEN, "GET", PATH, "node-b", 1_000.0)
    with pytest.raises(BadSignature, match=says):
        verify(header, token, method, path, now)


@pytest.mark.parametrize("header", ["", "Bearer x", "HeteroFlow-Node node-b:1000:abc",
                                    "HeteroFlow-Node ../x:1000:" + "0" * 64])
def test_a_header_that_is_not_a_signature_is_refused(header: str) -> None:
    with pytest.raises(BadSignature, match="needs an Authorization header"):
        verify(header, TOKEN, "GET", PATH, 1_000.0)
