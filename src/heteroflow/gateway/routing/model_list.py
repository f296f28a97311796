"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models a key may call.

Only what the key may call *and* what has a route is listed, so that a listed model
never answers model_not_found when called; with more than one, ``auto`` (M10: a choice
among them) is listed last. The snapshot carries no creation times: ``created`` is when
the gateway started (issue 15).
"""

from __future__ import annotations

import orjson

from heteroflow.gateway.inbound import authenticate
from heteroflow.gateway.routing.auto import AUTO_MODEL
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Scope, Send
from heteroflow.schemas.routing import RoutingSnapshot

MODELS_PREFIX = "/v1/models/"


async def list_models(
    snap: RoutingSnapshot, created: int, scope: Scope, send: Send, path: str
) -> None:
    entry = authenticate(scope, snap)
    if isinstance(entry, errors.OpenAIError):
        await errors.send_error(send, entry)
        return
    # Only what the key may call *and* what has a route: a listed model must not
    # answer model_not_found when called.
    callable_ = sorted(m for m in entry.models if (entry.tenant_id, m) in snap.routes)
    if len(callable_) > 1 and AUTO_MODEL not in callable_:
        callable_.append(AUTO_MODEL)  # M10: a choice among them, listed last
    if path == "/v1/models":
        data = [_model_object(m, created) for m in callable_]
        body = orjson.dumps({"object": "list", "data": data})
    else:
        model = path[len(MODELS_PREFIX) :]
        if model not in callable_:
            await errors.send_error(send, errors.model_not_found(model))
            return
        body = orjson.dumps(_model_object(model, created))
    await errors.send_json(send, 200, body)


def _model_object(model: str, created: int) -> dict[str, object]:
    return {"id": model, "object": "model", "created": created, "owned_by": "heteroflow"}
