"""What the CLI prints (cmd/tables.py) and the status summary (cmd/status.py), from API JSON."""

from __future__ import annotations

from typing import Any

from heteroflow.cmd import status, tables


def group(status_: str, *tasks: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {
        "id": "tg-1",
        "name": "chat",
        "model_name": "qwen",
        "task_type": "inference",
        "status": status_,
        "status_message": "",
        "endpoint": "ep-1",
        "current_replicas": max(1, len(tasks)),
        "priority": 0,
        "created_at": "2026-01-01T10:00:00.123456Z",
        "tasks": list(tasks),
        **over,
    }


def task(status_: str, message: str = "", rank: int = 0, **over: Any) -> dict[str, Any]:
    return {
        "id": f"task-{rank}",
        "group_id": "tg-1",
        "rank": rank,
        "status": status_,
        "status_message": message,
        "node_id": "node-a" if status_ != "pending" else None,
        "gpu_ids": [0, 1] if status_ != "pending" else [],
        "ports": [{"container_port": 8000, "host_port": 21000}],
        **over,
    }


def node(
    name: str, status_: str = "online", gpus: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "id": f"node-{name}",
        "name": name,
        "address": "10.0.0.7",
        "runtime": "docker",
        "status": status_,
        "gpus": gpus or [],
        "cpu_percent": 12.34,
        "memory_percent": 56.78,
        "last_heartbeat_at": "2026-01-01T09:59:00Z",
    }


def test_table_aligns_columns_on_the_widest_cell_without_trailing_spaces() -> None:
    text = tables.table(("ID", "NAME", "NOTE"), [("a", "long-name", None), ("bbbb", "x", "")])
    assert text.splitlines() == [
        "ID    NAME       NOTE",
        "a     long-name  -",
        "bbbb  x          -",
    ]


def test_cells_are_one_line_and_nothing_is_a_dash() -> None:
    assert tables.cell("two\nlines  here") == "two lines here"
    values: tuple[Any, ...] = (None, "", [], True, 1.25, 7)
    assert [tables.cell(v) for v in values] == ["-", "-", "-", "yes", "1.2", "7"]
    assert tables.truncate("x" * 70, 10) == "x" * 9 + "…"


def test_kv_aligns_values_and_indents_continuation_lines() -> None:
    assert tables.kv([("id", "tg-1"), ("reason", "first\nsecond"), ("endpoint", None)]) == (
        "id:       tg-1\nreason:   first\n          second\nendpoint: -"
    )


def test_services_table_shows_replicas_endpoint_and_the_reason_when_not_running() -> None:
    pending = group(
        "pending",
        task("pending", "InsufficientResources: 0/3 nodes fit\n2 node(s): offline"),
        id="tg-2",
        name="big",
        endpoint=None,
    )
    two = group("scheduling", task("running", rank=0), task("starting", "loading model", rank=1))
    lines = tables.services_table([group("running", task("running")), pending, two]).splitlines()
    assert lines[0].split() == ["ID", "NAME", "MODEL", "STATUS", "REPLICAS", "ENDPOINT", "REASON"]
    assert lines[1].split() == ["tg-1", "chat", "qwen", "running", "1/1", "ep-1", "-"]
    assert lines[2].split()[:6] == ["tg-2", "big", "qwen", "pending", "0/1", "-"]
    assert lines[2].endswith("InsufficientResources: 0/3 nodes fit")
    assert lines[3].split()[3:] == ["scheduling", "1/2", "ep-1", "loading", "model"]
    # every row's columns start at the same offsets as the header's
    starts = [lines[0].index("STATUS"), lines[0].index("REPLICAS")]
    assert all(line[starts[0] - 2 : starts[0]] == "  " for line in lines)


def test_a_failed_task_is_the_reason_before_a_pending_one() -> None:
    g = group("failed", task("pending", "waiting", rank=0), task("failed", "exit 1\nmore", rank=1))
    assert tables.group_reason(g) == "exit 1"
    assert tables.group_reason(group("stopped", status_message="task group tg-1 deleted")) == (
        "task group tg-1 deleted"
    )


def test_service_block_has_fields_tasks_and_every_pending_reason() -> None:
    g = group("pending", task("pending", "InsufficientResources: 0/1 nodes fit\n1 node(s): vram"))
    lines = tables.service_block(g).splitlines()
    assert "name:     chat" in lines
    assert "replicas: 0/1 running" in lines
    assert "created:  2026-01-01 10:00:00" in lines
    assert lines[-2:] == ["  InsufficientResources: 0/1 nodes fit", "  1 node(s): vram"]


def test_task_block() -> None:
    text = tables.task_block(task("running", draining=True))
    assert "gpus:       0,1" in text.splitlines()
    assert "ports:      21000->8000" in text.splitlines()  # host->container, as Docker
    assert "draining:   yes" in text.splitlines()


def test_nodes_table_counts_gpus_by_model_and_rounds_load() -> None:
    a10 = {"index": 0, "vendor": "nvidia", "model": "A10"}
    gpus = [a10, {**a10, "index": 1}, {"index": 2, "vendor": "amd", "model": ""}]
    lines = tables.nodes_table([node("gpu-1", gpus=gpus), node("cpu-1", "offline")]).splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "RUNTIME", "GPUS", "CPU%", "MEM%", "ADDRESS"]
    assert lines[1].split() == [
        "gpu-1",
        "online",
        "docker",
        "2x",
        "A10,",
        "1x",
        "amd",
        "12",
        "57",
        "10.0.0.7",
    ]
    assert lines[2].split() == ["cpu-1", "offline", "docker", "-", "12", "57", "10.0.0.7"]


