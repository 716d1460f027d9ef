"""Processor settings: ``LIVERL_PROCESSORS_*`` environment variables over defaults.

The ``[processors]`` section of ``pipeline.settings.Settings``; the Kafka location comes from
``Settings`` too.
"""

from __future__ import annotations

import shlex
import socket
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_RULES = Path(__file__).with_name("rules") / "default.yaml"


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (None: it can, right now)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            sock.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


JUDGE_AGENT_HINT_WAIT_S = 1.0  # hint_wait_s default with a judge agent (LLM)


class ProcessorSettings(BaseSettings):
    """Everything the reward workers need besides the cluster address."""

    model_config = SettingsConfigDict(env_prefix="LIVERL_PROCESSORS_", extra="ignore")

    app_id: str = "liverl-rewards"
    # Faust's web server: liverl needs it for nothing but the workers' /metrics (inputs left
    # out, dead letters), and Faust's own views (/router/: every changelog's partition
    # assignment) answer without authentication: off unless asked for, and on loopback.
    web_enabled: bool = False
    web_host: str = Field(default="127.0.0.1", min_length=1)
    # 0: a free port picked at start (each worker process, and a replay namespace's workers
    # beside the live ones, gets its own); a port in use is a one-line error, never a traceback.
    web_port: int = Field(default=0, ge=0, le=65535)
    # None: the partition count of the session-keyed topics in topics/ (co-partitioning);
    # set it only for a cluster whose topics were created with another count.
    partitions: int | None = Field(default=None, ge=1)
    # Consumer-group session timeout: how long a restarted worker waits for its killed
    # predecessor's partitions (Faust's default is 60 s).
    session_timeout_s: float = Field(default=20.0, ge=2.0, le=90.0)
    # Only sessions whose id starts with this are processed (tenancy, tests); empty = all.
    session_prefix: str = ""
    # Where a new consumer group starts: "earliest" (default: replay everything retained) or
    # "latest" (benchmarks, or a fresh deployment that should ignore history).
    auto_offset_reset: str = Field(default="earliest", pattern="^(earliest|latest)$")
    # How long the worker's producer waits to fill a batch: every record it writes (derived
    # events, changelogs) waits up to this long, and in exchange a busy worker sends fewer,
    # fuller produce requests (bench/rewards.py: 20-50 ms took 8-14 % less worker CPU than
    # 5 ms). It adds to the latency from an interaction to its sample.
    produce_linger_ms: float = Field(default=20.0, ge=0.0, le=1000.0)
    # Exactly once (processors/transactions.py): each worker's outputs, state writes and input
    # offsets are committed in one Kafka transaction every commit_interval_s; derived records
    # become visible to read_committed readers then. Off: at least once (consumers
    # deduplicate by event_id), the outputs visible at once.
    exactly_once: bool = True
    commit_interval_s: float = Field(default=1.0, gt=0.0, le=60.0)
    # Exactly once: also commit once no unit has run for this long, so a quiet loop's
    # records are visible at once and only a busy worker waits for commit_interval_s
    # (bench/rewards.py: 0.25 s commits cost 16 % of the top rate; 0: interval only).
    commit_idle_s: float = Field(default=0.05, ge=0.0, le=10.0)
    # A worker's transactional id is <app id>-eos-<host>-<worker_index>: `liverl workers
    # --processes N` numbers its children, so a restarted one fences its killed predecessor.
    # Two workers of one app started by hand on one machine need distinct indexes.
    worker_index: int = Field(default=0, ge=0)
    transaction_timeout_s: float = Field(default=60.0, ge=5.0, le=900.0)
    # An input record handed to the agents and never acknowledged while later records of its
    # partition were (a queue Faust cleared under it, say) is handed again after this long,
    # with a warning and liverl_workers_records_redelivered (processors/ledger_consumer.py):
    # the committed offset never passes it.
    redeliver_after_s: float = Field(default=30.0, ge=1.0, le=3600.0)
    # Config versions enter every derived event id: change them when the logic changes.
    pairing_version: str = "pairing-1"
    reward_version: str = "reward-3"
    sample_version: str = "samples-3"
    # Pairing.
    idle_timeout_s: float = 1800.0
    sweep_interval_s: float = 5.0
    # How long a next state for an unknown turn (or a closed session's stragglers) may wait.
    grace_s: float = 30.0
    # After a session closes, how long to wait for an outcome (record-outcome) before assembling.
    outcome_wait_s: float = 0.0
    # How long a closed session waits for hints after its close and after its latest verdict
    # before assembling: hints from outside the judge (another judge, a person writing to the
    # hints topic), and a judge agent's own (the LLM judge sends a verdict's hints beside it,
    # on another topic). None: 0 with an inline judge, 1 s with a judge agent. A hint for an
    # assembled session is dead-lettered: its samples have left already.
    hint_wait_s: float | None = Field(default=None, ge=0.0)
    # Groups (sessions sharing a group_id, RLAnything z-scoring within (group, step index)):
    # a group is complete with this many sessions (0: only the timeout completes it) or this
    # long after its first session was assembled.
    group_size: int = Field(default=0, ge=0)
    group_timeout_s: float = Field(default=600.0, gt=0)
    # Per-session state untouched this long is dropped (bounded memory); must exceed
    # idle_timeout_s + grace_s + max(outcome_wait_s, hint_wait_s) so that no live session
    # loses its state.
    retain_s: float = 6 * 3600.0
    # One session's state is one changelog value, so it is bounded whatever
    # the traffic: texts kept per turn (the judge's request and answer: their last characters,
    # of which the LLM judge reads 4,000; a tool call's command and identity) are cut to
    # state_text_chars, and the oldest turns, commands and failure counts are dropped while a
    # value would exceed state_max_bytes (never more than kafka.max_event_bytes, which is below
    # the record limit): pairing and judging get 2/5 of it each, the assembly the rest. A next
    # state for a dropped turn is dead-lettered.
    state_text_chars: int = Field(default=4_096, ge=256)
    state_max_bytes: int = Field(default=1 << 20, ge=64 * 1024)
    # Explicit feedback (kind "feedback") counts once per caller and turn, the latest by
    # (ts_ms, event id) winning; a turn keeps the votes of at most this many callers. A vote
    # that does not count (replaced, over this cap, read after its session was assembled) is
    # dead-lettered with the reason and counted in the workers' /metrics.
    feedback_voters_per_turn: int = Field(default=32, ge=1, le=10_000)
    # Next states posted through a gateway (GUI, terminal and other sources, hooks: they carry
    # detail.key_id) count at most this many per turn and source; the rest are dead-lettered
    # (posted_cap). The gateway caps each replica (serve.next_states_per_turn, 8); this holds
    # behind several replicas too.
    posted_per_turn: int = Field(default=8, ge=1, le=10_000)
    # Judges.
    # Judge by name: "replies" (default: explicit score and exit code first, then the user's
    # reply read by the patterns of rules/replies.yaml plus vaderSentiment; hints from directive
    # corrections), "rules" (the fixed phrase lists it replaced) or "llm" (the PRM, llm_* below),
    # or one a plug-in module registers (processors/judges.py: JUDGES.register).
    plugins: list[str] = Field(
        default_factory=list,
        description="Modules to import before the judge is looked up; each registers judges "
        "(pipeline.processors.judges.register).",
    )
    judge: str = Field(default="replies", validate_default=True)
    # The judge's own options, validated by the options model it registered with (a typo is
    # an error naming the key). For "llm", the llm_* fields below are its defaults.
    judge_options: dict[str, Any] = Field(default_factory=dict)
    judge_batch: int = 32
    # `liverl judges watch`: a judge's recent consistency covers its last this many decided
    # matches, and flagging reads it (processors/consistency_watch.py): a judge right for a
    # long time that turns bad is flagged after about half as many wrong verdicts (11 of 20),
    # where its cumulative figure would wait for as many wrong verdicts as it had right ones.
    consistency_window: int = Field(default=20, ge=1, le=100_000)
    # The session agent takes records in batches of up to this many, waiting at most
    # session_batch_s for one to fill: a session's records of a batch share one state read and
    # one state write (one changelog record). 1 makes every record its own unit.
    session_batch: int = Field(default=256, ge=1, le=10_000)
    session_batch_s: float = Field(default=0.005, ge=0.0, le=1.0)
    rules_path: Path = DEFAULT_RULES
    llm_base_url: str = "http://127.0.0.1:8000/v1"
    llm_model: str = "judge"
    llm_api_key: str | None = None
    llm_votes: int = Field(default=3, ge=1)
    llm_timeout_s: float = 30.0
    llm_retries: int = 2
    llm_concurrency: int = 8
    llm_hints: bool = True

    @field_validator("judge")
    @classmethod
    def _known_judge(cls, judge: str, info: ValidationInfo) -> str:
        """Plug-ins (declared, hence validated, first) load before the name is checked."""
        from pipeline.processors.judge_registry import JUDGES
        from pipeline.registry import load_plugins

        load_plugins(info.data.get("plugins") or [], "processors")
        JUDGES.get(judge)
        return judge

    @model_validator(mode="after")
    def _judge_options_fit(self) -> ProcessorSettings:
        from pipeline.processors.judge_registry import JUDGES

        JUDGES.options(self.judge, self.effective_judge_options())
        return self

    def effective_judge_options(self) -> dict[str, Any]:
        """The options the judge is built with: for "llm" the llm_* fields, then
        ``judge_options`` over them."""
        base: dict[str, Any] = {}
        if self.judge == "llm":
            base = {
                "base_url": self.llm_base_url,
                "model": self.llm_model,
                "api_key": self.llm_api_key,
                "votes": self.llm_votes,
                "timeout_s": self.llm_timeout_s,
                "retries": self.llm_retries,
                "concurrency": self.llm_concurrency,
                "hints": self.llm_hints,
            }
        return {**base, **self.judge_options}

    @model_validator(mode="after")
    def _state_holds_a_turn(self) -> ProcessorSettings:
        # Two turns whose texts are all escapes (6 bytes a character in JSON) must fit in the
        # judge's part of a session's value (2/5 of it, app.py).
        floor = 5 * (2 * 6 * self.state_text_chars + 4096)
        if self.state_max_bytes < floor:
            raise ValueError(
                f"state_max_bytes ({self.state_max_bytes}) must be at least {floor} for "
                f"state_text_chars={self.state_text_chars} (two turns of full-length texts)"
            )
        return self

    @model_validator(mode="after")
    def _retain_outlives_sessions(self) -> ProcessorSettings:
        # The judge agent's default hint wait (1 s) is left out: a bound that small matters to
        # no real retain_s, and the judge's kind is only known once it is built.
        wait = max(self.outcome_wait_s, self.hint_wait_s or 0.0)
        floor = self.idle_timeout_s + self.grace_s + wait
        if self.retain_s <= floor:
            raise ValueError(
                f"retain_s ({self.retain_s:g}) must exceed idle_timeout_s + grace_s + "
                f"max(outcome_wait_s, hint_wait_s) ({floor:g}), or live sessions would lose "
                "their state"
            )
        return self

    def faust_web(self) -> dict[str, Any]:
        """The web settings of ``faust.App``: bound to ``web_host`` only (Faust binds every
        interface by default), on ``web_port`` or, for 0, a port free right now."""
        port = self.web_port or (free_port(self.web_host) if self.web_enabled else 6066)
        return {"web_enabled": self.web_enabled, "web_bind": self.web_host,
                "web_host": self.web_host, "web_port": port}  # fmt: skip

    def hint_wait(self, judge_inline: bool) -> float:
        """``hint_wait_s``, or its default for this kind of judge."""
        if self.hint_wait_s is not None:
            return self.hint_wait_s
        return 0.0 if judge_inline else JUDGE_AGENT_HINT_WAIT_S


