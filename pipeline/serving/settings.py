"""Gateway settings: the ``[serve]`` section of ``pipeline.settings.Settings``."""

from __future__ import annotations

import hashlib
import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipeline.kafka import names

SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def hash_key(key: str) -> str:
    """Keys are only ever held as sha256 hex, so a dump of settings or logs never leaks one."""
    return hashlib.sha256(key.encode()).hexdigest()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiKey(BaseModel):
    """One accepted bearer key (``[[serve.keys]]``): its sha256, never the key; the user it
    speaks for; its role. A ``user`` key owns the sessions it opens and may name no other
    user; an ``operator`` key (a review tool, a proxy serving many users) may post next
    states for any session and name any user with ``X-Liverl-User``."""

    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")
    user: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,  # sessions.MAX_ID_CHARS
        description="Whose turns this key's are (recorded as user_id); None: the key id.",
    )
    role: Literal["user", "operator"] = "user"

    @field_validator("user")
    @classmethod
    def _printable(cls, user: str | None) -> str | None:
        if user is not None and not (user.strip() and user.isprintable()):
            raise ValueError("a key's user must be a non-empty printable id")
        return user


class ServeSettings(BaseModel):
    """Everything ``liverl serve`` needs; built from CLI options and ``LIVERL_SERVE_*`` env."""

    host: str = "127.0.0.1"
    port: int = 8000
    backend: Literal["hf", "sglang"] = "hf"
    model_path: str | None = Field(
        default=None,
        description="A store model name (smollm2-135m-instruct, pulled on first use), 'tiny' "
        "(the model built in code) or a local HF model dir; None: smollm2-135m-instruct.",
    )
    served_model_name: str | None = Field(
        default=None, description="Name clients put in `model`; defaults to the policy id."
    )
    policy_id: str | None = Field(default=None, description="Defaults to the model dir's name.")
    weight_version: int = Field(default=0, ge=0, description="Version of the weights at start.")
    device: str = "cpu"
    dtype: str = "float32"
    sglang_url: str = "http://127.0.0.1:30000"
    sglang_timeout_s: float = 600.0
    sglang_stream: Literal["auto", "cumulative", "incremental", "off"] = Field(
        default="auto",
        description="How SGLang's streaming /generate events come: auto asks /server_info; "
        "cumulative is SGLang's default, incremental its --incremental-streaming-output; off "
        "makes one non-streaming call per answer.",
    )
    context_length: int | None = Field(
        default=None, description="Max prompt+completion tokens; default from the model config."
    )
    default_max_tokens: int = 256
    workers: int = Field(default=4, ge=1, description="Concurrent generations (hf backend).")

    api_key_hashes: list[str] = Field(
        default_factory=list,
        description="sha256 hex of accepted bearer keys (never raw keys), each a user of its "
        "own (its key id) with role user; `keys` gives a key a user and a role.",
    )
    keys: list[ApiKey] = Field(
        default_factory=list,
        description="Accepted bearer keys with the user each speaks for and its role "
        "([[serve.keys]] sha256 = ..., user = ..., role = user | operator).",
    )
    rate_limit_per_min: float = Field(default=0, ge=0, description="Per key; 0 disables.")
    rate_limit_burst: int = Field(default=20, ge=1)
    feedback_rate_limit_per_min: float = Field(
        default=30,
        ge=0,
        description="Per key on /v1/feedback, besides rate_limit_per_min (429 beyond; 0: "
        "off): a caller's latest vote per turn is what counts, so a flood only adds load.",
    )
    feedback_rate_limit_burst: int = Field(default=10, ge=1)
    max_body_bytes: int = 4 * 1024 * 1024
    max_json_depth: int = Field(
        default=64,
        ge=2,
        description="Deepest nesting of objects/arrays accepted in a request body (400 beyond): "
        "the JSON encoder of recorded events stops at 254 levels, so deeper input must never be "
        "served and then fail to record.",
    )
    prompt_cache_mb: int = Field(
        default=64,
        ge=0,
        description="Memory for each session's last prompt, so a new turn tokenizes only "
        "what follows it (0: off; least recently used sessions are dropped first).",
    )
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="A request's headers must arrive within this (else closed)."
    )
    access_log: bool = Field(
        default=False,
        description="uvicorn's line per request (off: it cost ~5% of the gateway's CPU per "
        "request; /metrics counts requests by status).",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A request's body must arrive within this (else 408, connection closed).",
    )
    shutdown_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Bound on each shutdown stage (open connections, recorder drain): "
        "undelivered events stay in the spool for the next start.",
    )

    record: bool = True
    interactions_topic: str = names.INTERACTIONS
    next_states_topic: str = Field(
        default=names.NEXT_STATES,
        description="Where /v1/feedback and /v1/hooks/* record next states.",
    )
    next_state_max_body_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        description="Largest body of /v1/feedback and /v1/hooks/* (413 beyond): they carry a "
        "reply, a score or a hook payload, never a conversation.",
    )
    next_state_max_chars: int = Field(
        default=16_000,
        ge=1,
        description="Longest text a feedback or hook body may carry (feedback `text`, a hook's "
        "`prompt`); 400 beyond, nothing recorded.",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description="Modules to import before the sources are looked up; each registers "
        "next-state sources (pipeline.serving.sources.register).",
    )
    sources: list[str] = Field(
        default_factory=lambda: ["terminal", "gui"],
        validate_default=True,
        description="Next-state sources answering at POST /v1/next_states/<name> (built in: "
        "terminal, gui; a plug-in module registers more).",
    )
    # Each source's own options, validated by the model it registered with (a typo is an
    # error naming the key): [serve.source_options.terminal] passing_exit_codes = [0, 5].
    source_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    hook_stop_scores: dict[str, Annotated[float, Field(ge=-1, le=1)]] = Field(
        default_factory=lambda: {"error": -1.0, "aborted": -1.0},
        description="The `stop` hook's `status` -> score of the session's last turn (in "
        "[-1, 1]); a status not listed (e.g. completed) closes the session without a score. "
        "Statuses other than completed, aborted, error and the ones listed here are a 422.",
    )
    next_states_per_turn: int = Field(
        default=8,
        ge=1,
        description="Most next states of one kind (a source, a hook) a turn takes from posts "
        "on this replica (429 beyond); a post equal to one recorded for the turn is answered "
        "as that one and records nothing.",
    )
    hook_replay_entries: int = Field(
        default=10_000,
        ge=0,
        description="Hooks remembered by (session, event, generation_id): one posted again "
        "gets the first answer and records nothing more (0: none remembered).",
    )
    spool_dir: Path = Path(".liverl/spool")
    spool_segment_bytes: int = 64 * 1024 * 1024
    delivery_timeout_s: float = Field(
        default=15.0, description="Per batch: after this an undelivered event is retried."
    )
    transactional_recording: bool = Field(
        default=True,
        description="Deliver each spooled batch in one Kafka transaction (transactional.id "
        "from the replica id and its spool dir): a batch whose delivery failed is aborted and "
        "sent again, so read_committed consumers never see a record twice, however long a "
        "broker failover lasts. Off: an idempotent producer, whose retry after "
        "delivery_timeout_s can double a record the broker kept. Needs transactions on the "
        "cluster (and TransactionalId ACLs where there are ACLs).",
    )
    record_linger_ms: float = Field(
        default=50.0,
        ge=0,
        le=1000,
        description="How long a recorded event that arrives alone waits for others to share "
        "its spool fsync and Kafka batch (a batch costs ~1 ms of CPU whatever its size: "
        "sparse traffic cost that per event without a linger; at one request in flight 50 ms "
        "took 0.15 ms of CPU and latency per request off 20 ms's); 0: none. Under load "
        "batches fill without waiting.",
    )
    session_prefix_messages: int = Field(
        default=2,
        ge=1,
        description="Messages hashed (with the key id) to name a session the client did not name.",
    )
    max_sessions: int = 100_000
    turn_recovery_s: float = Field(
        default=3600.0,
        ge=0,
        description="At start, continue the turn numbering of sessions seen in the last this "
        "many seconds of the interactions topic (0: start every session at turn 0).",
    )
    replica_id: str = Field(
        default="gateway-0",
        description="Names this replica (its spool dir, Kafka client id, reload reports; the "
        "X-Liverl-Replica header and /healthz say which replica answered).",
    )
    reuse_port: bool = Field(
        default=False,
        description="Listen with SO_REUSEPORT, so several gateway processes share host:port and "
        "the kernel spreads connections over them (`liverl up --gateways N`; Linux).",
    )
    serve_without_training: bool = Field(
        default=False,
        description="While the spool cannot be written (events could be lost): False answers "
        "turns that would train with 503 (nothing served untrained silently); True serves them "
        "anyway, with an empty X-Liverl-Recorded header (losses counted in "
        "liverl_gateway_events_lost, /healthz degraded).",
    )

    reload: bool = True
    require_promoted: bool | None = Field(
        default=None,
        description="Load only `promoted` versions. None: follow trainer.gate (on by default), "
        "so a version the promotion gate rejected never reaches a user.",
    )

    @field_validator("sources")
    @classmethod
    def _known_sources(cls, sources: list[str], info: ValidationInfo) -> list[str]:
        """Plug-ins (declared, hence validated, first) load before the names are checked."""
        from pipeline.registry import load_plugins
        from pipeline.serving.sources import SOURCES

        load_plugins(info.data.get("plugins") or [], "serve")
        for name in sources:
            SOURCES.get(name)
        return list(dict.fromkeys(sources))

    @model_validator(mode="after")
    def _source_options_fit(self) -> ServeSettings:
        from pipeline.serving.sources import SOURCES

        for name, raw in self.source_options.items():
            if name not in self.sources:
                raise ValueError(
                    f"serve.source_options.{name}: source {name!r} is not enabled "
                    f"(serve.sources = {self.sources})"
                )
            SOURCES.options(name, raw, f"serve.source_options.{name}")
        return self

    @field_validator("api_key_hashes")
    @classmethod
    def _hex_hashes(cls, hashes: list[str]) -> list[str]:
        """A hash that is not sha256 hex can match no key: say so instead of refusing every
        caller that sends it."""
        for h in hashes:
            if not SHA256_HEX.fullmatch(h):
                raise ValueError(f"{h[:16]!r}... is not a sha256 hex digest (64 hex digits)")
        return hashes

    @model_validator(mode="after")
    def _keys_once(self) -> ServeSettings:
        seen: set[str] = set()
        for key in self.keys:
            digest = key.sha256.lower()
            if digest in seen:
                raise ValueError(f"serve.keys: the key {digest[:12]}... is listed twice")
            seen.add(digest)
        return self

    @property
    def accepted_keys(self) -> list[ApiKey]:
        """Every accepted key: ``keys``, then each of ``api_key_hashes`` not among them (a
        user of its own, role user)."""
        listed = {k.sha256.lower() for k in self.keys}
        plain = [h.lower() for h in self.api_key_hashes if h.lower() not in listed]
        return [*self.keys, *(ApiKey(sha256=h) for h in dict.fromkeys(plain))]

    @property
    def open_access(self) -> bool:
        """No keys configured: any key is accepted, which is only allowed on loopback, where
        every caller is trusted (``auth.py``)."""
        return not self.api_key_hashes and not self.keys

    def check(self) -> None:
        """Refuse unsafe combinations before anything listens."""
        if self.open_access and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without API keys; configure keys "
                "(--api-key / LIVERL_SERVE_API_KEYS) or bind to 127.0.0.1"
            )