def test_tenants_users_and_sharing_groups_tables() -> None:
    tenants = [{"id": "tn-1", "name": "acme", "priority_ceiling": 300, "sharing_group_id": None}]
    assert tables.tenants_table(tenants).splitlines()[1].split() == ["tn-1", "acme", "300", "-"]
    users = [{"id": "us-1", "username": "bob", "role": "member", "tenant_id": "tn-1"}]
    assert tables.users_table(users).splitlines() == [
        "ID    USERNAME  ROLE    TENANT",
        "us-1  bob       member  tn-1",
    ]
    groups = [{"id": "sg-1", "name": "lab", "tenants": [{"id": "tn-1", "name": "acme"}]}]
    assert tables.sharing_groups_table(groups).splitlines()[1] == "sg-1  lab   acme (tn-1)"
    assert "tenants: acme (tn-1)" in tables.sharing_group_block(groups[0]).splitlines()


def raw(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "url": "http://hf.test",
        "health_code": 200,
        "health": {"status": "ok"},
        "servers": {
            "leader": "srv-1",
            "instances": [
                {
                    "id": "srv-1",
                    "hostname": "h1",
                    "port": 3333,
                    "pid": 9,
                    "version": "0.2.0",
                    "is_leader": True,
                    "last_seen_at": "2026-01-01T10:00:00Z",
                }
            ],
        },
        "nodes": [node("gpu-1")],
        "groups": [group("running", task("running"))],
    }
    return {**base, **over}


def test_status_summary_of_a_healthy_platform() -> None:
    summary = status.summarize(raw())
    assert summary["ok"] is True and summary["problems"] == []
    assert summary["server"] == {
        "url": "http://hf.test",
        "reachable": True,
        "health": "ok",
        "version": "0.2.0",
    }
    assert summary["nodes"] == {"total": 1, "online": 1, "offline": 0}
    assert summary["services"] == {"total": 1, "by_status": {"running": 1}}
    text = status.render(summary)
    assert text.endswith("nothing is wrong")
    assert "servers:  1 instance, leader srv-1" in text


def test_status_lists_what_is_wrong() -> None:
    groups = [
        group("failed", task("failed", "engine exited 1")),
        group(
            "pending",
            task("pending", "InsufficientResources: 0/2 nodes fit\n2: offline"),
            id="tg-2",
            name="big",
        ),
    ]
    summary = status.summarize(raw(nodes=[node("gpu-1"), node("gpu-2", "offline")], groups=groups))
    assert summary["ok"] is False
    assert [(p["kind"], p["subject"], p["reason"]) for p in summary["problems"]] == [
        ("node_offline", "gpu-2", "offline, last heartbeat 2026-01-01 09:59:00"),
        ("service_failed", "chat (tg-1)", "engine exited 1"),
        ("task_pending", "task-0 of big (tg-2)", "InsufficientResources: 0/2 nodes fit"),
    ]
    assert summary["services"]["by_status"] == {"pending": 1, "failed": 1}
    text = status.render(summary)
    assert "what is wrong (3):" in text
    assert "nodes:    1 online, 1 offline" in text


def test_status_for_a_member_no_leader_no_nodes_unhealthy() -> None:
    member = status.summarize(raw(servers=None))
    assert member["ok"] is True and member["servers"]["visible"] is False
    assert "(listed for operators only)" in status.render(member)
    bad = status.summarize(
        raw(health_code=503, health={}, servers={"leader": None, "instances": []}, nodes=[])
    )
    assert [p["kind"] for p in bad["problems"]] == ["server_unhealthy", "no_leader", "no_nodes"]
    assert bad["server"]["health"] == "HTTP 503"