class TaskSettings(BaseSettings):
    """``[tasks]``: the verified-task pool (processors/task_pool.py, ``liverl tasks``)."""

    model_config = SettingsConfigDict(env_prefix="LIVERL_TASKS_", extra="ignore")

    # The k judges that vote on each verified session, by registry name (plug-ins from
    # ``processors.plugins``); k odd, so a strict majority always decides. The default: two
    # judges of the answer itself (well-formed; on the request's topic: answer_judges.py) and
    # one of the verifying outcome (replies): an empty, degenerate, echoed or refused answer
    # is rejected whatever its checker said. Add llm (or a plug-in) to read meaning.
    judges: list[str] = Field(
        default_factory=lambda: ["answer", "on_topic", "replies"], min_length=1, max_length=15
    )
    # Per judge name, its options (validated by the options model it registered with).
    judge_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Gate commands `liverl tasks check` may run again (only ones liverl ran: record-outcome,
    # gates run): argv patterns, each a whole command line split as sh would, one shell glob
    # per argument, matched against every argument ("pytest -q 'tests/*'"; a bare "pytest"
    # allows pytest with no argument only). Empty: nothing from event content runs.
    allowed_commands: list[str] = Field(default_factory=list)
    check_timeout_s: float = Field(default=1800.0, gt=0)
    # What a task keeps of the session's texts, in characters each: the prompt, the first
    # interaction's messages (together), the final answer.
    text_chars: int = Field(default=8000, ge=100)

    @field_validator("allowed_commands")
    @classmethod
    def _argv_patterns(cls, patterns: list[str]) -> list[str]:
        for entry in patterns:
            try:
                words = shlex.split(entry)
            except ValueError as exc:
                raise ValueError(f"cannot split the pattern {entry!r}: {exc}") from exc
            if not words:
                raise ValueError("an empty pattern (each entry is a whole command line)")
        return patterns

    @field_validator("judges")
    @classmethod
    def _odd_and_distinct(cls, judges: list[str]) -> list[str]:
        if len(judges) % 2 == 0:
            raise ValueError(
                f"k = {len(judges)} judges: k must be odd, so a strict majority always decides"
            )
        if len(set(judges)) != len(judges):
            raise ValueError(f"a judge is named twice in {judges}")
        return judges
