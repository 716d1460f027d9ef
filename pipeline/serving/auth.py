"""Bearer API keys (held only as sha256), who a caller is, and a per-key token-bucket rate
limit.

With keys, a key speaks for one user (``[[serve.keys]]``; a plain hash is a user of its own,
its key id) and is a ``user`` or an ``operator``: a user key owns the sessions it opens and may
name no other user, an operator key may act on any session. Without keys the gateway listens
on loopback only (``ServeSettings.check``) and every loopback caller is trusted: any bearer
string is accepted, may name any user and post for any session, and since a bearer string is
no identity there, all loopback callers are one caller for votes (``Caller.voter``).
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ApiError
from .settings import ApiKey, hash_key

LOOPBACK = "loopback"  # the one voter every loopback caller is without keys


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request."""

    key_id: str  # sha256[:16] of the bearer string ("anonymous": none): names auto sessions
    user: str  # whose turns: the key's user; without keys the key id
    operator: bool = True  # may act on any session and name any user (loopback: every caller)
    keyed: bool = False  # API keys are configured

    def voter(self, route: str) -> str:
        """Who casts what this caller posts (``detail.key_id``: the reward workers count one
        vote per voter and turn). With keys the key; without, one voter per ``route``
        (``feedback``, a source's name, ``hooks``) whatever bearer string was sent, so forged
        tokens cannot multiply votes."""
        if self.keyed:
            return self.key_id
        return LOOPBACK if route == "feedback" else f"{LOOPBACK}:{route}"

    def may_act_for(self, owner: str | None) -> bool:
        """Whether this caller may post for a session of ``owner`` (None: unknown here)."""
        return self.operator or owner is None or owner == self.user


def open_caller(key_id: str) -> Caller:
    """A caller of a gateway without keys (loopback, trusted)."""
    return Caller(key_id, key_id)


class Authenticator:
    """Open access (no keys configured) accepts any key; the caller restricts it to loopback."""

    def __init__(self, keys: list[ApiKey] | list[str]) -> None:
        entries = [ApiKey(sha256=k) if isinstance(k, str) else k for k in keys]
        self._keys = [(k.sha256.lower(), k) for k in entries]

    def key_id(self, authorization: str | None) -> str:
        """A short, non-reversible id of the caller's key (for sessions and rate limits)."""
        return self.caller(authorization).key_id

    def caller(self, authorization: str | None) -> Caller:
        """Who sends ``authorization``: 401 with keys unless it is one of them."""
        token = _bearer(authorization)
        if not self._keys:
            return open_caller(hash_key(token)[:16] if token else "anonymous")
        if token is None:
            raise ApiError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>'.",
                type="authentication_error",
                code="invalid_api_key",
            )
        digest = hash_key(token)
        found = next((k for h, k in self._keys if hmac.compare_digest(digest, h)), None)
        if found is None:
            raise ApiError(
                401,
                "Incorrect API key provided.",
                type="authentication_error",
                code="invalid_api_key",
            )
        key_id = digest[:16]
        return Caller(key_id, found.user or key_id, found.role == "operator", keyed=True)


def forbidden(message: str, param: str, code: str) -> ApiError:
    """403: an authenticated caller asked for what its key may not do."""
    return ApiError(403, message, type="permission_error", param=param, code=code)


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
