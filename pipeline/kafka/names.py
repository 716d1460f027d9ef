"""Topic names used in code; ``tests/test_topics.py`` checks them against ``topics/``."""

from __future__ import annotations

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
