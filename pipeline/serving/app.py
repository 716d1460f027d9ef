"""The HTTP surface: OpenAI chat completions (JSON and SSE), models, health and metrics.

The answer never waits for recording: the interaction is handed to the recorder's queue after
the last token is produced. Every error leaves OpenAI-shaped; nothing a client sends can
cause a 500.

Bounded inputs: body size (``max_body_bytes``, 413), JSON depth (``max_json_depth``, 400) and
body arrival time (``body_timeout_s``, 408 and the connection closed). A turn that would train
is refused with 503 while its event could be lost (the spool cannot be written, whether Kafka
is up or not: see ``recorder.py``) unless ``serve_without_training`` is set; ``/healthz``
answers 503 ``degraded`` with the reason either way. Every answer says whether its turn is
recorded (``X-Liverl-Recorded``: the event id, empty when not). The recorder holds an event
whose answer said so until the spool or Kafka takes it (lost, and counted, only if the gateway
stops first); one whose answer did not is counted as lost at once if neither takes it.
A turn whose client goes away before the answer, streamed or not, is recorded with
``finish_reason="abort"`` and ``train=false``: the turn index stays used on this replica (a
retry here is the next turn; on another replica it reuses the number and, being later,
replaces the aborted turn downstream: see ``sessions.py``) and the partial answer is kept for
inspection but never becomes a sample. A non-streamed request learns of it from the server's
``http.disconnect`` message, awaited next to the generation, which is then stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline import __version__, events
from pipeline.events.types import FinishReason
from pipeline.versions.table import arm_fraction

from .auth import Authenticator, Caller, RateLimiter
from .backends.base import Backend, Done, Piece, SamplingParams, StopReason
from .chat import cut_at_stop, parse_tool_calls, render_prompt, streamable
from .detokenizer import Detokenizer
from .errors import ApiError
from .feedback import FeedbackRequest, handle_feedback
from .hook_replays import HookReplays
from .hooks import HookPayload, handle_hook
from .metrics import Metrics
from .posted import PostedStates
from .prompt_cache import PromptCache
from .protocol import ChatRequest, check_depth, parse_request
from .recorder import Recorder
from .responses import AfterSend, header_safe
from .sessions import Sessions, TurnInfo, conversation_position
from .settings import ServeSettings
from .source_route import handle_source
from .sources import build_sources

log = logging.getLogger(__name__)
PRODUCER = events.Producer(component="gateway", version=__version__)


@dataclass
class Turn:
    """One request in flight: its inputs and what the engine produced so far."""

    req: ChatRequest
    info: TurnInfo
    prompt_ids: list[int]
    params: SamplingParams
    started: float
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: StopReason = "stop"
    version: int = 0
    canary: bool = False  # answered on the canary arm (see Gateway.prepare)
    turn: int | None = None
    ts_ms: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # as recorded
    pending: events.Interaction | None = None  # finished, handed to the recorder once sent
    # The answer says the turn is recorded (``X-Liverl-Recorded``: its event id): decided
    # before the headers go out, and the recorder never drops such an event silently.
    durable: bool = False
    event_id: str = field(default_factory=events.new_event_id)

    def claim(self, sessions: Sessions) -> None:
        """Number and stamp this turn (see ``sessions.py``): its conversation position and a
        per-session monotonic timestamp, so any replica may serve any turn of a session."""
        position = conversation_position(m.role for m in self.req.messages)
        self.turn = sessions.next_turn(self.info.session_id, position)
        self.ts_ms = sessions.stamp(self.info.session_id)


class Gateway:
    def __init__(
        self,
        cfg: ServeSettings,
        backend: Backend,
        recorder: Recorder | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.recorder = recorder
        self.metrics = metrics or Metrics()
        self.auth = Authenticator(cfg.accepted_keys)
        self.limiter = RateLimiter(cfg.rate_limit_per_min, cfg.rate_limit_burst)
        self.feedback_limiter = RateLimiter(
            cfg.feedback_rate_limit_per_min, cfg.feedback_rate_limit_burst,
            what="Feedback rate limit (serve.feedback_rate_limit_per_min)",
            on_refused=self.metrics.feedback_limited.inc,
        )  # fmt: skip
        self.sessions = Sessions(cfg.session_prefix_messages, cfg.max_sessions)
        self.hook_replays = HookReplays(cfg.hook_replay_entries)
        self.posted = PostedStates(cfg.next_states_per_turn, cfg.max_sessions)
        self._prompts: PromptCache | None = None
        self._detok: Detokenizer | None = None
        self.model_name = cfg.served_model_name or backend.policy_id
        self.metrics.bind(
            lambda: float(backend.version),
            (lambda: float(recorder.backlog)) if recorder else None,
            (lambda: float(recorder.spool.size_bytes())) if recorder else None,
        )
        if isinstance(recorder, Recorder):
            recorder.on_lost = self.metrics.lost.inc
            recorder.on_dead_letter = self.metrics.dead_lettered.inc
            recorder.on_quarantine = self.metrics.quarantined.inc

    def recording_problem(self) -> str | None:
        """Why a turn recorded now would be lost (None: recording works or is off)."""
        rec = self.recorder
        if not isinstance(rec, Recorder):
            return None
        if rec.problem:
            return rec.problem
        if rec.started and not rec.alive:
            return "the recorder's threads have stopped"
        return None

    # ---- request handling ---------------------------------------------------------------

    async def read_body(self, request: Request, limit: int | None = None) -> Any:
        """The parsed body, bounded in size (``limit``, default ``max_body_bytes``), time and
        depth."""
        limit = limit or self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise self._too_large(limit)
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                buf = await self._read_limited(request, limit)
        except TimeoutError:
            raise ApiError(
                408,
                f"request body not received within {self.cfg.body_timeout_s:g}s",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        try:
            doc = orjson.loads(buf)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        check_depth(doc, self.cfg.max_json_depth)
        return doc

    async def _read_limited(self, request: Request, limit: int) -> bytearray:
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise self._too_large(limit)
        return buf

    def _too_large(self, limit: int) -> ApiError:
        return ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")

    def prepare(self, request: Request, doc: Any, caller: Caller) -> Turn:
        """The turn a chat request asks for; ``caller`` must be allowed its session (its
        owner or an operator: ``sessions.py``), and owns it from here if nobody did."""
        req = parse_request(doc)
        if req.model not in (self.model_name, self.backend.policy_id):
            raise ApiError(
                404,
                f"The model '{req.model}' does not exist; this gateway serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )
        messages = [m.to_record() for m in req.messages]
        info = self.sessions.resolve(request.headers, doc, caller, messages)
        self.sessions.check_owner(info.session_id, caller)
        durable = self._check_recording(info)
        prompt_ids = render_prompt(self.backend.tokenizer, messages, req.tools, self._encoder(info))
        ctx = self.backend.context_length
        if len(prompt_ids) >= ctx:
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx} tokens; your messages resulted "
                f"in {len(prompt_ids)} tokens.",
                param="messages",
                code="context_length_exceeded",
            )
        wanted = req.max_completion_tokens or req.max_tokens or self.cfg.default_max_tokens
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_tokens=min(wanted, ctx - len(prompt_ids)),
            stop=req.stop_list(),
            seed=req.seed,
            incremental=bool(req.stream),
        )
        self.sessions.claim(info.session_id, info.user_id)
        return Turn(
            req,
            info,
            prompt_ids,
            params,
            time.perf_counter(),
            messages=messages,
            durable=durable,
            canary=self.on_canary(info),
        )

    def on_canary(self, info: TurnInfo) -> bool:
        """Whether the request goes to the canary arm: one is loaded and its user's (else its
        session's) ``arm_fraction`` is below the canary's share, the same on every replica.
        The backend answers it on the stable arm if the canary is gone by then, and the
        version that answered is what the turn records either way."""
        canary = getattr(self.backend, "canary", None)  # None: no canary, or no arms at all
        return canary is not None and arm_fraction(info.arm_key) < canary[1]

    @property
    def prompts(self) -> PromptCache:
        """The session prompt cache of the backend's current tokenizer."""
        tokenizer = self.backend.tokenizer
        if self._prompts is None or self._prompts.tokenizer is not tokenizer:
            self._prompts = PromptCache(tokenizer, self.cfg.prompt_cache_mb << 20)
        return self._prompts

    def close_session(self, session_id: str) -> None:
        """Forget a finished session: its turn numbering and its cached prompt."""
        self.sessions.close(session_id)
        if self._prompts is not None:
            self._prompts.forget(session_id)

    def _encoder(self, info: TurnInfo) -> Callable[[str], list[int]]:
        # Main turns only: a side turn's prompt (e.g. a summary request) would replace the
        # session's main prompt and make its next turn tokenize in full.
        sid = info.session_id if info.turn_type == "main" else None
        cache = self.prompts
        return lambda text: cache.encode(sid, text)

    def _check_recording(self, info: TurnInfo) -> bool:
        """Whether the turn's answer can say it is recorded; a turn that would train but
        cannot be is refused (503) unless ``serve_without_training``, which answers it with
        an empty ``X-Liverl-Recorded``."""
        if not info.recorded or self.recorder is None:
            return False
        problem = self.recording_problem()
        if not problem:
            return True
        if not self.cfg.serve_without_training:
            raise ApiError(
                503,
                f"interactions cannot be recorded right now ({problem}); this turn would not "
                "be trained on, so it is refused. Retry later, or send X-Liverl-Train: false.",
                type="server_error",
                code="recording_unavailable",
                headers={"Retry-After": "5"},
            )
        return False

    def _still_durable(self, turn: Turn) -> None:
        """Just before a JSON answer's headers: recording may have failed since ``prepare``
        (the first failed spool write is learnt after the answers that preceded it)."""
        if turn.durable and self.recording_problem():
            turn.durable = False

    def _record(self, event: events.Event, promised: bool) -> None:
        rec = self.recorder
        if isinstance(rec, Recorder):
            rec.record(self.cfg.interactions_topic, event, promised=promised)
        elif rec is not None:
            rec.record(self.cfg.interactions_topic, event)

    async def run(self, turn: Turn) -> AsyncIterator[list[int]]:
        """Drive the backend on the turn's arm; yields each batch of new token ids."""
        generation = (
            self.backend.generate(turn.prompt_ids, turn.params, canary=True)
            if turn.canary
            else self.backend.generate(turn.prompt_ids, turn.params)
        )
        async for item in generation:
            if isinstance(item, Piece):
                turn.ids += item.token_ids
                turn.logprobs += item.logprobs
                yield item.token_ids
            elif isinstance(item, Done):
                turn.finish, turn.version = item.finish_reason, item.weight_version

    def text_of(self, turn: Turn) -> str:
        tokenizer = self.backend.tokenizer
        if self._detok is None or self._detok.tokenizer is not tokenizer:
            self._detok = Detokenizer(tokenizer)
        return self._detok.decode(turn.ids)

    def finish(
        self, turn: Turn, text: str
    ) -> tuple[str | None, list[dict[str, Any]], FinishReason]:
        """Final content, tool calls and finish reason. The turn is numbered here, and its
        event built; :meth:`hand_over` records it once the answer is sent."""
        text, stopped = cut_at_stop(text, turn.params.stop)
        content: str | None = text
        calls: list[dict[str, Any]] = []
        if turn.req.tools:
            content, calls = parse_tool_calls(text)
        finish: FinishReason = "tool_calls" if calls else ("stop" if stopped else turn.finish)
        latency_ms = (time.perf_counter() - turn.started) * 1000
        self.metrics.latency.observe(latency_ms / 1000)
        self.metrics.tokens.labels("prompt").inc(len(turn.prompt_ids))
        self.metrics.tokens.labels("completion").inc(len(turn.ids))
        if turn.info.recorded:
            turn.claim(self.sessions)
            if self.recorder is not None:
                turn.pending = self._event(turn, text, calls, finish, latency_ms)
        if turn.info.done:
            self.close_session(turn.info.session_id)
        return content, calls, finish

    def hand_over(self, turn: Turn) -> None:
        """Give a finished turn's event to the recorder. Called after the answer is sent,
        sent or not (a client gone at the last byte still had its answer built): the
        recorder's threads then take their CPU while the next request waits, not this one
        (at one request in flight they delayed the answer by ~1 ms on 2 cores)."""
        event, turn.pending = turn.pending, None
        if event is not None and self.recorder is not None:
            self._record(event, turn.durable)
            self.metrics.recorded.inc()

    def abort(self, turn: Turn) -> None:
        """The client went away before the answer: keep the partial turn, never to be trained
        on."""
        self.metrics.aborted.inc()
        if not turn.info.recorded:
            return
        turn.claim(self.sessions)
        if self.recorder is not None:
            latency_ms = (time.perf_counter() - turn.started) * 1000
            text = self.text_of(turn)
            event = self._event(turn, text, [], "abort", latency_ms, train=False)
            self._record(event, turn.durable)
            self.metrics.recorded.inc()
        if turn.info.done:
            self.close_session(turn.info.session_id)

    def _event(
        self,
        turn: Turn,
        text: str,
        calls: list[dict[str, Any]],
        finish: FinishReason,
        latency_ms: float,
        *,
        train: bool = True,
    ) -> events.Interaction:
        p = turn.params
        return events.Interaction(
            event_id=turn.event_id,
            ts_ms=turn.ts_ms if turn.ts_ms is not None else events.now_ms(),
            producer=PRODUCER,
            session_id=turn.info.session_id,
            turn=turn.turn or 0,
            policy_id=self.backend.policy_id,
            weight_version=turn.version,
            messages=turn.messages,
            tools=turn.req.tools or [],
            prompt_token_ids=turn.prompt_ids,
            response_token_ids=turn.ids,
            response_logprobs=turn.logprobs,
            response_text=text,
            sampling={
                "temperature": p.temperature,
                "top_p": p.top_p,
                "max_tokens": p.max_tokens,
                "stop": p.stop or None,
                "seed": p.seed,
            },
            finish_reason=finish,
            latency_ms=latency_ms,
            train=train,
            turn_type="main",
            session_done=turn.info.done,
            group_id=turn.info.group_id,
            user_id=turn.info.user_id,
            tool_calls=calls,
        )

    def headers(self, turn: Turn) -> dict[str, str]:
        out = {
            "X-Session-Id": header_safe(turn.info.session_id),
            "X-Liverl-Weight-Version": str(turn.version),
            "X-Liverl-Replica": header_safe(self.cfg.replica_id),
            "X-Liverl-Recorded": recorded_header(turn),
        }
        if turn.turn is not None:
            out["X-Liverl-Turn"] = str(turn.turn)
        return out

    async def complete(self, turn: Turn, request: Request | None = None) -> JSONResponse:
        """The whole answer as one JSON body. With ``request``, a client that disconnects
        first stops the generation and the partial turn is recorded as aborted (499)."""
        generation = asyncio.ensure_future(self._generate(turn))
        gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        try:
            waiting = {generation} if gone is None else {generation, gone}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            generation.cancel()
            raise
        finally:
            if gone is not None:
                gone.cancel()
        if gone is not None and gone.done() and not gone.cancelled() and gone.exception() is None:
            generation.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await generation
            self.abort(turn)
            raise ApiError(
                499,
                "the client closed the connection before the answer",
                type="invalid_request_error",
                code="client_closed_request",
            )
        await generation
        self._still_durable(turn)
        content, calls, finish = self.finish(turn, self.text_of(turn))
        try:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            body = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "system_fingerprint": f"liverl-v{turn.version}",
                "choices": [
                    {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
                ],
                "usage": self._usage(turn),
            }
            return AfterSend(body, headers=self.headers(turn), after=lambda: self.hand_over(turn))
        except BaseException:  # the answer will not go out: the turn is recorded anyway
            self.hand_over(turn)
            raise

    async def _generate(self, turn: Turn) -> None:
        async for _ in self.run(turn):
            pass

    def _usage(self, turn: Turn) -> dict[str, int]:
        n, m = len(turn.prompt_ids), len(turn.ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    async def stream(self, turn: Turn) -> AsyncIterator[bytes]:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tools = bool(turn.req.tools)

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            doc = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "system_fingerprint": f"liverl-v{turn.version}",
                "choices": [
                    {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                ],
                **extra,
            }
            return b"data: " + orjson.dumps(doc) + b"\n\n"

        streamed = ""
        try:  # one generator: its close on a disconnect runs the abort path inside
            try:
                yield chunk({"role": "assistant", "content": ""})
                async for _ in self.run(turn):
                    safe = streamable(self.text_of(turn), turn.params.stop, tools)
                    if len(safe) > len(streamed):
                        yield chunk({"content": safe[len(streamed) :]})
                        streamed = safe
            except (asyncio.CancelledError, GeneratorExit):  # the client went away
                self.abort(turn)
                raise
            except Exception as exc:  # headers are gone: report in-band, OpenAI style
                log.exception("generation failed mid-stream")
                err = ApiError(
                    502, f"generation failed: {exc}", type="server_error", code="backend_error"
                )
                yield b"data: " + orjson.dumps(err.body()) + b"\n\n"
                return
            content, calls, finish = self.finish(turn, self.text_of(turn))
            final = content or ""
            rest = final[len(streamed) :] if final.startswith(streamed) else ""
            if rest:
                yield chunk({"content": rest})
            if calls:
                yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
            yield chunk({}, finish)
            opts = turn.req.stream_options
            if opts is not None and opts.include_usage:
                doc = {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self._usage(turn),
                }
                yield b"data: " + orjson.dumps(doc) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:  # sent, or the client went away after the answer was complete
            self.hand_over(turn)


def recorded_header(turn: Turn) -> str:
    """``X-Liverl-Recorded``: the turn's event id when it is recorded (spooled, or held
    until it can be: never dropped silently), empty when it is not (``X-Liverl-Train:
    false``, a side turn, recording off, or recording failing: sent if it can be, counted in
    ``liverl_gateway_events_lost`` if not). The same header as the hook routes'."""
    return turn.event_id if turn.durable else ""


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects. The body is read already, so the server's next
    message is ``http.disconnect``, sent when the connection closes."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _inline_schema(model: type[ChatRequest]) -> dict[str, Any]:
    """The model's JSON Schema with its ``$defs`` references inlined (OpenAPI-embeddable)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.split("/")[-1]])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


def _request_schema(gateway: Gateway) -> dict[str, Any]:
    schema = _inline_schema(ChatRequest)
    names = sorted({gateway.model_name, gateway.backend.policy_id})
    schema["properties"]["model"]["enum"] = names  # only these are served (else 404)
    return schema


Handler = Callable[[Request], Awaitable[Response]]


class GatewayApp(FastAPI):
    """FastAPI with its hot route served directly.

    Chat completions read their own body (limits, OpenAI-style errors), so FastAPI's routing,
    dependency solving and middleware layers did nothing for them but cost ~0.2 ms of CPU per
    request (``bench/gateway.py``, profiled). A route in ``fast_routes`` gets the ASGI call
    straight, as a Starlette ``Request``; it must answer every failure itself (the chat handler
    does: :class:`ApiError`, and any exception as a 502). It stays declared on FastAPI too, for
    ``/openapi.json``; any other path, or a ``root_path`` deployment, goes through FastAPI."""

    fast_routes: dict[tuple[str, str], Handler]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            handler = self.fast_routes.get((scope["method"], scope["path"]))
            if handler is not None:
                scope["app"] = self
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(
    gateway: Gateway,
    on_startup: Callable[[], Any] | None = None,
    on_shutdown: Callable[[], Any] | None = None,
) -> GatewayApp:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    app = GatewayApp(
        title="liverl gateway",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.gateway = gateway
    m = gateway.metrics

    @app.exception_handler(ApiError)
    async def _api_error(_r: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_r: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(_r: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return ApiError(
            502, f"internal error: {type(exc).__name__}", type="server_error", code="backend_error"
        ).response()

    # The body is parsed by hand (OpenAI-style errors, size limits), so declare its schema
    # for clients and fuzzers (schemathesis) reading /openapi.json.
    @app.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _request_schema(gateway)}},
            }
        },
    )
    async def chat_completions(request: Request) -> Response:
        try:
            caller = gateway.auth.caller(request.headers.get("authorization"))
            gateway.limiter.check(caller.key_id)
            doc = await gateway.read_body(request)
            turn = gateway.prepare(request, doc, caller)
            if turn.req.stream:
                m.requests.labels("200").inc()
                return StreamingResponse(
                    gateway.stream(turn),
                    media_type="text/event-stream",
                    headers={
                        "Cache-Control": "no-cache",
                        "X-Session-Id": header_safe(turn.info.session_id),
                        "X-Liverl-Replica": header_safe(gateway.cfg.replica_id),
                        "X-Liverl-Recorded": recorded_header(turn),
                    },
                )
            resp = await gateway.complete(turn, request)
        except ApiError as exc:
            m.requests.labels(str(exc.status)).inc()
            return exc.response()
        except Exception as exc:  # the engine failed, not the client: a gateway error
            log.exception("generation failed")
            m.requests.labels("502").inc()
            return ApiError(
                502, f"generation failed: {exc}", type="server_error", code="backend_error"
            ).response()
        m.requests.labels("200").inc()
        return resp

    app.fast_routes = {("POST", "/v1/chat/completions"): chat_completions}

    # Next states from outside the conversation (feedback.py, hooks.py): same key check and
    # rate limit as chat; bodies bounded by next_state_max_body_bytes.
    @app.post(
        "/v1/feedback",
        response_model=None,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": FeedbackRequest.model_json_schema()}},
            }
        },
    )
    async def feedback(request: Request) -> Response:
        return await handle_feedback(gateway, request)

    @app.post(
        "/v1/hooks/{event}",
        response_model=None,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": HookPayload.model_json_schema()}},
            }
        },
    )
    async def hook(event: str, request: Request) -> Response:
        return await handle_hook(gateway, event, request)

    # Next-state sources (sources.py): one file each, enabled by [serve] sources.
    sources = build_sources(gateway.cfg.sources, gateway.cfg.source_options)

    @app.post("/v1/next_states/{source}", response_model=None)
    async def next_states(source: str, request: Request) -> Response:
        return await handle_source(gateway, sources, source, request)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        gateway.auth.key_id(request.headers.get("authorization"))
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": gateway.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "liverl",
                        "weight_version": gateway.backend.version,
                    }
                ],
            }
        )

    @app.get("/healthz")
    async def healthz(request: Request) -> JSONResponse:
        """``ok``, or 503 ``degraded`` with ``reasons`` when data would be lost or weights are
        no longer followed; ``warnings`` for what is survivable (a failed reloader poll)."""
        rec = gateway.recorder
        quarantine = rec.quarantine_problem() if isinstance(rec, Recorder) else None
        reasons = [r for r in (gateway.recording_problem(), quarantine) if r]
        warnings: list[str] = []
        for r in getattr(request.app.state, "reloader", None) or []:
            if getattr(r, "error", None):
                warnings.append(f"weights reloader: {r.error}")
            if getattr(r, "died", False):
                reasons.append("the weights reloader has stopped")
        lost = getattr(rec, "lost", 0)
        canary = getattr(gateway.backend, "canary", None)
        return JSONResponse(
            {
                "status": "degraded" if reasons else "ok",
                "reasons": reasons,
                "warnings": warnings,
                "policy_id": gateway.backend.policy_id,
                "weight_version": gateway.backend.version,
                # the canary arm beside it: {version, share of users}, null without one
                "canary": None if canary is None else {"version": canary[0], "share": canary[1]},
                "replica_id": gateway.cfg.replica_id,
                "record_backlog": rec.backlog if rec else 0,
                # answered as recorded, taken by neither the spool nor Kafka yet (in memory)
                "record_held": getattr(rec, "held", 0),
                "kafka_up": rec.kafka_up if rec else None,
                "events_lost": lost,
                "spool_error": getattr(rec, "spool_error", None),
                "spool_quarantined": getattr(rec, "quarantined", 0),
                "serve_without_training": gateway.cfg.serve_without_training,
            },
            status_code=503 if reasons else 200,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app
