"""OpenAI's request shapes at the gateway (``heteroflow.gateway.shaping.requests``): each bad body
gives OpenAI's 400 naming the field, every good body (engine extras included) passes, and
no JSON body whatever makes the check raise."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heteroflow.gateway.shaping.requests import check

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def msg(**fields: Any) -> dict[str, Any]:
    """A chat body whose one message is ``fields``."""
    return {"model": "m", "messages": [fields]}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Once upon a time", **fields}


def embedding(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "some text", **fields}


def _without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


# (path, body, param, code)
BAD: list[tuple[str, dict[str, Any], str, str | None]] = [
    # the three required keys
    (CHAT, _without(chat(), "messages"), "messages", "missing_required_parameter"),
    (CHAT, chat(messages=[]), "messages", "empty_array"),
    (CHAT, chat(messages=None), "messages", "invalid_type"),
    (CHAT, chat(messages="hi"), "messages", "invalid_type"),
    (COMPLETIONS, _without(completion(), "prompt"), "prompt", "missing_required_parameter"),
    (EMBEDDINGS, _without(embedding(), "input"), "input", "missing_required_parameter"),
    # numbers: types and ranges (a boolean is no number)
    (CHAT, chat(temperature="0.7"), "temperature", "invalid_type"),
    (CHAT, chat(temperature=True), "temperature", "invalid_type"),
    (CHAT, chat(temperature=3), "temperature", "decimal_above_max_value"),
    (CHAT, chat(temperature=-0.1), "temperature", "decimal_below_min_value"),
    (CHAT, chat(top_p=1.5), "top_p", "decimal_above_max_value"),
    (CHAT, chat(presence_penalty=-2.5), "presence_penalty", "decimal_below_min_value"),
    (CHAT, chat(frequency_penalty=2.01), "frequency_penalty", "decimal_above_max_value"),
    (CHAT, chat(n=0), "n", "integer_below_min_value"),
    (CHAT, chat(n=1.0), "n", "invalid_type"),
    (CHAT, chat(n=129), "n", "integer_above_max_value"),
    (CHAT, chat(max_tokens=0), "max_tokens", "integer_below_min_value"),
    (CHAT, chat(max_tokens=10.5), "max_tokens", "invalid_type"),
    (CHAT, chat(max_tokens=False), "max_tokens", "invalid_type"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens", "integer_below_min_value"),
    (CHAT, chat(seed="42"), "seed", "invalid_type"),
    (CHAT, chat(logprobs=1), "logprobs", "invalid_type"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "integer_above_max_value"),
    (CHAT, chat(top_logprobs=3), "top_logprobs", None),
    (CHAT, chat(logit_bias={"50256": 101}), "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias={"hello": 1}), "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias={"50256": "1"}), "logit_bias", "invalid_type"),
    (CHAT, chat(logit_bias=[1, 2]), "logit_bias", "invalid_type"),
    # stop, stream, stream_options
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop", "array_above_max_length"),
    (CHAT, chat(stop=["a", 1]), "stop[1]", "invalid_type"),
    (CHAT, chat(stop=7), "stop", "invalid_type"),
    (CHAT, chat(stream="true"), "stream", "invalid_type"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options", None),
    (CHAT, chat(stream=False, stream_options={"include_usage": True}), "stream_options", None),
    (CHAT, chat(stream=True, stream_options=True), "stream_options", "invalid_type"),
    (CHAT, chat(stream=True, stream_options={"include_usage": 1}),
     "stream_options.include_usage", "invalid_type"),
    # messages, per role
    (CHAT, chat(messages=["hi"]), "messages[0]", "invalid_type"),
    (CHAT, msg(content="hi"), "messages[0].role", "missing_required_parameter"),
    (CHAT, msg(role="human", content="hi"), "messages[0].role", "invalid_value"),
    (CHAT, msg(role=1, content="hi"), "messages[0].role", "invalid_type"),
    (CHAT, msg(role="user"), "messages[0].content", "missing_required_parameter"),
    (CHAT, msg(role="user", content=None), "messages[0].content", "invalid_type"),
    (CHAT, msg(role="user", content=5), "messages[0].content", "invalid_type"),
    (CHAT, msg(role="user", content={"type": "text", "text": "hi"}),
     "messages[0].content", "invalid_type"),
    (CHAT, msg(role="user", content=[]), "messages[0].content", "empty_array"),
    (CHAT, msg(role="user", content="hi", name=3), "messages[0].name", "invalid_type"),
    (CHAT, chat(messages=[USER, {"role": "system", "content": 1}]),
     "messages[1].content", "invalid_type"),
    (CHAT, msg(role="user", content=["hi"]), "messages[0].content[0]", "invalid_type"),
    (CHAT, msg(role="user", content=[{"text": "hi"}]),
     "messages[0].content[0].type", "missing_required_parameter"),
    (CHAT, msg(role="user", content=[{"type": "input_text", "text": "hi"}]),
     "messages[0].content[0].type", "invalid_value"),
    (CHAT, msg(role="user", content=[{"type": "text"}]),
     "messages[0].content[0].text", "missing_required_parameter"),
    (CHAT, msg(role="user", content=[{"type": "image_url", "image_url": "http://x/y.png"}]),
     "messages[0].content[0].image_url", "invalid_type"),
    (CHAT, msg(role="user", content=[{"type": "image_url", "image_url": {}}]),
     "messages[0].content[0].image_url.url", "missing_required_parameter"),
    (CHAT, msg(role="user", content=[
        {"type": "image_url", "image_url": {"url": "http://x/y.png", "detail": "max"}}]),
     "messages[0].content[0].image_url.detail", "invalid_value"),
    (CHAT, msg(role="user", content=[
        {"type": "input_audio", "input_audio": {"data": "AAA", "format": "ogg"}}]),
     "messages[0].content[0].input_audio.format", "invalid_value"),
    (CHAT, msg(role="user", content=[{"type": "file", "file": {"file_id": 7}}]),
     "messages[0].content[0].file.file_id", "invalid_type"),
    (CHAT, msg(role="system", content=[{"type": "image_url", "image_url": {"url": "u"}}]),
     "messages[0].content[0].type", "invalid_value"),
    (CHAT, msg(role="tool", content="72F"), "messages[0].tool_call_id",
     "missing_required_parameter"),
    (CHAT, msg(role="tool", content="72F", tool_call_id=1), "messages[0].tool_call_id",
     "invalid_type"),
    (CHAT, msg(role="function", content="x"), "messages[0].name", "missing_required_parameter"),
    (CHAT, msg(role="assistant"), "messages[0].content", None),
    (CHAT, msg(role="assistant", content=None), "messages[0].content", None),
    (CHAT, msg(role="assistant", tool_calls=[]), "messages[0].tool_calls", "empty_array"),
    (CHAT, msg(role="assistant", tool_calls=[{**CALL, "type": "custom"}]),
     "messages[0].tool_calls[0].type", "invalid_value"),
    (CHAT, msg(role="assistant", tool_calls=[_without(CALL, "id")]),
     "messages[0].tool_calls[0].id", "missing_required_parameter"),
    (CHAT, msg(role="assistant", tool_calls=[
        {**CALL, "function": {"name": "f", "arguments": {"a": 1}}}]),
     "messages[0].tool_calls[0].function.arguments", "invalid_type"),
    (CHAT, msg(role="assistant", content=[{"type": "image_url", "image_url": {"url": "u"}}]),
     "messages[0].content[0].type", "invalid_value"),
    # tools and tool_choice
    (CHAT, chat(tools=[]), "tools", "empty_array"),
    (CHAT, chat(tools=TOOL), "tools", "invalid_type"),
    (CHAT, chat(tools=[TOOL] * 129), "tools", "array_above_max_length"),
    (CHAT, chat(tools=[{**TOOL, "type": "retrieval"}]), "tools[0].type", "invalid_value"),
    (CHAT, chat(tools=[{**TOOL, "type": "custom"}]), "tools[0].type", "invalid_value"),
    (CHAT, chat(tools=[_without(TOOL, "type")]), "tools[0].type", "missing_required_parameter"),
    (CHAT, chat(tools=[{"type": "function"}]), "tools[0].function",
     "missing_required_parameter"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
     "tools[0].function.name", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f" * 65}}]),
     "tools[0].function.name", "invalid_value"),
    (CHAT, chat(tools=[TOOL, {"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools[1].function.parameters", "invalid_type"),
    (CHAT, chat(tool_choice="any", tools=[TOOL]), "tool_choice", "invalid_value"),
    (CHAT, chat(tool_choice=1, tools=[TOOL]), "tool_choice", "invalid_type"),
    (CHAT, chat(tool_choice="required"), "tool_choice", None),
    (CHAT, chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     "tool_choice", None),
    (CHAT, chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "other"}}),
     "tool_choice", None),
    (CHAT, chat(tools=[TOOL], tool_choice={"type": "function"}), "tool_choice.function",
     "missing_required_parameter"),
    (CHAT, chat(tools=[TOOL], tool_choice={"type": "allowed_tools", "allowed_tools": {}}),
     "tool_choice.type", "invalid_value"),
    (CHAT, chat(parallel_tool_calls="yes"), "parallel_tool_calls", "invalid_type"),
    # response_format, reasoning_effort
    (CHAT, chat(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
    (CHAT, chat(response_format="json_object"), "response_format", "invalid_type"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema",
     "missing_required_parameter"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     "response_format.json_schema.name", "missing_required_parameter"),
    (CHAT, chat(reasoning_effort="extreme"), "reasoning_effort", "invalid_value"),
    (CHAT, chat(user=123), "user", "invalid_type"),
    # legacy completions
    (COMPLETIONS, completion(prompt=None), "prompt", "invalid_type"),
    (COMPLETIONS, completion(prompt=[]), "prompt", "empty_array"),
    (COMPLETIONS, completion(prompt=["a", 1]), "prompt[1]", "invalid_type"),
    (COMPLETIONS, completion(prompt=[[1, 2], []]), "prompt[1]", "empty_array"),
    (COMPLETIONS, completion(prompt={"text": "x"}), "prompt", "invalid_type"),
    (COMPLETIONS, completion(max_tokens=-1), "max_tokens", "integer_below_min_value"),
    (COMPLETIONS, completion(logprobs=True), "logprobs", "invalid_type"),
    (COMPLETIONS, completion(logprobs=6), "logprobs", "integer_above_max_value"),
    (COMPLETIONS, completion(echo="yes"), "echo", "invalid_type"),
    (COMPLETIONS, completion(temperature=2.5), "temperature", "decimal_above_max_value"),
    (COMPLETIONS, completion(stream_options={"include_usage": True}), "stream_options", None),
    # embeddings
    (EMBEDDINGS, embedding(input=[]), "input", "empty_array"),
    (EMBEDDINGS, embedding(input=""), "input", "empty_string"),
    (EMBEDDINGS, embedding(input=["a", ""]), "input[1]", "empty_string"),
    (EMBEDDINGS, embedding(input=None), "input", "invalid_type"),
    (EMBEDDINGS, embedding(input=5), "input", "invalid_type"),
    (EMBEDDINGS, embedding(input=[1, "a"]), "input[1]", "invalid_type"),
    (EMBEDDINGS, embedding(input=[[1, 2], [3, True]]), "input[1][1]", "invalid_type"),
    (EMBEDDINGS, embedding(input=["x"] * 2049), "input", "array_above_max_length"),
    (EMBEDDINGS, embedding(encoding_format="int8"), "encoding_format", "invalid_value"),
    (EMBEDDINGS, embedding(dimensions=0), "dimensions", "integer_below_min_value"),
    (EMBEDDINGS, embedding(dimensions="256"), "dimensions", "invalid_type"),
]


@pytest.mark.feature("M13")
@pytest.mark.parametrize(("path", "body", "param", "code"), BAD, ids=lambda x: None)
def test_a_bad_body_gets_openais_400_naming_the_field(
    path: str, body: dict[str, Any], param: str, code: str | None
) -> None:
    err = check(path, body)
    assert err is not None
    assert (err.status, err.type, err.param, err.code) == (
        400, "invalid_request_error", param, code
    )
    # OpenAI names the field in the message, except in its "Invalid value: 'x'. Supported
    # values are: ..." (the param says where) and in its stream_options wording.
    named = f"'{param}'" in err.message
    assert named or err.message.startswith("Invalid value: '") or param == "stream_options"


GOOD: list[tuple[str, dict[str, Any]]] = [
    (CHAT, chat()),
    (CHAT, chat(temperature=0, top_p=1, n=1, max_tokens=1, presence_penalty=-2,
                frequency_penalty=2.0, seed=-5, stop="\n", user="u", store=False)),
    (CHAT, chat(temperature=2, top_p=0.0, stop=["a", "b", "c", "d"], logit_bias={"50256": -100})),
    # null means "OpenAI's default" wherever a key is optional
    (CHAT, chat(temperature=None, max_tokens=None, stop=None, tools=None, tool_choice=None,
                stream=None, stream_options=None, response_format=None, logprobs=None)),
    (CHAT, chat(stream=True, stream_options={"include_usage": True})),
    (CHAT, chat(logprobs=True, top_logprobs=0)),
    (CHAT, chat(logprobs=False)),
    # engine parameters OpenAI does not define pass through untouched
    (CHAT, chat(top_k=40, min_p=0.05, repeat_penalty=1.1, mirostat="x",
                chat_template_kwargs={"enable_thinking": False}, guided_json={"type": "object"},
                cache_prompt=True, n_probs=3, temperature_last=True)),
    (CHAT, {"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "sys"}], "name": "s"},
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA",
                                                "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
            {"type": "file", "file": {"file_data": "AAA", "filename": "a.pdf"}},
            {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "72F"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "assistant", "content": "", "tool_calls": [CALL], "refusal": None},
        {"role": "function", "name": "f", "content": None},
        {"role": "user", "content": "thanks", "extra_engine_key": 1},
    ]}),
    (CHAT, chat(tools=[TOOL, {"type": "function", "function": {"name": "a-b_c", "strict": True,
                                                                "description": "d"}}],
                tool_choice="required", parallel_tool_calls=False)),
    (CHAT, chat(tools=[TOOL], tool_choice={"type": "function",
                                           "function": {"name": "get_weather"}})),
    (CHAT, chat(tool_choice="none")),
    (CHAT, chat(tool_choice="auto")),
    (CHAT, chat(response_format={"type": "json_object", "schema": {"type": "object"}})),
    (CHAT, chat(response_format={"type": "text"})),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object"}, "strict": True}})),
    (CHAT, chat(reasoning_effort="low", max_completion_tokens=5, metadata={"k": "v"})),
    (CHAT, chat(functions=[{"name": "f", "parameters": {}}], function_call={"name": "f"})),
    (COMPLETIONS, completion()),
    (COMPLETIONS, completion(prompt="")),
    (COMPLETIONS, completion(prompt=["a", "b"], max_tokens=0, echo=True, logprobs=0)),
    (COMPLETIONS, completion(prompt=[1, 2, 3], best_of=2, n=2, suffix="end")),
    (COMPLETIONS, completion(prompt=[[1, 2], [3]], stream=True,
                             stream_options={"include_usage": True})),
    (COMPLETIONS, completion(top_k=10, grammar="root ::= x")),
    (EMBEDDINGS, embedding()),
    (EMBEDDINGS, embedding(input=["a", "b"], encoding_format="base64", dimensions=256)),
    (EMBEDDINGS, embedding(input=[1, 2, 3], encoding_format=None, truncate_prompt_tokens=8)),
    (EMBEDDINGS, embedding(input=[[1, 2], [3]], user="u")),
    (EMBEDDINGS, embedding(input=["x"] * 2048)),
    # a path without a shape here (e.g. /v1/responses, translated first) is not checked
    ("/v1/responses", {"model": "m", "input": []}),
]


@pytest.mark.feature("M13")
@pytest.mark.parametrize(("path", "body"), GOOD, ids=lambda x: None)
def test_a_good_body_passes(path: str, body: dict[str, Any]) -> None:
    assert check(path, body) is None


@pytest.mark.feature("M13")
def test_the_messages_follow_openais_wording() -> None:
    cases = [
        (chat(temperature="hot"),
         "Invalid type for 'temperature': expected a decimal, but got a string instead."),
        (chat(temperature=3),
         "Invalid 'temperature': decimal above maximum value. "
         "Expected a value <= 2, but got 3 instead."),
        (chat(messages=[]),
         "Invalid 'messages': empty array. Expected an array with minimum length 1, "
         "but got an empty array instead."),
        (chat(max_tokens=1.5),
         "Invalid type for 'max_tokens': expected an integer, but got a decimal number instead."),
        (msg(role="bot", content="x"),
         "Invalid value: 'bot'. Supported values are: 'system', 'user', 'assistant', 'tool', "
         "'function', and 'developer'."),
        (msg(role="user"), "Missing required parameter: 'messages[0].content'."),
        (chat(stream_options={"include_usage": True}),
         "The 'stream_options' parameter is only allowed when 'stream' is enabled."),
        (chat(tool_choice="required"),
         "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
         "specified."),
    ]
    for body, message in cases:
        err = check(CHAT, body)
        assert err is not None and err.message == message
    err = check(EMBEDDINGS, embedding(encoding_format="int8"))
    assert err is not None
    assert err.message == "Invalid value: 'int8'. Supported values are: 'float' and 'base64'."


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=6,
)


def _paths(node: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value (dict keys and list indexes), the value's own too."""
    items = node.items() if type(node) is dict else enumerate(node) if type(node) is list else ()
    return [here] + [p for k, v in items for p in _paths(v, (*here, k))]


def _replaced(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    if not path:
        return body
    head, rest = path[0], path[1:]
    copy: Any = dict(body) if type(body) is dict else list(body)
    copy[head] = _replaced(copy[head], rest, value) if rest else value
    return copy  # type: ignore[no-any-return]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_no_json_body_makes_the_check_raise(data: st.DataObject) -> None:
    # A good body with any one value anywhere in it swapped for any JSON value: the answer
    # is "pass" or a 400 naming a field, never an exception (the gateway's 500).
    path, body = data.draw(st.sampled_from(GOOD[:-1]))
    where = data.draw(st.sampled_from(_paths(body)[1:]))
    err = check(path, _replaced(body, where, data.draw(_JSON)))
    assert err is None or (err.status == 400 and err.param)


@settings(max_examples=50, deadline=None)
@given(extra=st.dictionaries(st.text(max_size=10).map(lambda k: f"x_{k}"), _JSON, max_size=4))
def test_unknown_keys_never_change_the_verdict(extra: dict[str, Any]) -> None:
    assert check(CHAT, {**extra, **chat(temperature=0.5)}) is None
    err = check(CHAT, {**extra, **chat(temperature=5)})
    assert err is not None and err.param == "temperature"
