"""The "gui" next-state source: a GUI harness posts the screen after an agent's action.

For computer-use agents whose next state is a screen, not text (OpenClaw-RL's GUI track):
``POST /v1/next_states/gui`` with the action taken and the screen's accessibility tree after it::

    {"session_id": "s1", "turn": 3 | "last", "goal": "open the settings page",
     "action": {"type": "click", "target": "settings-link"},
     "tree": {"role": "window", "name": "App", "children": [
         {"id": "settings-link", "role": "link", "name": "Settings"}, ...]}}

or, from a harness that diffs itself, ``"diff": {"appeared": [{"role", "name"}], "disappeared":
[...], "changed": [{"role", "name", "value"}], "focused": {...}}`` instead of ``tree``.

A full tree is diffed here against the session's previous tree (kept, flattened, in a bounded
LRU of ``max_sessions``; the session's first tree has no diff; a posted diff drops the kept
tree, so the next tree is a first one again). One ``gui`` next state of that turn carries the
compact diff in ``detail.gui``: elements appeared / disappeared (role and name), changed
values, the focused element and whether the action filled it, the error dialog or alert that
appeared, and ``no_op`` when nothing changed. Its ``score`` is left to the judges
(``processors/gui.py`` scores the diff against the goal; the path rules penalise repeated
no-op actions). Trees are bounded here like every other input: bytes, nodes, depth and
string lengths (``GuiOptions``), 4xx beyond and nothing recorded.

Elements are matched by ``id`` when the tree gives one, else by role, name and their
occurrence among elements of that role and name. The kept trees are a replica's own: behind
replicas without sticky sessions, a harness should post its own diffs (a replica that never
saw the session's last tree records a first screen, one that saw an older tree a diff
spanning several actions).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from pipeline import __version__, events

from .errors import ApiError
from .protocol import validated
from .sessions import MAX_ID_CHARS
from .sources import GuiOptions, SourceRequest, session_turn

PRODUCER = events.Producer(component="gateway", version=__version__)
MAX_TURN = 2**31 - 1
ERROR_ROLES = ("alert", "alertdialog")  # a dialog is an error one when its name says so
ERROR_WORDS = ("error", "failed", "invalid", "denied", "not found")


class Element(BaseModel):
    """One element as a diff names it."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field(max_length=64)
    name: str = Field(default="", max_length=1000)
    value: str = Field(default="", max_length=1000)


class Focused(Element):
    filled: bool = False


