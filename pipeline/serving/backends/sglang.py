"""SGLang server backend over HTTP; never imports sglang.

We render the chat template ourselves and send ``input_ids`` to ``POST /generate`` with
``return_logprob``; the answer's ``output_ids`` and ``meta_info.output_token_logprobs`` are the
engine's own tokens and log-probs, never re-tokenized. Start SGLang with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so its log-probs use the same basis as the hf backend
(raw distribution, temperature 1); otherwise they are the sampler's temperature/top-p ones.
Generation is one non-streaming call; the gateway still streams it to the client as SSE.
The HTTP client is aiohttp with orjson bodies: httpx's connection pool checked every pooled
connection's socket on each request and cost ~1.5 ms of gateway CPU per request at 16 in
flight (``bench/gateway.py``, profiled), more than the rest of the gateway together.

Weight versions: full weights go through ``/update_weights_from_disk``; a LoRA version (a folder
with ``adapter_config.json``) through SGLang's dynamic LoRA loading: ``/load_lora_adapter``
registers it under the name ``<policy>-v<N>``, each request names the adapter that was live
when it started (``lora_path`` on ``/generate``), and an adapter no request uses any more is
unloaded (``/unload_lora_adapter``). Start SGLang with ``--enable-lora --max-lora-rank R
--lora-target-modules all`` so adapters can be loaded that were not there at launch.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from pipeline.serving.errors import SGLangError

from . import lora
from .base import Done, Piece, SamplingParams, StopReason

log = logging.getLogger(__name__)
_JSON = {"Content-Type": "application/json"}


class SGLangBackend:
    def __init__(
        self,
        url: str,
        tokenizer_path: Path,
        *,
        policy_id: str,
        version: int = 0,
        context_length: int = 32768,
        timeout_s: float = 600.0,
    ) -> None:
        from transformers import AutoTokenizer

        self.url = url.rstrip("/")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.policy_id = policy_id
        self.context_length = context_length
        self._version = version
        self._adapter: str | None = None  # live LoRA name on the server, None: base weights
        self._in_use: Counter[str] = Counter()  # adapter name -> requests running on it
        self._loaded: set[str] = set()  # adapters this gateway loaded and not yet unloaded
        self.timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None  # made in (and bound to) a running loop
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._proxy: str | None = None

    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[Piece | Done]:
        sampling: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_new_tokens": params.max_tokens,
        }
        if params.stop:
            sampling["stop"] = params.stop
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        body: dict[str, Any] = {
            "input_ids": prompt_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "stream": False,
        }
        version, adapter = self._version, self._adapter  # this request's snapshot
        if adapter is not None:
            body["lora_path"] = adapter
            self._in_use[adapter] += 1
        try:
            status, raw = await self._post("/generate", body)
        finally:
            if adapter is not None:
                self._in_use[adapter] -= 1
                await self._unload_unused()
        if status != 200:
            raise SGLangError(f"SGLang /generate answered {status}: {_text(raw)}")
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            raise SGLangError(f"SGLang /generate answered no JSON object: {_text(raw)}")
        meta = data.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []
        ids = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
        if not pairs and data.get("output_ids"):
            raise SGLangError("SGLang returned no output_token_logprobs (return_logprob ignored?)")
        if data.get("output_ids") is not None and list(data["output_ids"]) != ids:
            raise SGLangError("SGLang output_ids and output_token_logprobs disagree")
        yield Piece(ids, logprobs)
        finish = (meta.get("finish_reason") or {}).get("type", "stop")
        reason: StopReason = "length" if finish == "length" else "stop"
        if finish == "abort":
            reason = "abort"
        # With an adapter the version is the adapter's; SGLang's weight_version is the base's.
        served = version if adapter is not None else _version(meta, version)
        yield Done(finish_reason=reason, weight_version=served)

    async def reload(self, path: Path, version: int) -> None:
        if lora.is_adapter_dir(path):
            await self._load_adapter(path, version)
            return
        body = {
            "model_path": str(path),
            "weight_version": str(version),
            "abort_all_requests": False,
        }
        await self._admin("/update_weights_from_disk", body)
        self._version = max(self._version, version)
        self._adapter = None
        await self._unload_unused()

    async def _load_adapter(self, path: Path, version: int) -> None:
        name = f"{self.policy_id}-v{version}"
        body = {"lora_name": name, "lora_path": str(path), "pinned": False}
        await self._admin("/load_lora_adapter", body)
        if version > self._version:
            self._version, self._adapter = version, name
            self._loaded.add(name)
        await self._unload_unused()

    async def _admin(self, path: str, body: dict[str, Any]) -> None:
        """POST a weights/adapter call; SGLang answers ``{"success": bool, ...}``."""
        status, raw = await self._post(path, body)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = {}
        if status != 200 or not isinstance(data, dict) or not data.get("success"):
            detail = (data.get("error_message") or data.get("message")) if isinstance(
                data, dict) else None
            raise SGLangError(f"{path.lstrip('/')} failed: {detail or _text(raw)}")

    def _session(self) -> aiohttp.ClientSession:
        """The client of the running loop (a test may drive the backend from several loops;
        the gateway runs one)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._http_loop is not loop:
            # Proxies from the environment (as httpx did), looked up once here: aiohttp's
            # trust_env looks them and ~/.netrc up on a worker thread for every request, two
            # thread hops that cost ~0.3 ms of latency each on a busy 2-core machine.
            self._proxy = env_proxy(self.url)
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
            self._http_loop = loop
        return self._http

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """Status and body of a JSON POST; transport failures and timeouts are SGLangError."""
        try:
            session = self._session()
            async with session.post(
                self.url + path, data=orjson.dumps(body), headers=_JSON, proxy=self._proxy
            ) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SGLangError(f"SGLang at {self.url} unreachable: {exc!r}") from exc

    async def _unload_unused(self) -> None:
        """Unload adapters that are neither live nor used by a running request."""
        for name in [n for n in self._loaded if n != self._adapter and self._in_use[n] <= 0]:
            self._loaded.discard(name)
            try:
                status, _raw = await self._post("/unload_lora_adapter", {"lora_name": name})
                if status != 200:
                    log.warning("unload of adapter %s answered %s", name, status)
            except SGLangError as exc:  # the server keeps an extra adapter; harmless
                log.warning("unload of adapter %s failed: %s", name, exc)

    async def close(self) -> None:
        if self._http is not None and self._http_loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = None


def env_proxy(url: str) -> str | None:
    """The proxy that ``http_proxy``/``https_proxy``/``no_proxy`` name for ``url``."""
    parts = urlsplit(url)
    if parts.hostname and urllib.request.proxy_bypass(parts.hostname):
        return None
    return urllib.request.getproxies().get(parts.scheme)


def _text(raw: bytes) -> str:
    return raw[:300].decode("utf-8", "replace")


def _version(meta: dict[str, Any], fallback: int) -> int:
    """SGLang reports the version that produced a response as a string; trust it over ours."""
    raw = meta.get("weight_version")
    try:
        return int(raw) if raw is not None else fallback
    except (TypeError, ValueError):
        return fallback
