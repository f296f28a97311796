"""A chat completions stream retold as a Responses API stream (M14).

``StreamTranslator`` takes the chat stream's events (``chat.completion.chunk`` objects,
then the end) and returns the Responses events to send, in OpenAI's order and numbered
by ``sequence_number``: ``response.created`` and ``response.in_progress`` at once; for
text ``response.output_item.added`` (a message), ``response.content_part.added``,
``response.output_text.delta``..., then ``response.output_text.done``,
``response.content_part.done`` and ``response.output_item.done``; for each tool call
``response.output_item.added`` (a function_call, once its name is known),
``response.function_call_arguments.delta``..., ``.done`` and
``response.output_item.done``; last ``response.completed`` (``response.incomplete``
when the output hit ``max_output_tokens``) with the whole Response and its usage. A
stream that broke ends with an ``error`` event and ``response.failed``.

The engine's reasoning (``reasoning_content``) comes first as a ``reasoning`` item with
``response.reasoning_text.delta`` / ``.done`` events. Text is one message item, closed
when the first tool call starts; tool calls stay open until the end (engines may
interleave their argument deltas). Pure: no I/O;
``encode`` writes events as SSE.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from heteroflow.gateway.shaping.responses import (
    call_item,
    finished,
    item_status,
    message_item,
    new_id,
    reasoning_item,
    reasoning_part,
    response_object,
    text_part,
)

_ITEM = {"text": message_item, "reasoning": reasoning_item}
_PART = {"text": text_part, "reasoning": reasoning_part}
_ID = {"text": "msg", "reasoning": "rs"}
_EVENT = {"text": "response.output_text", "reasoning": "response.reasoning_text"}


@dataclass(slots=True)
class _ToolCall:
    call_id: str
    name: str = ""
    arguments: str = ""
    index: int = -1  # its output_index once announced
    item_id: str = ""


class StreamTranslator:
    """One Responses stream; feed it the chat stream's events, send what it returns."""

    def __init__(
        self, request: dict[str, Any], *, model: str, rid: str | None = None
    ) -> None:
        self._response = response_object(
            request, rid=rid or new_id("resp"), created_at=time.time(), model=model
        )
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        # the open message or reasoning item: its kind and its text so far
        self._open: tuple[str, list[str]] | None = None
        self._calls: dict[int, _ToolCall] = {}
        self._finish_reason: object = None
        self._usage: object = None
        self.done = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._response),
            self._event("response.in_progress", response=self._response),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat stream chunk (often none: a role or an empty delta)."""
        if self.done:
            return []
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # Responses has no ``n``: only the first choice is asked for
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(thought, str) and thought:
                out += self._part_delta("reasoning", thought)
            content = delta.get("content")
            if isinstance(content, str) and content:
                out += self._part_delta("text", content)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out += self._call_delta(call)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The end of the chat stream: close what is open, then the whole Response."""
        if self.done:
            return []
        self.done = True
        status = item_status(self._finish_reason)
        out = self._close_open(status)
        for call in self._calls.values():
            if call.index < 0:
                out += self._announce(call)
            item = call_item(call.item_id, call.call_id, call.name, call.arguments, status)
            self._output[call.index] = item
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=call.item_id,
                    output_index=call.index,
                    arguments=call.arguments,
                )
            )
            out.append(self._event("response.output_item.done", output_index=call.index, item=item))
        self._response = finished(self._response, self._output, self._finish_reason, self._usage)
        final = self._response["status"]  # completed | incomplete
        out.append(self._event(f"response.{final}", response=self._response))
        return out

    def fail(self, message: str, code: str | None) -> list[dict[str, Any]]:
        """The chat stream broke (or said ``error``): an error event, then response.failed."""
        if self.done:
            return []
        self.done = True
        failed = {
            **self._response,
            "status": "failed",
            "output": self._output,
            "error": {"code": "server_error", "message": message},
        }
        return [
            self._event("error", code=code, message=message, param=None),
            self._event("response.failed", response=failed),
        ]

    def _part_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        """``text`` added to the open item of ``kind`` (text: a message; reasoning), which
        is opened first, closing another one."""
        out: list[dict[str, Any]] = []
        if self._open is None or self._open[0] != kind:
            out += self._close_open("completed")
            self._open = (kind, [])
            item = _ITEM[kind](new_id(_ID[kind]), "", "in_progress")
            self._output.append(item)
            index = len(self._output) - 1
            out.append(self._event("response.output_item.added", output_index=index, item=item))
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_PART[kind](""),
                )
            )
        self._open[1].append(text)
        index = len(self._output) - 1
        where = {"item_id": self._output[index]["id"], "output_index": index, "content_index": 0}
        extra: dict[str, Any] = {"logprobs": []} if kind == "text" else {}
        out.append(self._event(f"{_EVENT[kind]}.delta", **where, delta=text, **extra))
        return out

    def _close_open(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        kind, pieces = self._open
        self._open = None
        text = "".join(pieces)
        index = len(self._output) - 1
        item = _ITEM[kind](self._output[index]["id"], text, status)
        self._output[index] = item
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        extra: dict[str, Any] = {"logprobs": []} if kind == "text" else {}
        return [
            self._event(f"{_EVENT[kind]}.done", **where, text=text, **extra),
            self._event("response.content_part.done", **where, part=_PART[kind](text)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        key = delta.get("index", 0)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _ToolCall(delta.get("id") or new_id("call"))
        fn = delta.get("function") or {}
        name, arguments = fn.get("name"), fn.get("arguments")
        if isinstance(name, str) and call.index < 0:
            call.name += name
        out: list[dict[str, Any]] = []
        if call.index < 0:
            if isinstance(arguments, str):
                call.arguments += arguments  # held until the call is announced
            if call.name:
                out += self._announce(call)
        elif isinstance(arguments, str) and arguments:
            call.arguments += arguments
            out.append(self._arguments_delta(call, arguments))
        return out

    def _announce(self, call: _ToolCall) -> list[dict[str, Any]]:
        out = self._close_open("completed")
        call.item_id = new_id("fc")
        call.index = len(self._output)
        item = call_item(call.item_id, call.call_id, call.name, "", "in_progress")
        self._output.append(item)
        out.append(self._event("response.output_item.added", output_index=call.index, item=item))
        if call.arguments:
            out.append(self._arguments_delta(call, call.arguments))
        return out

    def _arguments_delta(self, call: _ToolCall, delta: str) -> dict[str, Any]:
        return self._event(
            "response.function_call_arguments.delta",
            item_id=call.item_id,
            output_index=call.index,
            delta=delta,
        )


def encode(events: list[dict[str, Any]]) -> bytes:
    """Events as SSE, each with its ``event:`` line as OpenAI sends them."""
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events
    )
