"""Engine errors and answers in OpenAI's shape (gateway.engine_errors and
gateway.normalize, issue 15, M13).

The llama.cpp bodies were recorded from the real launcher (``python -m
heteroflow.engines.llamacpp_server`` on the tiny model, ``-c 64``, xllamacpp
2026.10.11549); the vLLM and SGLang ones are the shapes their servers build
(vLLM ``ErrorResponse``/``create_error_response``, older vLLM and SGLang
``{"object": "error", ...}``, FastAPI's 422).
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import orjson
import pytest

from heteroflow.gateway.policy.usage import Usage, UsageTracker
from heteroflow.gateway.shaping.engine_errors import engine_error, is_backend_fault
from heteroflow.gateway.shaping.normalize import Asked, asked, fix_answer, needs_parse, rename_model
from heteroflow.gateway.wire.errors import OpenAIError
from tests.openai_schema import conforms

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
JSON = "application/json"

# --- recorded llama.cpp error bodies -------------------------------------------------
LC_IMAGE = (
    b'{"error":{"code":500,"message":"image input is not supported - hint: if this is '
    b'unexpected, you may need to provide the mmproj","type":"server_error"}}'
)
LC_AUDIO = (
    b'{"error":{"code":500,"message":"audio input is not supported - hint: if this is '
    b'unexpected, you may need to provide the mmproj","type":"server_error"}}'
)
LC_TOOLS = (
    b'{"error":{"code":500,"message":"Failed to parse tools: Unsupported tool type: '
    b'{\\"type\\":\\"banana\\",\\"x\\":1}; tools = [\\n  {\\n    \\"type\\": \\"banana\\",'
    b'\\n    \\"x\\": 1\\n  }\\n]","type":"server_error"}}'
)
LC_CONTEXT = (
    b'{"error":{"code":400,"message":"request (1629 tokens) exceeds the available context '
    b'size (256 tokens), try increasing it","type":"exceed_context_size_error",'
    b'"n_prompt_tokens":1629,"n_ctx":256}}'
)
LC_NO_EMBEDDINGS = (
    b'{"error":{"code":501,"message":"This server does not support embeddings. Start it '
    b'with `--embeddings`","type":"not_supported_error"}}'
)
LC_TEMPERATURE = (
    b'{"error":{"code":400,"message":"Field \'temperature\': [json.exception.type_error.302]'
    b' type must be number, but is string","type":"invalid_request_error"}}'
)
LC_MESSAGES = (
    b'{"error":{"code":400,"message":"Expected \'messages\' to be an array",'
    b'"type":"invalid_request_error"}}'
)
LC_N = (
    b'{"error":{"code":400,"message":"Field \'n\': Value must be between 1 <= value <= 1, '
    b'but got 2","type":"invalid_request_error"}}'
)
LC_RESPONSE_FORMAT = (
    b'{"error":{"code":400,"message":"response_format type must be one of \\"text\\" or '
    b'\\"json_object\\", but got: xml","type":"invalid_request_error"}}'
)
LC_CONTENT_TYPE = (
    b'{"error":{"code":400,"message":"unsupported content[].type","type":"invalid_request_error"}}'
)
LC_EMBED_INPUT = (
    b'{"error":{"code":400,"message":"\\"prompt\\" elements must be a string, a list of '
    b"tokens, a JSON object containing a prompt string, or a list of mixed strings & "
    b'tokens.","type":"invalid_request_error"}}'
)
# --- vLLM (ErrorResponse{error: ErrorInfo}; older and SGLang: {"object": "error"}) -------
VLLM_CONTEXT = (
    b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, '
    b'your request has 5000 input tokens. Please reduce the length of the input messages.",'
    b'"type":"BadRequestError","param":"input_tokens","code":400}}'
)
VLLM_MAX_TOKENS = (
    b'{"error":{"message":"\'max_tokens\' or \'max_completion_tokens\' is too large: 500. '
    b"This model's maximum context length is 4096 tokens and your request has 3800 input "
    b'tokens (500 > 4096 - 3800).","type":"BadRequestError","param":"max_tokens","code":400}}'
)
VLLM_OLD_CONTEXT = (
    b'{"object":"error","message":"This model\'s maximum context length is 4096 tokens. '
    b"However, you requested 5000 tokens (4000 in the messages, 1000 in the completion). "
    b'Please reduce the length of the messages or completion.","type":"BadRequestError",'
    b'"param":null,"code":400}'
)
VLLM_NO_MODEL = (
    b'{"error":{"message":"The model `foo` does not exist.","type":"NotFoundError",'
    b'"param":"model","code":404}}'
)
VLLM_FAULT = (
    b'{"error":{"message":"CUDA error: an illegal memory access was encountered",'
    b'"type":"InternalServerError","param":null,"code":500}}'
)
VLLM_NOT_MULTIMODAL = (
    b'{"error":{"message":"image_url is not supported by this model","type":"BadRequestError",'
    b'"param":null,"code":400}}'
)
SGLANG_CONTEXT = (
    b'{"object":"error","message":"The input (5000 tokens) is longer than the model\'s '
    b'context length (4096 tokens).","type":"BadRequestError","param":null,"code":400}'
)
SGLANG_WRAPPED = (
    b'{"object":"error","message":"Internal server error: Unsupported param: logit_bias",'
    b'"type":"InternalServerError","param":null,"code":500}'
)
FASTAPI_MISSING = (
    b'{"detail":[{"type":"missing","loc":["body","messages"],"msg":"Field required",'
    b'"input":{"model":"m"}}]}'
)
FASTAPI_TYPE = (
    b'{"detail":[{"type":"string_type","loc":["body","messages",0,"content"],'
    b'"msg":"Input should be a valid string","input":1}]}'
)


@pytest.mark.feature("M13")
@pytest.mark.parametrize(
    ("status", "body", "ctype", "path", "expected"),
    [
        # llama.cpp
        (400, LC_CONTEXT, JSON, CHAT, (400, "messages", "context_length_exceeded")),
        (400, LC_CONTEXT, JSON, COMPLETIONS, (400, "prompt", "context_length_exceeded")),
        (500, LC_IMAGE, JSON, CHAT, (400, "messages", None)),
        (500, LC_AUDIO, JSON, CHAT, (400, "messages", None)),
        (500, LC_TOOLS, JSON, CHAT, (400, "tools", None)),
        (501, LC_NO_EMBEDDINGS, JSON, EMBEDDINGS, (400, "model", "unsupported_model")),
        (400, LC_TEMPERATURE, JSON, CHAT, (400, "temperature", None)),
        (400, LC_MESSAGES, JSON, CHAT, (400, "messages", None)),
        (400, LC_N, JSON, CHAT, (400, "n", None)),
        (400, LC_RESPONSE_FORMAT, JSON, CHAT, (400, "response_format", None)),
        (400, LC_CONTENT_TYPE, JSON, CHAT, (400, "messages", None)),
        (400, LC_EMBED_INPUT, JSON, EMBEDDINGS, (400, "input", None)),
        # vLLM
        (400, VLLM_CONTEXT, JSON, CHAT, (400, "messages", "context_length_exceeded")),
        (400, VLLM_MAX_TOKENS, JSON, CHAT, (400, "max_tokens", "context_length_exceeded")),
        (400, VLLM_OLD_CONTEXT, JSON, CHAT, (400, "messages", "context_length_exceeded")),
        (404, VLLM_NO_MODEL, JSON, CHAT, (404, "model", "model_not_found")),
        (400, VLLM_NOT_MULTIMODAL, JSON, CHAT, (400, "messages", None)),
        (500, VLLM_FAULT, JSON, CHAT, (500, None, None)),
        (404, b'{"detail":"Not Found"}', JSON, EMBEDDINGS, (400, "model", "unsupported_model")),
        # SGLang
        (400, SGLANG_CONTEXT, JSON, CHAT, (400, "messages", "context_length_exceeded")),
        (500, SGLANG_WRAPPED, JSON, CHAT, (400, "logit_bias", None)),
        # FastAPI validation (422)
        (422, FASTAPI_MISSING, JSON, CHAT, (400, "messages", "missing_required_parameter")),
        (422, FASTAPI_TYPE, JSON, CHAT, (400, "messages.[0].content", "invalid_type")),
        # plain text and HTML bodies
        (500, b"Internal Server Error", "text/plain", CHAT, (500, None, None)),
        (502, b"<html><body>Bad Gateway</body></html>", "text/html", CHAT, (502, None, None)),
        (503, b"", "", CHAT, (503, None, None)),
        (413, b"Request Entity Too Large", "text/plain", CHAT, (413, None, None)),
        # the gateway's credentials refused: the backend's fault, not the caller's key
        (401, b'{"error":{"message":"Invalid API Key","code":401}}', JSON, CHAT,
         (502, None, "upstream_auth_failed")),
    ],
)  # fmt: skip
def test_engine_errors_become_openai_errors(
    status: int, body: bytes, ctype: str, path: str, expected: tuple[int, str | None, str | None]
) -> None:
    err = engine_error(status, body, ctype, path)
    assert (err.status, err.param, err.code) == expected
    assert err.message and "<html" not in err.message
    assert err.type == (
        "invalid_request_error"
        if err.status < 500
        else "service_unavailable"
        if err.status == 503
        else "server_error"
    )
    # OpenAI's shape: exactly the four fields, code and param strings or null
    wire = orjson.loads(err.body())["error"]
    assert set(wire) == {"message", "type", "param", "code"}
    assert all(wire[k] is None or isinstance(wire[k], str) for k in wire)


@pytest.mark.feature("M13")
@pytest.mark.feature("M5")
def test_only_what_is_left_at_5xx_is_a_backend_fault() -> None:
    client_mistakes = [(500, LC_IMAGE), (500, LC_TOOLS), (501, LC_NO_EMBEDDINGS), (400, LC_N)]
    for status, body in client_mistakes:
        assert not is_backend_fault(engine_error(status, body, JSON, CHAT))
    faults = [(500, VLLM_FAULT), (500, b"Internal Server Error"), (503, b"")]
    for status, body in faults:
        assert is_backend_fault(engine_error(status, body, "text/plain", CHAT))
    # a CUDA fault stays a fault even when it says "not supported"
    cuda = b'{"error":{"message":"CUDA error: operation not supported","code":500}}'
    assert is_backend_fault(engine_error(500, cuda, JSON, CHAT))
    # a model's output the engine's tool-call parser could not read: this answer failed,
    # the backend did not (500 for the caller, no ejection)
    output = (
        b'{"error":{"code":500,"type":"server_error","message":"Failed to parse input at pos 12:'
        b' the output does not match the expected peg-native format"}}'
    )
    err = engine_error(500, output, JSON, CHAT)
    assert (err.status, err.code) == (500, "model_output_invalid")
    assert not is_backend_fault(err)


@pytest.mark.feature("M13")
def test_context_overflow_uses_openai_wording_with_the_engine_counts() -> None:
    err = engine_error(400, LC_CONTEXT, JSON, CHAT)
    assert err.code == "context_length_exceeded"
    # the phrase LangChain's ContextOverflowError and LiteLLM look for
    assert err.message.startswith(
        "Input tokens exceed the configured limit of 256 tokens. Your messages resulted in 1629"
    )


# --- answers -------------------------------------------------------------------------

LC_CHAT = (
    b'{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant",'
    b'"content":"zj0g"}}],"created":1796090004,"model":"tiny","system_fingerprint":'
    b'"b0-unknown","object":"chat.completion","usage":{"completion_tokens":4,'
    b'"prompt_tokens":31,"total_tokens":35,"prompt_tokens_details":{"cached_tokens":30}},'
    b'"id":"chatcmpl-NvaxBpTMMiPD05DE87tjUI6yWGkIVyf5","timings":{"cache_n":30}}'
)
VLLM_CHAT = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":'
    b'[{"index":0,"message":{"role":"assistant","content":"hi","refusal":null,'
    b'"tool_calls":[]},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":'
    b'3,"total_tokens":5,"completion_tokens":2}}'
)
LC_COMPLETION_LOGPROBS = (
    b'{"choices":[{"text":"V/","index":0,"logprobs":{"content":[{"id":89,"token":"V",'
    b'"bytes":[86],"logprob":-0.2,"top_logprobs":[{"id":89,"token":"V","bytes":[86],'
    b'"logprob":-0.2},{"id":50,"token":"/","bytes":[47],"logprob":-2.8}]},{"id":50,'
    b'"token":"/","bytes":[47],"logprob":-1.2,"top_logprobs":[{"id":50,"token":"/",'
    b'"bytes":[47],"logprob":-1.2},{"id":52,"token":"1","bytes":[49],"logprob":-1.9}]}]},'
    b'"finish_reason":"length"}],"created":1796090004,"model":"tiny","object":'
    b'"text_completion","usage":{"completion_tokens":2,"prompt_tokens":6,"total_tokens":8},'
    b'"id":"chatcmpl-hmVQ77shdBUEkiY11oumAP4uqImshZYz"}'
)
LC_COMPLETION_LIST = (
    b'{"choices":[{"text":"V/","index":0,"logprobs":null,"finish_reason":"length"},'
    b'{"text":"v|","index":1,"logprobs":null,"finish_reason":"length"}],"created":1,'
    b'"model":"tiny","object":"text_completion","usage":{"completion_tokens":2,'
    b'"prompt_tokens":6,"total_tokens":8},"id":"chatcmpl-OGBs"}'
)
EMBEDDING = (
    b'{"model":"tiny","object":"list","usage":{"prompt_tokens":6,"total_tokens":6},'
    b'"data":[{"embedding":[0.5,-0.25,0.125,1.0],"index":0,"object":"embedding"}]}'
)


def _answer(a: Asked, data: bytes) -> dict[str, Any]:
    t = UsageTracker(hide=False, asked=a)
    out = t.answer(data)
    assert isinstance(out, bytes)
    obj: dict[str, Any] = orjson.loads(out)
    return obj


def _asked(path: str, body: dict[str, Any]) -> Asked:
    a = asked(path, {"model": "m", **body}, 1_700_000_000)
    assert isinstance(a, Asked)
    return a


@pytest.mark.feature("M13")
def test_llamacpp_chat_answer_gets_the_keys_the_schema_requires() -> None:
    a = _asked(CHAT, {"messages": []})
    with pytest.raises(AssertionError):
        conforms(orjson.loads(LC_CHAT))  # as llama.cpp answers it: logprobs, refusal missing
    t = UsageTracker(hide=False, asked=a)
    out = t.answer(LC_CHAT)
    assert isinstance(out, bytes)
    obj = orjson.loads(out)
    conforms(obj)
    assert obj["choices"][0]["logprobs"] is None and obj["choices"][0]["message"]["refusal"] is None
    assert obj["timings"] == {"cache_n": 30}  # engine extras are kept
    assert t.usage == Usage(31, 4)  # one parse serves the usage too


def test_an_answer_that_needs_nothing_is_relayed_unparsed() -> None:
    a = _asked(CHAT, {"messages": []})
    assert not needs_parse(a, VLLM_CHAT)
    t = UsageTracker(hide=False, asked=a)
    assert t.answer(VLLM_CHAT) is VLLM_CHAT  # the very bytes: nothing re-serialised
    assert t.usage == Usage(3, 2)
    conforms(orjson.loads(VLLM_CHAT))


@pytest.mark.feature("M13")
def test_completions_get_a_cmpl_id_and_logprobs_in_the_completions_shape() -> None:
    obj = _answer(_asked(COMPLETIONS, {"prompt": "hi", "logprobs": 2}), LC_COMPLETION_LOGPROBS)
    conforms(obj)
    assert obj["id"] == "cmpl-hmVQ77shdBUEkiY11oumAP4uqImshZYz"
    assert obj["choices"][0]["logprobs"] == {
        "tokens": ["V", "/"],
        "token_logprobs": [-0.2, -1.2],
        "top_logprobs": [{"V": -0.2, "/": -2.8}, {"/": -1.2, "1": -1.9}],
        "text_offset": [0, 1],
    }


@pytest.mark.feature("M13")
def test_echo_puts_each_prompt_before_its_completion() -> None:
    a = _asked(COMPLETIONS, {"prompt": ["hi", "yo"], "echo": True})
    assert a.echo == ("hi", "yo")
    obj = _answer(a, LC_COMPLETION_LIST)
    conforms(obj)
    assert [c["text"] for c in obj["choices"]] == ["hiV/", "yov|"]
    # n > 1: choices i*n .. i*n+n-1 belong to prompt i
    two = _asked(COMPLETIONS, {"prompt": "p", "echo": True, "n": 2})
    assert [c["text"] for c in _answer(two, LC_COMPLETION_LIST)["choices"]] == ["pV/", "pv|"]


@pytest.mark.feature("M13")
@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "echo": True, "logprobs": 1},  # OpenAI adds the prompt's logprobs
        {"prompt": [1, 2, 3], "echo": True},  # token ids: the gateway has no text for them
    ],
)
def test_echo_that_cannot_be_honoured_is_refused_naming_echo(body: dict[str, Any]) -> None:
    err = asked(COMPLETIONS, {"model": "m", **body}, 0)
    assert isinstance(err, OpenAIError)
    assert (err.status, err.param) == (400, "echo")


@pytest.mark.feature("M13")
def test_dimensions_are_honoured_when_they_fit_and_refused_otherwise() -> None:
    ok = _answer(_asked(EMBEDDINGS, {"input": "x", "dimensions": 4}), EMBEDDING)
    conforms(ok)
    t = UsageTracker(hide=False, asked=_asked(EMBEDDINGS, {"input": "x", "dimensions": 3}))
    err = t.answer(EMBEDDING)
    assert isinstance(err, OpenAIError)
    assert (err.status, err.param) == (400, "dimensions")
    assert "4 dimensions" in err.message


@pytest.mark.feature("M13")
def test_base64_is_encoded_as_openai_does_when_the_engine_answered_floats() -> None:
    obj = _answer(_asked(EMBEDDINGS, {"input": "x", "encoding_format": "base64"}), EMBEDDING)
    vec = obj["data"][0]["embedding"]
    assert isinstance(vec, str)
    assert struct.unpack("<4f", base64.b64decode(vec)) == (0.5, -0.25, 0.125, 1.0)
    # an engine that encoded already (llama.cpp, vLLM): untouched and unparsed (called
    # by the name the engine answers, so no rename either: issue 26)
    encoded = EMBEDDING.replace(b"[0.5,-0.25,0.125,1.0]", b'"AAAAPwAAgL4AAAA+AACAPw=="')
    a = _asked(EMBEDDINGS, {"input": "x", "encoding_format": "base64", "model": "tiny"})
    assert UsageTracker(hide=False, asked=a).answer(encoded) is encoded
    # and dimensions are checked on base64 vectors too
    a3 = _asked(EMBEDDINGS, {"input": "x", "encoding_format": "base64", "dimensions": 3})
    assert isinstance(UsageTracker(hide=False, asked=a3).answer(encoded), OpenAIError)


def test_created_is_an_int_and_object_is_right() -> None:
    a = _asked(CHAT, {"messages": []})
    obj: dict[str, Any] = orjson.loads(LC_CHAT)
    obj["created"] = 12.7
    obj["object"] = "chat.completion.weird"
    assert fix_answer(a, obj) is True
    assert (obj["created"], obj["object"]) == (12, "chat.completion")
    del obj["created"]
    fix_answer(a, obj)
    assert obj["created"] == 1_700_000_000  # the request's time


# --- streams -------------------------------------------------------------------------

LC_COMPLETION_STREAM = (
    b'data: {"choices":[{"text":"V","index":0,"logprobs":null,"finish_reason":null}],'
    b'"created":1,"model":"tiny","object":"text_completion","id":"chatcmpl-2k3s"}\n\n'
    b'data: {"choices":[{"text":"/","index":0,"logprobs":null,"finish_reason":null}],'
    b'"created":1,"model":"tiny","object":"text_completion","id":"chatcmpl-2k3s"}\n\n'
    b'data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],'
    b'"created":1,"model":"tiny","object":"text_completion","usage":{"completion_tokens":2,'
    b'"prompt_tokens":6,"total_tokens":8},"id":"chatcmpl-2k3s"}\n\n'
    b"data: [DONE]\n\n"
)


def _stream(a: Asked, hide: bool, data: bytes, step: int = 7) -> tuple[list[Any], UsageTracker]:
    t = UsageTracker(hide=hide, asked=a)
    out = b"".join(t.feed(data[i : i + step]) for i in range(0, len(data), step)) + t.finish()
    events = [e.removeprefix(b"data: ") for e in out.split(b"\n\n") if e]
    return [e if e == b"[DONE]" else orjson.loads(e) for e in events], t


@pytest.mark.feature("M13")
@pytest.mark.parametrize("hide", [False, True])
def test_a_completions_stream_gets_cmpl_ids_and_usage_where_openai_puts_it(hide: bool) -> None:
    a = _asked(COMPLETIONS, {"prompt": "hi", "stream": True})
    events, t = _stream(a, hide, LC_COMPLETION_STREAM)
    assert events[-1] == b"[DONE]"
    chunks = events[:-1]
    for c in chunks:
        conforms(c)
    assert t.usage == Usage(6, 2)
    # usage never rides on a chunk with choices; its own last chunk only when asked for
    assert all("usage" not in c for c in chunks if c["choices"])
    usage_chunks = [c for c in chunks if not c["choices"]]
    assert len(usage_chunks) == (0 if hide else 1)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "V/"


@pytest.mark.feature("M13")
def test_a_stream_with_echo_starts_with_the_prompt() -> None:
    a = _asked(COMPLETIONS, {"prompt": "hi ", "stream": True, "echo": True})
    events, _ = _stream(a, True, LC_COMPLETION_STREAM)
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == "hi V/"


def test_vllm_usage_null_is_dropped_when_the_client_did_not_ask() -> None:
    a = _asked(CHAT, {"messages": [], "stream": True})
    chunk = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null}],'
        b'"usage":null}\n\n'
    )
    events, _ = _stream(a, True, chunk)
    assert "usage" not in events[0]
    assert _stream(a, False, chunk)[0][0]["usage"] is None  # asked for: as sent


@pytest.mark.feature("M13")
def test_an_error_event_mid_stream_is_in_openai_shape() -> None:
    a = _asked(CHAT, {"messages": [], "stream": True})
    event = b'data: {"error":{"message":"CUDA error","type":"InternalServerError","code":500}}\n\n'
    events, _ = _stream(a, True, event)
    assert events[0] == {
        "error": {"message": "CUDA error", "type": "server_error", "param": None, "code": None}
    }


# --- issue 26: every answer names the model as it was called -------------------------

ENGINE_ID = "/data/models/tenant-c/secret.gguf"  # the engine's own name (a path)


def _called(path: str, body: dict[str, Any]) -> Asked:
    return _asked(path, {**body, "model": "shared-llm"})


def test_a_json_answer_names_the_model_as_called_parsed_or_not() -> None:
    vllm = VLLM_CHAT.replace(b'"model":"m"', b'"model":"%s"' % ENGINE_ID.encode())
    a = _called(CHAT, {"messages": []})
    assert not needs_parse(a, vllm)  # relayed unparsed: renamed on its bytes
    out = UsageTracker(hide=False, asked=a).answer(vllm)
    assert isinstance(out, bytes) and ENGINE_ID.encode() not in out
    assert orjson.loads(out) == {**orjson.loads(vllm), "model": "shared-llm"}
    # llama.cpp's answer is parsed (keys to add): renamed with the other fixes
    assert _answer(a, LC_CHAT)["model"] == "shared-llm"
    assembled = UsageTracker(hide=False, asked=a).assembled(orjson.loads(LC_CHAT))
    assert isinstance(assembled, bytes) and orjson.loads(assembled)["model"] == "shared-llm"
    assert _answer(_called(COMPLETIONS, {"prompt": "x"}), LC_COMPLETION_LIST)["model"] == (
        "shared-llm")
    # called by the engine's own name: the very bytes, not copied
    same = _asked(CHAT, {"messages": [], "model": "m"})
    assert UsageTracker(hide=False, asked=same).answer(VLLM_CHAT) is VLLM_CHAT


def test_an_embeddings_answer_is_renamed_without_scanning_its_vectors() -> None:
    a = _called(EMBEDDINGS, {"input": "x"})
    head = EMBEDDING  # vLLM, llama.cpp: the key before the vectors
    tail = orjson.dumps({  # OpenAI's order: after them
        "object": "list", "data": [{"object": "embedding", "index": 0,
                                    "embedding": [0.5] * 2000}],
        "model": ENGINE_ID, "usage": {"prompt_tokens": 1, "total_tokens": 1}})
    for data in (head, tail):
        assert not needs_parse(a, data)
        assert _answer(a, data)["model"] == "shared-llm"
    # parsed (base64 asked of an engine that answered floats): renamed too
    b64 = _called(EMBEDDINGS, {"input": "x", "encoding_format": "base64"})
    assert _answer(b64, EMBEDDING)["model"] == "shared-llm"


@pytest.mark.parametrize("hide", [False, True])
def test_every_stream_event_names_the_model_as_called(hide: bool) -> None:
    stream = LC_COMPLETION_STREAM.replace(b'"model":"tiny"', b'"model":"%s"' % ENGINE_ID.encode())
    events, _ = _stream(_called(COMPLETIONS, {"prompt": "hi", "stream": True}), hide, stream)
    chunks = events[:-1]
    assert chunks and all(c["model"] == "shared-llm" for c in chunks)
    # an engine that changes its spelling mid-stream is renamed all the same
    spaced = stream.replace(b'"model":"%s"' % ENGINE_ID.encode(), b'"model": "other"', 1)
    events, _ = _stream(_called(COMPLETIONS, {"prompt": "hi", "stream": True}), hide, spaced)
    assert all(c["model"] == "shared-llm" for c in events[:-1])


def test_rename_model_touches_only_string_values_of_model_keys() -> None:
    name = orjson.dumps("shared-llm")
    cases = {
        b'{"model": "a\\"b","x":{"model":null}}': b'{"model": "shared-llm","x":{"model":null}}',
        b'{"model":"a\\\\","y":"\\"model\\":"}': b'{"model":"shared-llm","y":"\\"model\\":"}',
        b'{"content":"model: x","model":"shared-llm"}': None,  # as called: the same bytes
        b'{"model":"unterminated': None,
    }
    for data, want in cases.items():
        out = rename_model(data, name)
        assert out == (data if want is None else want), data
        if want is None:
            assert out is data
    assert rename_model(b'{"model":"x"}', b"") == b'{"model":"x"}'  # no name: untouched
