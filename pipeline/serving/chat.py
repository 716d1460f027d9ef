"""Prompt rendering, tool-call parsing and what part of a growing answer is safe to stream."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from .errors import ApiError

TOOL_OPEN = "<tool_call>"
_TOOL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list | None,
    encode: Callable[[str], list[int]] | None = None,
) -> list[int]:
    """Token ids of the prompt, rendered once by the model's own chat template; ``encode``
    (default: the tokenizer, no special tokens added) turns the rendered text into ids."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    messages, tools = for_template(messages, tools, template)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # jinja errors from odd but schema-valid messages
        raise ApiError(
            400, f"messages cannot be rendered by the chat template: {exc}", param="messages"
        ) from None
    if encode is not None:
        return encode(text)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def for_template(
    messages: list[dict[str, Any]], tools: list | None, template: str
) -> tuple[list[dict[str, Any]], list | None]:
    """Messages in the shape any chat template can render.

    Many templates (SmolLM2's among them) concatenate ``content`` as a string, while OpenAI
    clients may send an array of text parts or ``null`` next to ``tool_calls``. Text parts are
    joined, other parts are refused (this is a text model), and what a template ignores
    (tool calls, the tool list, the ``developer`` role) is written out as Hermes-style text,
    so the model still sees it and answers in the format :func:`parse_tool_calls` reads."""
    knows_calls = "tool_calls" in template
    knows_tools = "tools" in template
    knows_developer = "developer" in template
    out = []
    for i, m in enumerate(messages):
        msg = dict(m)
        msg["content"] = flatten_content(msg.get("content"), i)
        if msg["role"] == "developer" and not knows_developer:
            msg["role"] = "system"
        if msg.get("tool_calls") and not knows_calls:
            calls = "".join(
                f"\n{TOOL_OPEN}{json.dumps(_call_doc(c), ensure_ascii=False)}</tool_call>"
                for c in msg.pop("tool_calls")
            )
            msg["content"] = (msg["content"] + calls).lstrip("\n")
        out.append(msg)
    if tools and not knows_tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        note = (
            "You can call these tools. To call one, answer with "
            f'{TOOL_OPEN}{{"name": ..., "arguments": {{...}}}}</tool_call>.\n'
            f"<tools>\n{listing}\n</tools>"
        )
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
        tools = None
    return out, tools


def flatten_content(content: Any, index: int) -> str:
    """A message's content as one string: text parts joined by newlines, ``null`` as ''."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"content part of type {kind!r} is not supported: this model reads text only "
                "(send parts of type 'text')",
                param=f"messages[{index}].content[{j}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _call_doc(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    args: Any = fn.get("arguments", {})
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    return {"name": fn.get("name"), "arguments": args}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split an answer into content and OpenAI ``tool_calls``.

    Understands Hermes/Qwen ``<tool_call>{"name": …, "arguments": …}</tool_call>`` and the tiny
    model's ``<tool_call>name {json}</tool_call>``. Unparseable blocks stay in the content.
    """
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        call = _parse_one(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    rest = _TOOL_RE.sub(take, text).strip()
    if not calls:
        return text, []
    return (rest or None), calls


def _parse_one(body: str) -> dict[str, Any] | None:
    name: Any
    try:
        doc = json.loads(body)
        name, args = doc["name"], doc.get("arguments", {})
    except (ValueError, KeyError, TypeError):
        name, _, raw = body.partition(" ")
        try:
            args = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return None
    if not isinstance(name, str) or not name:
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": name,
            "arguments": args if isinstance(args, str) else json.dumps(args),
        },
    }


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Text before the earliest stop sequence, and whether one was found."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def streamable(text: str, stop: list[str], tools: bool) -> str:
    """The prefix of a still-growing answer that no later token can retract: held back are an
    unfinished UTF-8 character, a possible start of a stop sequence and, with tools, anything
    from a tool-call marker on (it leaves as ``tool_calls`` at the end)."""
    text = text.rstrip("\ufffd")
    text, _ = cut_at_stop(text, stop)
    guards = list(stop) + ([TOOL_OPEN] if tools else [])
    if tools and (i := text.find(TOOL_OPEN)) >= 0:
        text = text[:i]
    hold = 0
    for g in guards:
        for k in range(min(len(g) - 1, len(text)), 0, -1):
            if text.endswith(g[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]
