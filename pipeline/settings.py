"""One typed settings object: defaults < TOML file < ``LIVERL_*`` environment variables.

Nested sections map to ``LIVERL_<SECTION>_<FIELD>`` (``LIVERL_KAFKA_BOOTSTRAP``,
``LIVERL_BROKER_PORT``); dict fields take JSON (``LIVERL_KAFKA_CLIENT='{"security.protocol":
"SASL_SSL"}'``). The file is ``$LIVERL_CONFIG`` or ``./liverl.toml`` when present.

The top of the settings layers (docs/architecture.md, Settings): ``Settings`` composes the
Kafka layer's sections (``pipeline.kafka.connection``) with each component's own
(``[serve]``, ``[processors]``, ``[trainer]``), so it is imported by the command line and the
components that run under it, never by the Kafka layer or a component's settings module.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from pipeline.kafka.connection import (
    PROJECT_ROOT,
    BrokerSettings,
    ConnectionSettings,
    KafkaSettings,
    TopicSettings,
)
from pipeline.processors.config import ProcessorSettings, TaskSettings
from pipeline.serving.settings import ServeSettings
from pipeline.trainer.config import TrainerSettings
from pipeline.versions.config import CanarySettings

__all__ = [
    "PROJECT_ROOT",
    "BrokerSettings",
    "ConnectionSettings",
    "ForgetSettings",
    "KafkaSettings",
    "Settings",
    "TopicSettings",
    "load_settings",
]

# Set by load_settings(config=...) for the duration of one construction; no global side effect.
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("liverl_config_file", default=None)


class ForgetSettings(BaseModel):
    """The ``[forget]`` section (``LIVERL_FORGET_*``): the lake's retention policy for the
    files a ``liverl forget`` removed. It was read on its own, so a ``[forget]`` table in
    liverl.toml was ignored."""

    vacuum_retention_hours: int = Field(
        default=24,
        ge=0,
        description="Files a forget removed from a Delta table are physically deleted by the "
        "first vacuum at least this long afterwards (every `liverl forget`, or `liverl forget "
        "--vacuum-only` from cron); older table versions stay readable for this long.",
    )


class Settings(BaseSettings):
    """Everything configurable in liverl."""

    model_config = SettingsConfigDict(
        env_prefix="LIVERL_",
        env_nested_delimiter="_",
        env_nested_max_split=1,
        extra="ignore",
    )

    state_dir: Path = Field(default=Path(".liverl"), description="Durable local state.")
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    topics: TopicSettings = Field(default_factory=TopicSettings)
    # Component sections ([serve], [processors], [trainer], [tasks], [canary]); command-line
    # options given explicitly override them.
    serve: ServeSettings = Field(default_factory=ServeSettings)
    processors: ProcessorSettings = Field(default_factory=ProcessorSettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    forget: ForgetSettings = Field(default_factory=ForgetSettings)
    canary: CanarySettings = Field(default_factory=CanarySettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _CONFIG_FILE.get() or os.environ.get("LIVERL_CONFIG", "liverl.toml")
        toml = TomlConfigSettingsSource(settings_cls, toml_file=toml_file)
        if unknown := unknown_keys(toml.toml_data, settings_cls):
            raise ValueError(f"{toml_file}: " + "; ".join(unknown))
        return (init_settings, env_settings, toml)

    @model_validator(mode="after")
    def _cluster_replication(self) -> Settings:
        """A local cluster replicates every topic (specs, Faust's own) to min(3, nodes) unless
        topics.replication_factor says otherwise; one node changes nothing."""
        local_cluster = self.uses_local_broker and self.broker.nodes > 1
        if local_cluster and self.topics.replication_factor is None:
            self.topics = self.topics.model_copy(
                update={"replication_factor": self.broker.replication}
            )
        return self

    @property
    def bootstrap(self) -> str:
        """Bootstrap servers every component uses."""
        return self.kafka.bootstrap or self.broker.bootstrap

    @property
    def uses_local_broker(self) -> bool:
        return self.kafka.bootstrap is None

    @property
    def connection(self) -> ConnectionSettings:
        """What the Kafka layer's clients are built from: ``[kafka]`` with the bootstrap
        resolved, and where the topic specs are."""
        return ConnectionSettings.model_validate(
            {
                **self.kafka.model_dump(),
                "bootstrap": self.bootstrap,
                "specs_dir": self.topics.specs_dir,
                "replication_factor": self.topics.replication_factor,
            }
        )

    def kafka_client_config(self, **extra: Any) -> dict[str, Any]:
        """librdkafka config for any client: bootstrap + pass-through settings + ``extra``."""
        return self.connection.client_config(**extra)


def unknown_keys(data: Mapping[str, Any], model: type[BaseModel], section: str = "") -> list[str]:
    """Keys of a settings file that no field of ``model`` (or of its sections) takes, each as
    one line naming the key and its section: a typo in liverl.toml is refused, not dropped.
    Only the file is checked: ``LIVERL_*`` variables also name things that are not settings
    (``LIVERL_CONFIG``, a test's fault injection), and a dict field takes any key."""
    fields = {
        alias: f for name, f in model.model_fields.items() for alias in (name, f.alias) if alias
    }
    where = f"[{section}]" if section else "the top level"
    found: list[str] = []
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            close = difflib.get_close_matches(key, list(model.model_fields), n=1)
            hint = (
                f"did you mean {close[0]!r}?"
                if close
                else "known: " + ", ".join(sorted(model.model_fields))
            )
            found.append(f"unknown key {key!r} in {where}; {hint}")
            continue
        sub = field.annotation
        if isinstance(value, Mapping) and isinstance(sub, type) and issubclass(sub, BaseModel):
            found += unknown_keys(value, sub, f"{section}.{key}" if section else key)
    return found


def load_settings(config: str | Path | None = None, **overrides: Any) -> Settings:
    """Load settings; ``config`` names a TOML file (else ``$LIVERL_CONFIG``/``liverl.toml``)."""
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"settings file {path} does not exist")
        token = _CONFIG_FILE.set(path)
        try:
            return Settings(**overrides)
        finally:
            _CONFIG_FILE.reset(token)
    return Settings(**overrides)
