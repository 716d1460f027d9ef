"""Topic names used in code; ``tests/test_topics.py`` checks them against ``topics/``."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from pipeline.contracts import contracts_dir

INTERACTIONS = "liverl.interactions.v1"
NEXT_STATES = "liverl.next_states.v1"
PRM_SCORES = "liverl.prm_scores.v1"
HINTS = "liverl.hints.v1"
PATH_PENALTIES = "liverl.path_penalties.v1"
REWARDS = "liverl.rewards.v1"
SAMPLES = "liverl.samples.v1"
GRADIENT_STEPS = "liverl.gradient_steps.v1"
WEIGHTS = "liverl.weights.v1"
SERVING_STATUS = "liverl.serving_status.v1"
TRAINER_STATUS = "liverl.trainer_status.v1"
GATE_VOTES = "liverl.gate_votes.v1"
JUDGE_CONSISTENCY = "liverl.judge_consistency.v1"
TASKS = "liverl.tasks.v1"
DLQ = "liverl.dlq.v1"

# Every topic the project declares: derived from topics/*.yaml (their ``name:``), so a new topic
# is its YAML, its schema and its dataclass; a constant above is only for code that names it
# (tests/test_topics.py checks each constant against the files).
SPECS_DIR = contracts_dir("topics")


def _declared(specs_dir: Path = SPECS_DIR) -> tuple[str, ...]:
    import yaml

    return tuple(sorted(yaml.safe_load(p.read_text())["name"] for p in specs_dir.glob("*.yaml")))


ALL = _declared()

_VERSIONED = re.compile(r"^liverl\.([A-Za-z0-9_-]+)\.v([0-9]+)$")


def short_name(topic: str) -> str:
    """``liverl.interactions.v1`` -> ``interactions`` (a v2 -> ``interactions_v2``); other
    names, short ones included, are kept as they are. The one short form: what the command
    line accepts for a topic and what the archive names its table."""
    m = _VERSIONED.match(topic)
    if m is None:
        return topic
    return m[1] if m[2] == "1" else f"{m[1]}_v{m[2]}"


def resolve_topics(
    values: Iterable[str], known: Sequence[str] = ALL, *, others: bool = False
) -> list[str]:
    """``--topics`` values (repeatable, comma-separated, full or short names) to topic names
    of ``known``, in the order given, each once; none given: all of ``known``. With
    ``others``, a dotted or dashed name outside ``known`` (a test's or a namespace's topic)
    is passed on for the broker to confirm; otherwise an unknown name is an error."""
    from pipeline.kafka.errors import TopicNameError

    given = list(values)
    if not given:
        return list(known)
    out: list[str] = []
    for value in given:
        for name in (part.strip() for part in value.split(",")):
            if not name:
                raise TopicNameError(f"empty topic name in --topics {value!r}")
            matches = [t for t in known if name in (t, short_name(t))]
            if matches:
                out.append(matches[0])
            elif others and ("." in name or "-" in name):
                out.append(name)
            else:
                listed = ", ".join(short_name(t) for t in known)
                raise TopicNameError(f"unknown topic {name!r}; known topics: {listed}")
    return list(dict.fromkeys(out))


# ---- namespaces: a second pipeline on the same cluster (docs/architecture.md#replay-and-
# namespaces). Every topic and consumer group of namespace N is the live name behind one
# prefix, ``replay.N.``, so the whole namespace is one prefix to list, ACL or delete.

NAMESPACE_PREFIX = "replay."
# No dots: the prefix must split back unambiguously into (namespace, live name).
NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"


def prefix(namespace: str) -> str:
    """``replay.NAME.``: what every topic and group id of the namespace starts with."""
    return f"{NAMESPACE_PREFIX}{namespace}."


def resolve(name: str, namespace: str | None) -> str:
    """The topic (or group id) ``name`` as seen from ``namespace``; None is live, unchanged.

    Idempotent (a name already in the namespace is returned as is), so a component may pass
    resolved names to a client that resolves again."""
    if not namespace:
        return name
    p = prefix(namespace)
    return name if name.startswith(p) else p + name


def live(name: str, namespace: str | None) -> str:
    """The inverse of :func:`resolve`: the live name of a namespaced topic or group."""
    if namespace:
        p = prefix(namespace)
        if name.startswith(p):
            return name[len(p) :]
    return name


def namespace_of(name: str) -> str | None:
    """The namespace a topic or group id belongs to (None: live)."""
    if not name.startswith(NAMESPACE_PREFIX):
        return None
    rest = name[len(NAMESPACE_PREFIX) :]
    ns, dot, _ = rest.partition(".")
    return ns if dot and ns else None
