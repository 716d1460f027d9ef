"""Messages in a shape any chat template renders: content parts, null content, tool calls,
tools and the developer role, for templates that do and do not handle each."""

from __future__ import annotations

import json

import pytest

from pipeline.serving.chat import flatten_content, for_template
from pipeline.serving.errors import ApiError

SMOL = "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'}}"
RICH = "{% if tools %}{{ tools }}{% endif %}{{ message.tool_calls }}{{ 'developer' }}"
TOOL = {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}


def test_text_parts_are_joined_and_null_becomes_empty() -> None:
    msgs, tools = for_template(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ],
        None,
        SMOL,
    )
    assert [m["content"] for m in msgs] == ["a\nb", ""]
    assert tools is None


def test_non_text_parts_are_a_400_naming_the_part() -> None:
    with pytest.raises(ApiError) as err:
        flatten_content(
            [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:"}}], 3
        )
    assert err.value.status == 400
    assert err.value.param == "messages[3].content[1]"
    assert "image_url" in str(err.value)


def test_what_a_template_ignores_is_written_out() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "shell", "arguments": '{"cmd": "ls"}'},
    }
    msgs, tools = for_template(
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ],
        [TOOL],
        SMOL,
    )
    assert tools is None
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("be brief\n\n")
    assert json.dumps(TOOL) in msgs[0]["content"]
    expected = '<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>'
    assert msgs[2]["content"] == expected
    assert "tool_calls" not in msgs[2]


def test_a_template_that_knows_tools_gets_them_unchanged() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}
    original = [
        {"role": "developer", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    msgs, tools = for_template(original, [TOOL], RICH)
    assert tools == [TOOL]
    assert msgs[0]["role"] == "developer"
    assert msgs[1]["tool_calls"] == [call] and msgs[1]["content"] == ""