class Action(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str = Field(min_length=1, max_length=32)  # click, type, key, scroll, ...
    target: str = Field(default="", max_length=MAX_ID_CHARS)  # the element acted on
    text: str = Field(default="", max_length=1000)  # typed text or key name

    @property
    def key(self) -> str:
        """What makes two actions "the same" for the repeated no-op rule."""
        return f"{self.type}:{self.target}:{self.text}"


class Diff(BaseModel):
    """A harness's own diff (limits as for a tree: bounded by the route's body size)."""

    model_config = ConfigDict(extra="forbid")

    appeared: list[Element] = Field(default_factory=list, max_length=1000)
    disappeared: list[Element] = Field(default_factory=list, max_length=1000)
    changed: list[Element] = Field(default_factory=list, max_length=1000)
    focused: Focused | None = None


class GuiPost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    turn: Annotated[int, Field(strict=True, ge=0, le=MAX_TURN)] | Literal["last"] = "last"
    goal: str = Field(default="", max_length=2000)
    action: Action
    tree: dict[str, Any] | None = None
    diff: Diff | None = None


# key -> (role, name, value); plus the focused key, "" for none
Flat = tuple[dict[str, tuple[str, str, str]], str]


def flatten(tree: Mapping[str, Any], options: GuiOptions) -> Flat:
    """The tree's elements by key, its focused element's key; a 400 naming the first limit
    crossed (iterative: no recursion a deep tree could exhaust)."""
    out: dict[str, tuple[str, str, str]] = {}
    seen: dict[tuple[str, str], int] = {}
    focused = ""
    nodes = 1  # seen so far, waiting ones included (counted, not keyed: an id may repeat)
    stack: list[tuple[Any, int, str]] = [(tree, 1, "tree")]
    while stack:
        node, depth, where = stack.pop()
        if not isinstance(node, Mapping):
            raise _bad(f"{where} must be an object", "tree")
        if depth > options.max_depth:
            raise _bad(
                f"the tree nests deeper than {options.max_depth} levels", "tree", "tree_too_deep"
            )
        role, name, value, nid = (
            _text(node, k, where, options) for k in ("role", "name", "value", "id")
        )
        n = seen.get((role, name), 0)
        seen[(role, name)] = n + 1
        key = f"#{nid}" if nid else f"{role}\0{name}\0{n}"
        out[key] = (role, name, value)
        if node.get("focused") is True:
            focused = key
        children = node.get("children", [])
        if not isinstance(children, list):
            raise _bad(f"{where}.children must be a list", "tree")
        nodes += len(children)
        if nodes > options.max_nodes:  # before any of them is stacked
            raise _bad(
                f"the tree has more than {options.max_nodes} nodes", "tree", "tree_too_large"
            )
        stack.extend(
            (c, depth + 1, f"{where}.children[{i}]") for i, c in reversed(list(enumerate(children)))
        )
    return out, focused


def _text(node: Mapping[str, Any], key: str, where: str, options: GuiOptions) -> str:
    value = node.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(f"{where}.{key} must be a string", "tree")
    if len(value) > options.max_string_chars:
        raise _bad(
            f"{where}.{key} is longer than {options.max_string_chars} characters",
            "tree",
            "text_too_long",
        )
    return value


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _element(e: tuple[str, str, str], *, value: bool = False) -> dict[str, str]:
    role, name, val = e
    return {"role": role, "name": name, **({"value": val} if value else {})}


def is_error(role: str, name: str) -> bool:
    """An alert, or a dialog whose name reports an error."""
    lowered = name.lower()
    return role in ERROR_ROLES or (role == "dialog" and any(w in lowered for w in ERROR_WORDS))


def diff_trees(before: Flat, after: Flat, listed: int) -> dict[str, Any]:
    """The compact diff of two flattened trees (each list cut at ``listed`` entries; the
    ``counts`` say how many there were)."""
    old, old_focus = before
    new, new_focus = after
    appeared = [new[k] for k in new if k not in old]
    disappeared = [old[k] for k in old if k not in new]
    changed = [new[k] for k in new if k in old and old[k] != new[k]]
    focused = None
    if new_focus:
        role, name, value = new[new_focus]
        was = old.get(new_focus, ("", "", ""))[2]
        focused = {
            "role": role,
            "name": name,
            "value": value,
            "filled": bool(value) and value != was,
        }
    return summarize(
        [_element(e) for e in appeared],
        [_element(e) for e in disappeared],
        [_element(e, value=True) for e in changed],
        focused,
        no_op=not (appeared or disappeared or changed) and new_focus == old_focus,
        listed=listed,
    )


def summarize(
    appeared: list[dict[str, str]],
    disappeared: list[dict[str, str]],
    changed: list[dict[str, str]],
    focused: dict[str, Any] | None,
    *,
    no_op: bool,
    listed: int,
) -> dict[str, Any]:
    error = next((e for e in appeared if is_error(e["role"], e["name"])), None)
    return {
        "appeared": appeared[:listed],
        "disappeared": disappeared[:listed],
        "changed": changed[:listed],
        "counts": {
            "appeared": len(appeared),
            "disappeared": len(disappeared),
            "changed": len(changed),
        },
        "focused": focused,
        "error": error,
        "no_op": no_op,
    }


def content_of(action: Action, gui: Mapping[str, Any]) -> str:
    """The diff as one line of text, for judges that read text (the LLM PRM)."""
    did = f"{action.type} {action.target}".strip()
    if gui.get("first"):
        return f"{did}: first screen of the session (no diff)"
    if gui["no_op"]:
        return f"{did}: nothing changed"
    parts = []
    for what in ("appeared", "disappeared", "changed"):
        items = gui[what]
        if items:
            shown = ", ".join(f"{e['role']} {e['name']!r}" for e in items[:10])
            more = gui["counts"][what] - min(len(items), 10)
            parts.append(f"{what}: {shown}" + (f" (+{more} more)" if more > 0 else ""))
    f = gui["focused"]
    if f:
        parts.append(f"focused: {f['role']} {f['name']!r}" + (" (filled)" if f["filled"] else ""))
    if gui["error"]:
        parts.append(f"error: {gui['error']['name']!r}")
    return f"{did}: " + "; ".join(parts)


class GuiSource:
    # The same action posted again with the same screen is the agent repeating itself (the
    # path rules penalise a repeated no-op), not a retry: recorded, within the turn's cap.
    repeats_count = True

    def __init__(self, options: GuiOptions) -> None:
        self.options = options
        self.trees: OrderedDict[str, Flat] = OrderedDict()  # session -> last tree, LRU

    def next_states(self, request: SourceRequest) -> list[Any]:
        post = validated(GuiPost, request.body)
        if (post.tree is None) == (post.diff is None):
            raise ApiError(
                400,
                "give either tree (the screen after the action) or diff",
                param="tree",
                code="invalid_value",
            )
        sid, turn = session_turn(request, post.session_id, post.turn)
        opts = self.options
        if post.tree is not None:
            size = len(orjson.dumps(post.tree))
            if size > opts.max_tree_bytes:
                raise _bad(
                    f"the tree takes {size} bytes, more than {opts.max_tree_bytes}",
                    "tree",
                    "tree_too_large",
                )
            flat = flatten(post.tree, opts)
            before = self.trees.pop(sid, None)
            self.trees[sid] = flat
            while len(self.trees) > opts.max_sessions:
                self.trees.popitem(last=False)
            if before is None:
                gui = {**summarize([], [], [], None, no_op=False, listed=0), "first": True}
            else:
                gui = diff_trees(before, flat, opts.max_listed)
        else:
            assert post.diff is not None
            self.trees.pop(sid, None)  # the next tree has nothing current to diff against
            d = post.diff
            gui = summarize(
                [e.model_dump(exclude={"value"}) for e in d.appeared],
                [e.model_dump(exclude={"value"}) for e in d.disappeared],
                [e.model_dump() for e in d.changed],
                None if d.focused is None else d.focused.model_dump(),
                no_op=not (
                    d.appeared
                    or d.disappeared
                    or d.changed
                    or (d.focused is not None and d.focused.filled)
                ),
                listed=opts.max_listed,
            )
        gui["action"] = post.action.model_dump()
        gui["action_key"] = post.action.key
        if post.goal:
            gui["goal"] = post.goal
        return [
            events.NextState(
                event_id=events.new_event_id(),
                producer=PRODUCER,
                session_id=sid,
                turn=turn,
                kind="gui",
                role="tool",
                content=content_of(post.action, gui)[: request.max_chars],
                source=opts.source,
                detail={"gui": gui, "key_id": request.key_id},
            )
        ]
