"""SGLang server backend over HTTP; never imports sglang.

We render the chat template ourselves and send ``input_ids`` to ``POST /generate`` with
``return_logprob``; the answer's ``output_ids`` and ``meta_info.output_token_logprobs`` are the
engine's own tokens and log-probs, never re-tokenized. Start SGLang with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so its log-probs use the same basis as the hf backend
(raw distribution, temperature 1); otherwise they are the sampler's temperature/top-p ones.

Answers stream token by token: ``/generate`` with ``"stream": true`` sends one SSE event per
decoding step and ``data: [DONE]``; each new token id and log-prob is yielded as it comes, so
the gateway forwards it at once. By default SGLang's events are cumulative (every event holds
all output ids and log-probs so far); with ``--incremental-streaming-output`` each holds only
the new ones. ``sglang_stream = "auto"`` asks the server which (``/server_info``) once;
``cumulative`` / ``incremental`` say it; ``off`` makes one non-streaming call. A cumulative
event that does not extend what was already yielded is an error, never a silent re-read.
A request whose answer is sent whole (``SamplingParams.incremental`` false: the client did not
ask to stream) is one non-streaming call whatever the mode: streaming it would cost an SSE
event per token, each repeating every token so far in SGLang's default mode (quadratic in the
answer's length; ``bench/gateway.py``), for nothing the client sees. Either way a client that
leaves closes the connection to SGLang, which aborts the request: a streamed one when its next
event finds the connection gone, a whole one when SGLang next checks for a disconnect while
it waits for the answer (not at once).
The HTTP client is aiohttp with orjson bodies: httpx's connection pool checked every pooled
connection's socket on each request and cost ~1.5 ms of gateway CPU per request at 16 in
flight (``bench/gateway.py``, profiled), more than the rest of the gateway together.

Weight versions: full weights go through ``/update_weights_from_disk``; a LoRA version (a folder
with ``adapter_config.json``) through SGLang's dynamic LoRA loading: ``/load_lora_adapter``
registers it under the name ``<policy>-v<N>``, each request names the adapter that was live
when it started (``lora_path`` on ``/generate``), and an adapter no request uses any more is
unloaded (``/unload_lora_adapter``). Start SGLang with ``--enable-lora --max-lora-rank R
--lora-target-modules all`` so adapters can be loaded that were not there at launch.

A canary (two versions at once): both arms are adapters on the one server, the stable one
and the canary's, and each request names its arm's (``--max-loras-per-batch``, default 8,
must be at least 2 so both batch together). A rollout moves the canary's adapter to the
stable arm without loading it again. One SGLang server holds one set of full weights, so a
full-weights version cannot be a canary: loading it as one fails (reported, its users stay
on the stable version) and it serves when it is rolled out.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import orjson

from pipeline.serving.errors import SGLangError

from . import lora
from .base import Done, Piece, SamplingParams, StopReason

log = logging.getLogger(__name__)
_JSON = {"Content-Type": "application/json"}
StreamMode = Literal["auto", "cumulative", "incremental", "off"]
MAX_EVENT_BYTES = 64 << 20  # one SSE event (a cumulative one of a long answer is large)


class StreamDecoder:
    """SGLang's streaming ``/generate`` events to new tokens: in ``cumulative`` mode each
    event repeats everything so far, in ``incremental`` mode it holds only the new tokens."""

    def __init__(self, mode: Literal["cumulative", "incremental"]) -> None:
        self.mode = mode
        self.ids: list[int] = []
        self.finish: str | None = None
        self.meta: dict[str, Any] = {}

    def feed(self, event: dict[str, Any]) -> Piece | None:
        """The tokens this event adds (None if none); records the finish when it comes."""
        if "error" in event:
            err = event["error"]
            detail = err.get("message") if isinstance(err, dict) else err
            raise SGLangError(f"SGLang /generate stream failed: {str(detail)[:300]}")
        meta = event.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []
        output_ids = event.get("output_ids")
        if self.mode == "cumulative":
            # Each event repeats everything so far: checking every repeated id made a
            # 200-token answer cost 20,000 comparisons (as much CPU as parsing its events);
            # the first and the last one seen tell a stream that does not extend ours.
            seen = len(self.ids)
            if len(pairs) < seen or (
                seen > 0
                and (int(pairs[0][1]) != self.ids[0] or int(pairs[seen - 1][1]) != self.ids[-1])
            ):
                raise SGLangError(
                    "SGLang stream events do not repeat the tokens already sent: is the "
                    "server started with --incremental-streaming-output? Set "
                    'serve.sglang_stream = "incremental" (or "auto")'
                )
            pairs = pairs[seen:]
            if output_ids is not None:
                output_ids = output_ids[seen:]
        ids = [int(p[1]) for p in pairs]
        if output_ids and not pairs:
            raise SGLangError("SGLang returned no output_token_logprobs (return_logprob ignored?)")
        if output_ids is not None and list(output_ids) != ids:
            raise SGLangError("SGLang output_ids and output_token_logprobs disagree")
        self.ids += ids
        self.meta = meta
        reason = meta.get("finish_reason")
        if reason is not None:
            self.finish = (reason or {}).get("type", "stop") if isinstance(reason, dict) else "stop"
        return Piece(ids, [float(p[0]) for p in pairs]) if ids else None


def sse_events(buffer: bytearray) -> list[bytes]:
    """Complete ``data:`` payloads at the head of ``buffer`` (consumed from it)."""
    out = []
    while (end := buffer.find(b"\n\n")) >= 0:
        block = bytes(buffer[:end])
        del buffer[: end + 2]
        data = [line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))
    return out


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
        stream: StreamMode = "auto",
    ) -> None:
        from transformers import AutoTokenizer

        self.url = url.rstrip("/")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.policy_id = policy_id
        self.context_length = context_length
        self._version = version
        self._adapter: str | None = None  # live LoRA name on the server, None: base weights
        self._initial_version = version  # what serve_base goes back to
        self._base_path = Path(tokenizer_path)  # the base weights (serve_base after full ones)
        self._full = False  # the stable arm serves full weights loaded since the start
        # the canary arm: (version, adapter name, share of users), None without one
        self._canary: tuple[int, str, float] | None = None
        self._in_use: Counter[str] = Counter()  # adapter name -> requests running on it
        self._loaded: set[str] = set()  # adapters this gateway loaded and not yet unloaded
        self._lock: asyncio.Lock | None = None  # adapter loads/unloads, one at a time
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self.timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None  # made in (and bound to) a running loop
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._proxy: str | None = None
        self.stream: StreamMode = stream
        self._mode: Literal["cumulative", "incremental"] | None = (
            stream if stream in ("cumulative", "incremental") else None
        )

    @property
    def version(self) -> int:
        """The stable arm's version."""
        return self._version

    @property
    def canary(self) -> tuple[int, float] | None:
        """(version, share) of the loaded canary, None without one."""
        c = self._canary
        return None if c is None else (c[0], c[2])

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, canary: bool = False
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
            "stream": self.stream != "off" and params.incremental,
        }
        arm = self._canary if canary else None  # no canary (dropped meanwhile): stable
        # this request's snapshot
        version, adapter = (arm[0], arm[1]) if arm is not None else (self._version, self._adapter)
        if adapter is not None:
            body["lora_path"] = adapter
            self._in_use[adapter] += 1
        try:
            if not body["stream"]:
                decoder = StreamDecoder("incremental")  # one answer: one event of it all
                piece = decoder.feed(await self._generate_once(body))
                if piece is not None:
                    yield piece
            else:
                decoder = StreamDecoder(await self._stream_mode())
                async for piece in self._generate_stream(body, decoder):
                    yield piece
        finally:
            if adapter is not None:
                self._in_use[adapter] -= 1
                await self._unload_unused()
        finish = decoder.finish or "stop"
        reason: StopReason = "length" if finish == "length" else "stop"
        if finish == "abort":
            reason = "abort"
        # With an adapter the version is the adapter's; SGLang's weight_version is the base's.
        served = version if adapter is not None else _version(decoder.meta, version)
        yield Done(finish_reason=reason, weight_version=served)

    async def _generate_once(self, body: dict[str, Any]) -> dict[str, Any]:
        status, raw = await self._post("/generate", body)
        if status != 200:
            raise SGLangError(f"SGLang /generate answered {status}: {_text(raw)}")
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            raise SGLangError(f"SGLang /generate answered no JSON object: {_text(raw)}")
        return data

    async def _generate_stream(
        self, body: dict[str, Any], decoder: StreamDecoder
    ) -> AsyncIterator[Piece]:
        """Yield each event's new tokens as it arrives; the connection closes (and SGLang
        aborts the request) when the caller stops early."""
        try:
            session = self._session()
            async with session.post(
                self.url + "/generate", data=orjson.dumps(body), headers=_JSON,
                proxy=self._proxy,
            ) as resp:  # fmt: skip
                if resp.status != 200:
                    raise SGLangError(
                        f"SGLang /generate answered {resp.status}: {_text(await resp.read())}"
                    )
                buffer = bytearray()
                done = False
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    if len(buffer) > MAX_EVENT_BYTES:
                        raise SGLangError(f"SGLang stream event over {MAX_EVENT_BYTES} bytes")
                    for data in sse_events(buffer):
                        if data == b"[DONE]":
                            done = True
                            break
                        try:
                            event = orjson.loads(data)
                        except orjson.JSONDecodeError:
                            raise SGLangError(
                                f"SGLang stream sent no JSON: {_text(data)}"
                            ) from None
                        if not isinstance(event, dict):
                            raise SGLangError(f"SGLang stream sent no object: {_text(data)}")
                        piece = decoder.feed(event)
                        if piece is not None:
                            yield piece
                    if done:
                        break
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SGLangError(f"SGLang at {self.url} unreachable: {exc!r}") from exc
        if decoder.finish is None:
            raise SGLangError("SGLang /generate stream ended before the answer finished")

    async def _stream_mode(self) -> Literal["cumulative", "incremental"]:
        """``auto``: what the server says it sends (asked once); SGLang's default otherwise."""
        if self._mode is None:
            mode: Literal["cumulative", "incremental"] = "cumulative"
            for path in ("/server_info", "/get_server_info"):
                try:
                    session = self._session()
                    async with session.get(self.url + path, proxy=self._proxy) as resp:
                        if resp.status != 200:
                            continue
                        info = orjson.loads(await resp.read())
                except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
                    continue
                if isinstance(info, dict) and info.get("incremental_streaming_output"):
                    mode = "incremental"
                break
            self._mode = mode
            log.info("SGLang streams %s events", mode)
        return self._mode

    async def reload(self, path: Path, version: int) -> None:
        """Serve ``version`` on the stable arm (newer or older: the reloader decides)."""
        c = self._canary
        if c is not None and c[0] == version:  # a rollout: the canary's adapter is loaded
            self._version, self._adapter = version, c[1]
        elif lora.is_adapter_dir(path):
            self._version, self._adapter = version, await self._load_adapter(path, version)
        else:
            await self._load_full(path, str(version))
            self._version, self._adapter, self._full = version, None, True
        await self._unload_unused()

    async def load_canary(self, path: Path, version: int, share: float) -> None:
        """Serve ``version`` to the canary arm (``share``: the users routed to it); an
        adapter only (see the module's docstring)."""
        c = self._canary
        if c is not None and c[0] == version:
            self._canary = (version, c[1], share)
            return
        if version == self._version and self._adapter is not None:
            self._canary = (version, self._adapter, share)
        elif lora.is_adapter_dir(path):
            self._canary = (version, await self._load_adapter(path, version), share)
        else:
            raise SGLangError(
                f"v{version} is full weights: one SGLang server serves one set of full weights, "
                "so it cannot be a canary beside the stable version (train LoRA versions, or "
                "set trainer.canary_share = 0)"
            )
        await self._unload_unused()

    async def drop_canary(self) -> None:
        """No canary: its users are answered by the stable arm from their next request."""
        self._canary = None
        await self._unload_unused()

    async def serve_base(self) -> None:
        """The stable arm back to the weights the server started with (every version
        withdrawn): no adapter, and the base's files again after full weights."""
        if self._full:
            await self._load_full(self._base_path, str(self._initial_version))
            self._full = False
        self._version, self._adapter = self._initial_version, None
        await self._unload_unused()

    async def _load_full(self, path: Path, weight_version: str) -> None:
        body = {
            "model_path": str(path),
            "weight_version": weight_version,
            "abort_all_requests": False,
        }
        await self._admin("/update_weights_from_disk", body)

    def _adapters_lock(self) -> asyncio.Lock:
        """One adapter load or unload at a time (per running loop, as the HTTP client): an
        unload of a name still in flight while a rollback loads it again made the load fail
        ("already loaded") or left the arm naming an adapter the server had dropped."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def _load_adapter(self, path: Path, version: int) -> str:
        """Register the version's adapter on the server (once); its name."""
        name = f"{self.policy_id}-v{version}"
        async with self._adapters_lock():
            if name not in self._loaded:
                body = {"lora_name": name, "lora_path": str(path), "pinned": False}
                await self._admin("/load_lora_adapter", body)
                self._loaded.add(name)
        return name

    async def _admin(self, path: str, body: dict[str, Any]) -> None:
        """POST a weights/adapter call; SGLang answers ``{"success": bool, ...}``."""
        status, raw = await self._post(path, body)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = {}
        if status != 200 or not isinstance(data, dict) or not data.get("success"):
            detail = (
                (data.get("error_message") or data.get("message"))
                if isinstance(data, dict)
                else None
            )
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
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
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
        """Unload adapters that are neither live on an arm nor used by a running request."""
        async with self._adapters_lock():
            keep = {self._adapter, self._canary[1] if self._canary is not None else None}
            for name in [n for n in self._loaded if n not in keep and self._in_use[n] <= 0]:
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
