"""What a read shows of a hub token (H9): its last 4 characters, never more; and a
claim's token stays out of an assignment's repr."""

from __future__ import annotations

import pytest

from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.services.tenancy.hub_tokens import hint

pytestmark = pytest.mark.feature("H9")


@pytest.mark.parametrize(
    ("token", "shown"),
    [
        ("hf_abcdefghijklmnopqrstuvwxyz1234", "hf_…1234"),
        ("0f3c9a2e-1b7d-4c55-9e0a-77aa12345678", "…5678"),
        ("exactly-16-chars", "…hars"),
        ("fifteen-chars-x", "…"),  # too short to show any of it
        ("hf_short", "…"),
    ],
)
def test_the_hint_shows_the_last_four_characters_of_a_long_token_only(
    token: str, shown: str
) -> None:
    assert hint(token) == shown


def test_an_assignments_repr_never_holds_its_hub_token() -> None:
    secret = "hf_tenantAAAAtoken0123456789wxyz"
    t = TaskAssignment(
        id="t-1", group_id="g-1", name="svc-0", status="starting", task_type="inference",
        model_name="svc", model_path="hf://org/m", image="i", engine="vllm", command=[],
        engine_args=[], env=[], ports=[], gpu_ids=[], gpu_required=0, memory_mb=0,
        health_check={}, hub_token=secret,
    )
    assert secret not in repr(t) and secret not in str(t)
    assert t.model_dump()["hub_token"] == secret  # the claim reply carries it
