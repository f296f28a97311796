"""One chat-template rule for every llama.cpp service (issue 33 item 6): a GGUF without
a template whose family has a known turn format gets it; a task's own choice wins."""

from __future__ import annotations

import pytest

from heteroflow.core.engines.chat_templates import (
    GEMMA_CHAT_TEMPLATE,
    chat_template_args,
    fallback_template,
)

GEMMA = {"general.architecture": "gemma3", "gemma3.context_length": 32768}


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_a_gemma_gguf_without_a_template_gets_gemmas_turn_format(arch: str) -> None:
    meta = {"general.architecture": arch}
    assert fallback_template(meta) == GEMMA_CHAT_TEMPLATE
    assert chat_template_args("llamacpp", ["-np", "2"], meta) == (
        "--chat-template",
        GEMMA_CHAT_TEMPLATE,
    )


@pytest.mark.parametrize(
    "meta",
    [
        GEMMA | {"tokenizer.chat_template": "{{ messages }}"},  # its own template
        GEMMA | {"tokenizer.chat_template.tool_use": "{{ tools }}"},
        {"general.architecture": "llama"},  # no known format: llama.cpp's ChatML stands
        {},
    ],
)
def test_nothing_is_added_where_the_model_says_or_no_format_is_known(
    meta: dict[str, object],
) -> None:
    assert chat_template_args("llamacpp", [], meta) == ()


@pytest.mark.parametrize(
    "args", [["--chat-template", "x"], ["--chat-template-file", "/t.jinja"], ["--chat-template=x"]]
)
def test_a_tasks_own_template_wins(args: list[str]) -> None:
    assert chat_template_args("llamacpp", args, GEMMA) == ()


def test_other_engines_and_unread_models_get_nothing() -> None:
    assert chat_template_args("vllm", [], GEMMA) == ()
    assert chat_template_args("llamacpp", [], None) == ()


def test_the_template_renders_gemmas_turns() -> None:
    jinja2 = pytest.importorskip("jinja2")
    text = jinja2.Template(GEMMA_CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}],
        add_generation_prompt=True,
    )
    assert text == (
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
