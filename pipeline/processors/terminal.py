"""Terminal adapter: a tool message that reports a shell exit code, as (exit code, tails).

Agents hand shell results back in a few shapes; each is read here, conservatively, so that a
plain tool output that merely mentions a number ("1 failed") is never taken for an exit code:

- JSON with an exit-code key: ``{"exit_code": 1, "stdout": "...", "stderr": "..."}`` (also
  ``exitCode``, ``returncode``, ``return_code``, ``exit_status``), or Codex-style
  ``{"output": "...", "metadata": {"exit_code": 1}}``;
- text with a line of its own such as ``Exit code: 1``, ``exit status 2``,
  ``Process exited with code 1``, or a bracketed ``[exit 1]`` / ``[exit code: 1]``.

Pure functions: the pairing stage calls :func:`parse_tool_message` on each tool result, names
each result's command (from the turn's tool call), and turns the turn's next state into a
``terminal`` one with :func:`combined_exit_code`: results that verify nothing (exit 124, 126,
127; a read-only command such as ``ls`` or ``git status``) do not count in it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .verification import exit_vote

TAIL_CHARS = 2000
"""Kept of stdout and of stderr (their ends: where failures are reported)."""
MAX_PARSE_CHARS = 1_000_000
"""Longer tool output is not parsed as JSON (its exit-code line is still looked for)."""

_CODE_KEYS = ("exit_code", "exitCode", "returncode", "return_code", "exit_status")
_STDOUT_KEYS = ("stdout", "output")
_STDERR_KEYS = ("stderr",)
_CODE = r"(-?\d{1,9})"  # bounded: an event's integer must stay a 64-bit one
_LINE = re.compile(
    r"^[ \t]*(?:process[ \t]+)?(?:exit(?:ed)?[ \t_-]*(?:with[ \t]+)?(?:code|status)"
    r"|return[ \t_-]?code)[ \t]*[:=]?[ \t]*" + _CODE + r"[ \t]*\.?[ \t]*$",
    re.IGNORECASE | re.MULTILINE,
)
_BRACKET = re.compile(
    r"\[[ \t]*exit(?:[ \t_-]*code)?[ \t]*[:=]?[ \t]*" + _CODE + r"[ \t]*\]", re.IGNORECASE
)


@dataclass(frozen=True, slots=True)
class TerminalResult:
    """A shell result: its exit code and the ends of its output."""

    exit_code: int
    stdout_tail: str = ""
    stderr_tail: str = ""
    command: str | None = None  # the tool call's command, where the turn's calls name it

    @property
    def vote(self) -> int | None:
        """What it verifies (``verification.exit_vote``): None for exit 124/126/127 and for a
        read-only command."""
        return exit_vote(self.exit_code, self.command)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "exit_code": self.exit_code,
            "stdout_tail": self.stdout_tail,
            "stderr_tail": self.stderr_tail,
        }
        if self.command is not None:
            out["command"] = self.command
        if self.vote is None:
            out["no_outcome"] = True
        return out


def tail(text: str, limit: int = TAIL_CHARS) -> str:
    """The last ``limit`` characters, marked when cut."""
    return text if len(text) <= limit else "…" + text[len(text) - limit + 1 :]


def parse_tool_message(msg: Mapping[str, Any], limit: int = TAIL_CHARS) -> TerminalResult | None:
    """The terminal result a ``tool`` (or legacy ``function``) message carries, else None."""
    if msg.get("role") not in ("tool", "function"):
        return None
    return parse_content(msg.get("content"), limit)


def parse_content(content: Any, limit: int = TAIL_CHARS) -> TerminalResult | None:
    """Exit code and tails from a message content (str, parts list, or a JSON object)."""
    if isinstance(content, Mapping):
        return _from_json(content, limit)
    text = _text(content)
    stripped = text.strip()
    if stripped.startswith("{") and len(stripped) <= MAX_PARSE_CHARS:
        try:
            doc = json.loads(stripped)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            found = _from_json(doc, limit)
            if found is not None:
                return found
    return _from_text(text, limit)


def combined_exit_code(results: Iterable[TerminalResult]) -> int | None:
    """One code for a turn's results: the first failure, else 0; None when no result says
    anything (none at all, or each timed out (124), could not run (126, 127) or ran a
    read-only command: see :mod:`verification`)."""
    codes = [r.exit_code for r in results if r.vote is not None]
    if not codes:
        return None
    return next((c for c in codes if c != 0), 0)


def _from_json(doc: Mapping[str, Any], limit: int) -> TerminalResult | None:
    code = _code_in(doc)
    meta = doc.get("metadata")
    if code is None and isinstance(meta, Mapping):
        code = _code_in(meta)
    if code is None:
        return None
    stdout = next((_text(doc[k]) for k in _STDOUT_KEYS if k in doc), "")
    stderr = next((_text(doc[k]) for k in _STDERR_KEYS if k in doc), "")
    return TerminalResult(code, tail(stdout, limit), tail(stderr, limit))


def _code_in(doc: Mapping[str, Any]) -> int | None:
    for key in _CODE_KEYS:
        value = doc.get(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and -(2**31) <= value < 2**32:
            return value
        if isinstance(value, str) and re.fullmatch(_CODE, value.strip()):
            return int(value)
    return None


def _from_text(text: str, limit: int) -> TerminalResult | None:
    matches = list(_LINE.finditer(text)) + list(_BRACKET.finditer(text))
    if not matches:
        return None
    last = max(matches, key=lambda m: m.start())  # the final report wins
    rest = text[: last.start()] + text[last.end() :]
    return TerminalResult(int(last.group(1)), tail(rest.strip("\n"), limit), "")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return json.dumps(content, ensure_ascii=False) if isinstance(content, dict) else str(content)
