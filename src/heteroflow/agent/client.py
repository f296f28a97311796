"""The agent's HTTP client for the server's agent protocol (node token auth).

An https server is verified against ``ca_file`` (HETEROFLOW_AGENT_CA_FILE, a PEM CA
bundle) when given, else against the default bundle; a certificate that does not verify
is one clear error naming the setting (issue 18).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

from heteroflow.schemas.files import AgentFileRequest, ListResult
from heteroflow.schemas.model_requests import AgentModelRequest, ModelRequestReport
from heteroflow.schemas.nodes import Heartbeat, HeartbeatReply, TaskAssignment
from heteroflow.schemas.prepull import PrepullAsk
from heteroflow.schemas.sleep import NodeTaskLife


class ServerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class ServerTlsError(httpx.ConnectError):
    """The server's certificate did not verify: what to set, in one line."""


def tls_context(ca_file: Path | None) -> ssl.SSLContext | bool:
    """What httpx verifies an https server with: the CA bundle, or the default (True)."""
    if ca_file is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"HETEROFLOW_AGENT_CA_FILE {ca_file}: not a readable PEM CA bundle ({exc})"
        ) from exc


def _verify_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _checked(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        try:
            msg = r.json()["error"]["message"]
        except Exception:
            msg = r.text[:200]
        raise ServerError(r.status_code, msg)
    return r.json()


class ServerClient:
    def __init__(
        self,
        server_url: str,
        node_token: str,
        timeout_s: float,
        *,
        ca_file: Path | None = None,
    ) -> None:
        self._base = server_url.rstrip("/")
        self._ca_file = ca_file
        self._http = httpx.AsyncClient(
            base_url=self._base,
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {node_token}"},
            verify=tls_context(ca_file),
        )
        self.node_id = ""

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"X-Heteroflow-Node": self.node_id, **kwargs.pop("headers", {})}
        try:
            return await self._http.request(method, path, headers=headers, **kwargs)
        except httpx.ConnectError as exc:
            failure = _verify_failure(exc)
            if failure is None:
                raise
            reason = failure.verify_message or str(failure)
            if self._ca_file is None:
                advice = (
                    "set HETEROFLOW_AGENT_CA_FILE to the CA bundle (PEM) that signed the "
                    "server's certificate"
                )
            else:
                advice = (
                    f"the server's certificate is not signed by a CA in "
                    f"HETEROFLOW_AGENT_CA_FILE ({self._ca_file}), or does not name this host"
                )
            raise ServerTlsError(
                f"{self._base}: certificate verify failed ({reason}): {advice}",
                request=exc.request,
            ) from exc

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return _checked(await self._send("POST", path, json=body))

    async def _get(self, path: str) -> Any:
        return _checked(await self._send("GET", path))

    async def heartbeat(self, hb: Heartbeat) -> HeartbeatReply:
        reply = HeartbeatReply.model_validate(
            await self._post("/api/v1/agent/heartbeat", hb.model_dump())
        )
        self.node_id = reply.node_id
        return reply

    async def claim(self, task_id: str) -> TaskAssignment:
        return TaskAssignment.model_validate(
            await self._post(f"/api/v1/agent/tasks/{task_id}/claim", {})
        )

    async def report(
        self,
        task_id: str,
        status: str,
        message: str = "",
        argv: list[str] | None = None,
        fault: str | None = None,
        busy_ports: tuple[int, ...] = (),
        note: str | None = None,
    ) -> str:
        """Report a task's outcome; ``fault`` names why a ``failed`` one failed (E2);
        ``pending`` with ``busy_ports`` gives it back to be placed with other ports (P2);
        ``starting`` notes a launch retry on the task; ``starting`` / ``waking`` with
        ``note`` "loading" or "progress" says how its load goes (D5)."""
        body: dict[str, Any] = {"status": status, "message": message[:8000]}
        if argv is not None:
            body["argv"] = argv
        if fault is not None:
            body["fault"] = fault
        if busy_ports:
            body["busy_ports"] = list(busy_ports)
        if note is not None:
            body["note"] = note
        data = await self._post(f"/api/v1/agent/tasks/{task_id}/report", body)
        return str(data["status"])

    async def task_life(self) -> NodeTaskLife:
        """This node's sleeping and waking task ids (F1/F2: the light poll)."""
        return NodeTaskLife.model_validate(await self._get("/api/v1/agent/task-life"))

    # -- logs (C6) and file requests (C7) ------------------------------------------
    async def post_logs(self, task_id: str, text: str) -> None:
        await self._post(f"/api/v1/agent/tasks/{task_id}/logs", {"text": text})

    async def prepulls(self) -> list[PrepullAsk]:
        """The images a recreate asks this node to pull before anything stops (J2, H7)."""
        data = await self._get("/api/v1/agent/prepulls")
        return [PrepullAsk.model_validate(d) for d in data]

    async def prepulled(self, task_id: str, image: str, outcome: str, message: str) -> None:
        await self._post(
            f"/api/v1/agent/tasks/{task_id}/prepull",
            {"image": image, "outcome": outcome, "message": message},
        )

    async def file_requests(self) -> list[AgentFileRequest]:
        """Pending file requests for this node's tasks, claimed by this call."""
        data = await self._get("/api/v1/agent/file-requests")
        return [AgentFileRequest.model_validate(d) for d in data]

    async def file_chunk(self, request_id: str, seq: int, data: bytes) -> None:
        r = await self._send(
            "POST",
            f"/api/v1/agent/file-requests/{request_id}/chunks",
            content=data,
            headers={"X-Chunk-Seq": str(seq), "Content-Type": "application/octet-stream"},
        )
        _checked(r)

    async def file_done(
        self,
        request_id: str,
        status: str,
        *,
        error: str = "",
        result: ListResult | None = None,
        size_bytes: int = 0,
    ) -> str:
        body: dict[str, Any] = {"status": status, "error": error[:8000], "size_bytes": size_bytes}
        if result is not None:
            body["result"] = result.model_dump()
        data = await self._post(f"/api/v1/agent/file-requests/{request_id}/done", body)
        return str(data["status"])

    # -- model requests (issue 29: `heteroflow models pull/evict`) --------------------
    async def model_requests(self, held: list[str]) -> list[AgentModelRequest]:
        """This node's pending pulls and evictions, claimed by this call; ``held`` names
        the ones under way here (any other running one was lost: the server fails it)."""
        r = await self._send("GET", "/api/v1/agent/model-requests", params={"held": held})
        return [AgentModelRequest.model_validate(d) for d in _checked(r)]

    async def model_report(self, request_id: str, rep: ModelRequestReport) -> str:
        data = await self._post(
            f"/api/v1/agent/model-requests/{request_id}", rep.model_dump(mode="json")
        )
        return str(data["status"])
