"""``[canary]``: the canary decider and the regression watch (``liverl versions canary``,
started by ``liverl up``). ``LIVERL_CANARY_*`` environment variables over defaults; the
rule each field feeds is in ``canary.py`` and ``watch.py``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class CanarySettings(BaseSettings):
    """How a canary is judged against the stable version, and how the serving version is
    watched against its parent once no canary runs."""

    model_config = SettingsConfigDict(env_prefix="LIVERL_CANARY_", extra="ignore")

    min_sessions: int = Field(
        default=20,
        ge=1,
        description="Sessions with an outcome (verified, else their turns' judged mean) "
        "each arm needs before any decision: "
        "below it the posterior is mostly prior, and one unlucky session would decide.",
    )
    max_sessions: int = Field(
        default=300,
        ge=1,
        description="Canary sessions after which, if neither probability threshold was "
        "reached, the posterior means decide (rollout when the canary's is at least the "
        "stable's minus margin): a canary never waits forever.",
    )
    margin: float = Field(
        default=0.05,
        ge=0.0,
        lt=1.0,
        description="How much worse than the stable version's outcome rate (absolute) still "
        "counts as no worse: the test is P(canary < stable - margin).",
    )
    withdraw_probability: float = Field(
        default=0.95,
        gt=0.5,
        lt=1.0,
        description="Withdraw the canary when P(canary < stable - margin) reaches this.",
    )
    rollout_probability: float = Field(
        default=0.95,
        gt=0.5,
        lt=1.0,
        description="Roll the canary out when P(canary >= stable - margin) reaches this.",
    )
    watch_window: int = Field(
        default=100,
        ge=1,
        description="The regression watch compares the serving version's last this many "
        "sessions with outcomes against its parent's last this many.",
    )
    watch_min_sessions: int = Field(
        default=30,
        ge=1,
        description="Sessions with outcomes each side of the watch needs in its window before "
        "it may find a drop.",
    )
    watch_probability: float = Field(
        default=0.99,
        gt=0.5,
        lt=1.0,
        description="The watch finds a drop when P(serving < parent - margin) reaches this; "
        "stricter than withdraw_probability because the watch tests again at every new "
        "session, for as long as a version serves.",
    )
    watch_action: Literal["withdraw", "alert"] = Field(
        default="withdraw",
        description="On a drop: withdraw (a withdraw event by 'watch': the version and every "
        "newer one stop serving) or alert (a warning and the liverl_watch_alerts_total "
        "metric, no event).",
    )
    wait_log_sessions: int = Field(
        default=10,
        ge=1,
        description="While waiting, log the figures again after this many new sessions "
        "with outcomes (the metrics follow every one).",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve the liverl_canary_* and liverl_watch_* metrics on this port "
        "(no authentication); None: no metrics server.",
    )
    metrics_host: str = Field(
        default="127.0.0.1", min_length=1, description="Interface the metrics server binds to."
    )

    @model_validator(mode="after")
    def _cap_above_minimum(self) -> CanarySettings:
        if self.max_sessions < self.min_sessions:
            raise ValueError(
                f"canary.max_sessions ({self.max_sessions}) must be at least "
                f"canary.min_sessions ({self.min_sessions})"
            )
        return self
