"""``heteroflow keys`` and ``heteroflow usage`` (issue 33): a service's API key and the
usage table, from the CLI, over the API's own routes (docs/api.md).

A service has one key, its endpoint's (``GET /api/v1/gateway/endpoints`` lists them with
their display prefix). ``keys rotate`` revokes it and makes a new one in one step
(``PATCH .../gateway/endpoints/{id} {"rotate_key": true}``): the old key stops working
within the gateways' snapshot period, the new one is printed once; ``keys revoke`` does
the same without printing the new one, so no key works until a rotate.
``usage`` prints ``GET /api/v1/usage`` as a table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from heteroflow.cmd import tables
from heteroflow.cmd.errors import CliError
from heteroflow.cmd.remote import check, print_json, session, show_list

ENDPOINTS = "/api/v1/gateway/endpoints"
USAGE_SUMS = ("requests", "prompt_tokens", "completion_tokens", "total_tokens")
GPU_SUMS = ("gpu_running_card_seconds", "gpu_sleeping_card_seconds")
# a group_by name -> the row's field
GROUP_FIELDS = {
    "tenant": "tenant_id", "member": "member_id", "endpoint": "endpoint_id",
    "service": "service_id",
}


def _limits(e: Mapping[str, Any]) -> str:
    parts = [
        f"{name} {e[key]}"
        for name, key in (("rpm", "rpm_limit"), ("tpm", "tpm_limit"))
        if e.get(key)
    ]
    if e.get("quota_tokens"):
        parts.append(f"{e['quota_tokens']} tokens/{e.get('quota_period') or '?'}")
    return ", ".join(parts) or tables.EMPTY


def keys_table(endpoints: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        (
            e.get("id"), e.get("name"), e.get("group_id") or tables.EMPTY,
            e.get("key_prefix"), _limits(e), tables.when(e.get("updated_at")),
        )
        for e in endpoints
    ]
    return tables.table(("ENDPOINT", "NAME", "SERVICE", "KEY", "LIMITS", "CHANGED"), rows)


def list_keys(service_id: str | None = None, as_json: bool = False) -> None:
    with session() as c:
        answer = check(c.get(ENDPOINTS))
    if service_id is not None and isinstance(answer, list):
        answer = [e for e in answer if e.get("group_id") == service_id]
    show_list(answer, keys_table, as_json, "keys")


def rotate_key(target: str, as_json: bool = False, show: bool = True) -> None:
    """A new key for an endpoint (``ep-...``) or a service's endpoint (``tg-...``).
    ``show`` False is ``keys revoke``: the old key stops working and the new one is not
    printed, so no key works until ``keys rotate`` makes one."""
    with session() as c:
        endpoint_id = target
        if target.startswith("tg-"):
            g = check(c.get(f"/api/v1/task-groups/{target}"))
            endpoint_id = str(g.get("endpoint") or "")
            if not endpoint_id:
                raise CliError(f"service {target} has no endpoint (it serves no API)")
        answer = check(c.patch(f"{ENDPOINTS}/{endpoint_id}", json={"rotate_key": True}))
    if not show:
        answer = {k: v for k, v in answer.items() if k != "api_key"}
        if not as_json:
            print(f"revoked the API key of {answer.get('name')} ({endpoint_id}): it stops "
                  "working within a few seconds; `heteroflow keys rotate` makes a new one")
            return
    if as_json:
        print_json(answer)
        return
    print(f"new API key for {answer.get('name')} ({endpoint_id}), shown once: "
          f"{answer.get('api_key')}")
    print("the old key stops working within a few seconds")


def usage_table(report: Mapping[str, Any]) -> str:
    """The rows of a usage report: the grouped-by fields, then the sums, then a total."""
    group_by = [str(g) for g in report.get("group_by") or []]
    rows_in: list[Mapping[str, Any]] = list(report.get("rows") or [])
    sums = [*USAGE_SUMS, *(k for k in GPU_SUMS if any(k in r for r in rows_in))]

    def cells(r: Mapping[str, Any]) -> list[Any]:
        return [r.get(k) if r.get(k) is not None else tables.EMPTY for k in sums]

    fields = [GROUP_FIELDS.get(g, g) for g in group_by]
    rows = [[r.get(f) or tables.EMPTY for f in fields] + cells(r) for r in rows_in]
    total = report.get("total") or {}
    if group_by:
        rows.append(["total", *[""] * (len(group_by) - 1), *cells(total)])
    else:
        rows = [cells(total)]
    headers = [g.upper() for g in group_by] + [s.replace("_", " ").upper() for s in sums]
    span = f"from {report.get('start') or 'the first record'} to {report.get('end') or 'now'}"
    if not rows_in and group_by:
        return f"no usage {span}"
    return f"usage {span}\n" + tables.table(headers, rows)


def show_usage(params: dict[str, str], as_json: bool = False) -> None:
    with session() as c:
        answer = check(c.get("/api/v1/usage", params=params))
    if as_json:
        print_json(answer)
    else:
        print(usage_table(answer))
