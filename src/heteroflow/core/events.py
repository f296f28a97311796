"""What an ``events`` row can say: its kind, and the agent's fault names behind some.

An event is a fact on a group's timeline (``GET /api/v1/task-groups/{id}/events``) or,
with ``group_id`` NULL, a node-level mark the node watch keeps (services/lifecycle/faults.py). The
``kind`` column stays a string in the database and on the wire; code writes and reads it
only through ``EventKind``. Which node a row concerns is the ``node_id`` column, never
a name parsed out of the message: the message is for people and may change wording.
"""

from __future__ import annotations

from typing import Literal

from heteroflow.core.states import WireEnum


class EventKind(WireEnum):
    TASK_STATUS = "task_status"  # services/lifecycle/transitions.py: a task's state change
    GROUP_STATUS = "group_status"  # its group's derived status changed with it
    PREEMPTION = "preemption"  # the scheduler stops lower-priority work (B4)
    DRAIN = "drain"  # services/lifecycle/draining.py (M11)
    UNDRAIN = "undrain"
    # a launch that met a taken host port (P2): retried on the same port, or placed again
    LAUNCH_RETRY = "task.launch_retry"
    PORT_CONFLICT = "task.port_conflict"
    # H7: the task's image is being pulled on its node (its start, its end: size, time)
    IMAGE_PULL = "task.image_pull"
    # issue 29 (H9): the task's model source is being fetched into its node's cache (its
    # start: size, files, revision; its end: size, time)
    MODEL_FETCH = "task.model_fetch"
    # D5: an engine's load window opened (a launch or a wake): the model's size and the
    # expected load time on its node
    LOADING = "task.loading"
    # LoRA (core.lora): what a running engine serves, or why an adapter did not load
    LORA_ADAPTER = "task.lora_adapter"
    # F3: a wake that cannot happen yet (node offline, card borrowed), and why
    WAKE_DEFERRED = "task.wake_deferred"
    # faults (E2), services/lifecycle/faults.py
    CONTAINER_LOST = "fault.container_lost"
    ENGINE_EXITED = "fault.engine_exited"
    UNHEALTHY = "fault.unhealthy"
    # H7: the image cannot be pulled until a person acts (not found, unauthorised):
    # recovery does not rebuild for it and a rolling update fails at once
    IMAGE_UNAVAILABLE = "fault.image_unavailable"
    # D5: an engine whose load made no progress for the agent's load_stall_s (or passed
    # its ceiling), stopped before its first passing health check: a failed start
    LOAD_STALLED = "fault.load_stalled"
    GPU_LOST = "fault.gpu_lost"
    # issue 29 (H9): an operator's pull or eviction on a node's model cache ended
    # (node-level rows: group_id NULL; services/agents/model_requests.py)
    NODE_MODEL_PULLED = "node.model_pulled"
    NODE_MODEL_EVICTED = "node.model_evicted"
    NODE_MODEL_REQUEST_FAILED = "node.model_request_failed"
    NODE_LOST = "fault.node_lost"
    NODE_BACK = "fault.node_back"
    # recovery (E1-E4, services/lifecycle/recovery.py): one group-level row per real rebuild, with
    # its cause; the one row when it stops trying; a task failed off lost hardware (a
    # node lost past node_migrate_after_s, a card gone from its node's inventory); a
    # training / container task stopped by its run timeout (A10)
    REBUILT = "fault.rebuilt"
    REBUILD_GAVE_UP = "fault.rebuild_gave_up"
    # issue 32 (G3): a gang whose stage failed with its own result (a training stage's
    # exit): its other stages stopped with it, nothing rebuilt (services/lifecycle/gangs.py)
    GANG_STOPPED = "fault.gang_stopped"
    EVACUATED = "fault.evacuated"
    # a lost node's work kept where it is: too many nodes lost at once (a control-plane
    # fault, core.recovery.evacuation_paused); once per group and loss
    EVACUATION_HELD = "fault.evacuation_held"
    RUN_TIMEOUT = "fault.run_timeout"
    # the owner's word on a group (services/lifecycle/task_groups.py): stop / start (``desired``
    # from -> to), and a change of its health check or idle timeout (D4)
    DESIRED = "group.desired"
    # issue 16 (L2-L4): a create reused this running / sleeping service (who, as what)
    DEDUP_REUSED = "group.dedup_reused"
    CONFIG_CHANGED = "group.config_changed"
    # schedule windows (K1, services/lifecycle/windows.py): the window's action put in effect
    # (from_status "" -> to_status pause | scale | stop) or kept (a replica put back to
    # sleep); the action ended (restored or released: to_status ""); an action that
    # could not run (written once per distinct reason, retried every round)
    WINDOW_PAUSE = "window.pause"
    WINDOW_RESUME = "window.resume"
    WINDOW_FAILED = "window.failed"
    # --- issue 14: rolling update / recreate (J1-J4, core/rollout.py): submitted (the
    # generation and what changes), each batch's steps, a batch tried again, the rollback,
    # the end (done, or failed: rolled back, or abandoned: lease expired, stopped...) ---
    ROLLOUT_STARTED = "rollout.started"
    ROLLOUT_BATCH = "rollout.batch"
    ROLLOUT_RETRY = "rollout.retry"
    ROLLOUT_ROLLBACK = "rollout.rollback"
    ROLLOUT_DONE = "rollout.done"
    ROLLOUT_FAILED = "rollout.failed"
    # a recreate's new image made present on an old replica's node before anything drains:
    # the agent's word on that replica (to_status pulled | failed (may heal) | unavailable)
    ROLLOUT_PREPULL = "rollout.prepull"
    # --- end issue 14 (rollout) ---
    # --- issue 14: scaling (I1, I2; services/lifecycle/scaling.py): a replica count changed
    # (from_status -> to_status: the counts; by whom, the tasks added or leaving), and the
    # autoscaler's decision (the counts, or to_status "skip:<why>"; the metric, target,
    # formula and why it was clamped or held) ---
    SCALED = "group.scaled"
    AUTOSCALE = "group.autoscale"
    # --- end issue 14 (scaling) ---


# The node watch's marks: the latest of these on a node's node-level rows is its state.
NODE_MARKS = frozenset({EventKind.NODE_LOST, EventKind.NODE_BACK})


class FaultKind(WireEnum):
    """Why a task failed, when its agent knows it was a fault (``TaskReport.fault``)."""

    CONTAINER_LOST = "container_lost"
    ENGINE_EXITED = "engine_exited"
    UNHEALTHY = "unhealthy"
    IMAGE_UNAVAILABLE = "image_unavailable"
    LOAD_STALLED = "load_stalled"


# The wire type of ``TaskReport.fault`` (a Literal of the members: strict models take the
# plain string and hand back the member).
ReportedFault = Literal[
    FaultKind.CONTAINER_LOST, FaultKind.ENGINE_EXITED, FaultKind.UNHEALTHY, FaultKind.LOAD_STALLED,
    FaultKind.IMAGE_UNAVAILABLE,
]

# An agent-reported fault -> the event kind written for it.
FAULT_EVENT: dict[FaultKind, EventKind] = {
    FaultKind.CONTAINER_LOST: EventKind.CONTAINER_LOST,
    FaultKind.ENGINE_EXITED: EventKind.ENGINE_EXITED,
    FaultKind.UNHEALTHY: EventKind.UNHEALTHY,
    FaultKind.IMAGE_UNAVAILABLE: EventKind.IMAGE_UNAVAILABLE,
    FaultKind.LOAD_STALLED: EventKind.LOAD_STALLED,
}
