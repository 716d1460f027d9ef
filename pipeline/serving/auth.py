"""Bearer API keys (held only as sha256) and a per-key token-bucket rate limit."""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable

from .errors import ApiError
from .settings import hash_key


class Authenticator:
    """Open access (no keys configured) accepts any key; the caller restricts it to loopback."""

    def __init__(self, key_hashes: list[str]) -> None:
        self._hashes = [h.lower() for h in key_hashes]

    def key_id(self, authorization: str | None) -> str:
        """A short, non-reversible id of the caller's key (for sessions and rate limits)."""
        token = _bearer(authorization)
        if not self._hashes:
            return hash_key(token)[:16] if token else "anonymous"
        if token is None:
            raise ApiError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>'.",
                type="authentication_error",
                code="invalid_api_key",
            )
        digest = hash_key(token)
        if not any(hmac.compare_digest(digest, h) for h in self._hashes):
            raise ApiError(
                401, "Incorrect API key provided.", type="authentication_error",
                code="invalid_api_key",
            )
        return digest[:16]


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class RateLimiter:
    """Token bucket per key: ``per_min`` requests a minute, bursts up to ``burst``. ``what``
    names the limit in the 429's message; ``on_refused`` counts refusals."""

    def __init__(
        self,
        per_min: float,
        burst: int,
        *,
        what: str = "Rate limit",
        on_refused: Callable[[], object] | None = None,
    ) -> None:
        self.rate = per_min / 60.0
        self.burst = float(burst)
        self.what, self.on_refused = what, on_refused
        self._buckets: dict[str, tuple[float, float]] = {}

    def check(self, key_id: str) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        tokens, last = self._buckets.get(key_id, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens < 1.0:
            wait = math.ceil((1.0 - tokens) / self.rate)
            self._buckets[key_id] = (tokens, now)
            if self.on_refused is not None:
                self.on_refused()
            raise ApiError(
                429,
                f"{self.what} reached for this key; retry in {wait}s.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(wait)},
            )
        self._buckets[key_id] = (tokens - 1.0, now)
