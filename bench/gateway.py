"""Gateway overhead: latency added over calling an SGLang-compatible backend directly.

Three processes, so the model's cost is out of the figure and the gateway is measured as it
runs in production: a fake SGLang server (``POST /generate`` answering fixed tokens with
log-probs, as SGLang does), the gateway (``build_app`` with the ``sglang`` backend and the
production uvicorn config from ``server_config``) and this client. For each concurrency (1
and 16) it times the same requests sent to the fake backend directly (the rendered prompt's
token ids, what the gateway sends it) and through the gateway (OpenAI chat completions), with
recording off and on (Kafka + spool; needs the local broker). Prints p50/p99 of each, the
added p50/p99 (gateway minus direct), the req/s ratio and the gateway's CPU per request; no
assertions. The fake streams as SGLang does (``--stream``: cumulative SSE events by default)
when asked to, and ``--max-tokens`` sets the answer's length.

The anchor, ``--openclaw-rl PATH``: OpenClaw-RL's own proxy, loaded from a checkout of its
public repository (https://github.com/Gen-Verse/OpenClaw-RL; never copied here), in front of
the same fake, timed against the fake's OpenAI endpoint where that proxy forwards.

    .venv/bin/python bench/gateway.py [--requests 400] [--modes off on] [--conc 1 16]
    .venv/bin/python bench/gateway.py --openclaw-rl ~/src/OpenClaw-RL --rounds 3
    .venv/bin/python bench/gateway.py --stacks c granian sse   # A/B of the alternatives
    .venv/bin/python bench/gateway.py --client-stream --max-tokens 200 --stream incremental
    .venv/bin/python bench/gateway.py --profile /tmp/gw.svg   # py-spy record of the gateway
    GATEWAY_BENCH_CPROFILE=/tmp/gw.prof .venv/bin/python bench/gateway.py  # cProfile, loop CPU
    GATEWAY_BENCH_LINGER_MS=20 ...   # the gateway's serve.record_linger_ms for this run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

TOPIC = "bench.gateway.interactions"  # keeps bench traffic out of the real topic
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def messages(i: int) -> list[dict[str, str]]:
    """A different prompt per request, so that no cache in the gateway flatters the figure."""
    return [SYSTEM, {"role": "user", "content": f"What is the capital of France? ({i})"}]


ANSWER = "Paris is the capital of France."


# ---- the fake SGLang server (its own process) ------------------------------------------------


def fake_sglang_app(answer: list[int], stream_mode: str = "cumulative") -> Any:
    """A bare ASGI app answering ``/generate`` like SGLang (kept minimal so that its own cost,
    paid equally by both paths, stays small): with ``"stream": true`` one SSE event per token,
    each holding every token so far (SGLang's default) or only the new one
    (``--incremental-streaming-output``, which ``/server_info`` reports); OpenAI
    ``/v1/chat/completions`` too, for the OpenClaw-RL proxy that forwards there."""

    async def respond(send: Any, body: bytes, ctype: bytes = b"application/json") -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]}
        )
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        if path == "/server_info":
            info = {"incremental_streaming_output": stream_mode == "incremental"}
            await respond(send, orjson.dumps(info))
            return
        if path == "/v1/chat/completions":
            req = orjson.loads(body)
            out = answer[: min(len(answer), req.get("max_tokens") or len(answer))]
            await respond(
                send,
                orjson.dumps(
                    {
                        "id": "chatcmpl-fake",
                        "object": "chat.completion",
                        "created": 0,
                        "model": req.get("model", "fake"),
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": ANSWER},
                                "logprobs": {
                                    "content": [{"token": str(t), "logprob": -0.5} for t in out]
                                },
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": len(out)},
                    }
                ),
            )
            return
        if path != "/generate":  # the start-up probes
            await respond(send, b"{}")
            return
        req = orjson.loads(body)
        n = min(len(answer), req["sampling_params"]["max_new_tokens"])
        out = answer[:n]
        pairs = [[-0.5, t, None] for t in out]
        finish = {"type": "stop" if n == len(answer) else "length"}

        def doc(lo: int, hi: int, last: bool) -> bytes:
            return orjson.dumps(
                {
                    "text": "",
                    "output_ids": out[lo:hi],
                    "meta_info": {
                        "finish_reason": finish if last else None,
                        "output_token_logprobs": pairs[lo:hi],
                        "prompt_tokens": len(req["input_ids"]),
                        "weight_version": "0",
                    },
                }
            )

        if not req.get("stream"):
            await respond(send, doc(0, n, True))
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for i in range(n):
            lo = i if stream_mode == "incremental" else 0
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": b"data: " + doc(lo, i + 1, i == n - 1) + b"\n\n",
                }
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def serve_fake(port: int, answer: list[int], stream_mode: str) -> None:
    import uvicorn

    with contextlib.suppress(KeyboardInterrupt):  # stopped by the bench's SIGINT
        uvicorn.run(
            fake_sglang_app(answer, stream_mode),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
        )


# ---- the gateway (its own process) -----------------------------------------------------------


def serve_gateway(
    port: int, backend_url: str, record: bool, spool: str, stack: str, stream: str
) -> None:
    import uvicorn

    from pipeline.serving.build import build_app
    from pipeline.serving.commands import _h11_header_timeout, server_config
    from pipeline.serving.settings import ServeSettings
    from pipeline.settings import Settings

    cfg = ServeSettings(
        port=port,
        backend="sglang",
        sglang_url=backend_url,
        model_path="tiny",
        policy_id="bench",
        record=record,
        reload=False,
        spool_dir=Path(spool),
        interactions_topic=TOPIC,
        turn_recovery_s=0,
        sglang_stream=stream,
        **(
            {"record_linger_ms": float(os.environ["GATEWAY_BENCH_LINGER_MS"])}
            if os.environ.get("GATEWAY_BENCH_LINGER_MS")
            else {}
        ),
    )
    # "py": uvicorn's pure-Python stack (h11, asyncio's loop), the gateway's before httptools
    # and uvloop, for an A/B in the same run.
    py = {"http": _h11_header_timeout(cfg.header_timeout_s), "loop": "asyncio"}
    if stack == "sse":  # the gateway before: every answer streamed from SGLang, whole or not
        import dataclasses

        from pipeline.serving.backends.sglang import SGLangBackend

        generate = SGLangBackend.generate

        def streamed(self: Any, ids: list[int], params: Any) -> Any:
            return generate(self, ids, dataclasses.replace(params, incremental=True))

        SGLangBackend.generate = streamed  # type: ignore[method-assign]
    if stack == "tdecode":  # the gateway before: answers decoded by transformers' decode
        from pipeline.serving import detokenizer

        detokenizer._cleans_up = lambda _tokenizer: True  # type: ignore[assignment]
    app = build_app(cfg, Settings())
    if stack == "granian":
        serve_granian(app, port)
        return
    server = uvicorn.Server(server_config(app, cfg, **(py if stack == "py" else {})))
    out = os.environ.get("GATEWAY_BENCH_CPROFILE")
    # uvicorn shuts down on the bench's SIGINT (stop()), then re-raises it: not an error here.
    with contextlib.suppress(KeyboardInterrupt):
        if not out:
            server.run()
            return
        import cProfile

        prof = cProfile.Profile(time.thread_time)  # CPU of the event loop thread, not wall time
        try:
            prof.runcall(server.run)
        finally:
            prof.dump_stats(out)


def serve_granian(app: Any, port: int) -> None:
    """The same app under granian (a Rust HTTP server; ``pip install granian``), embedded on a
    uvloop loop in this process so that its CPU is counted like uvicorn's."""
    import uvloop
    from granian.constants import Interfaces
    from granian.server.embed import Server

    server = Server(
        app, address="127.0.0.1", port=port, interface=Interfaces.ASGI, log_enabled=False
    )

    async def main() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, server.stop)
        await server.serve()

    uvloop.run(main())


def serve_openclaw_rl(port: int, backend_url: str, source: str) -> None:
    """OpenClaw-RL's own proxy (``openclaw-rl/openclaw_api_server.py`` of a checkout of
    github.com/Gen-Verse/OpenClaw-RL, loaded from there, never copied here) in front of the
    fake. It imports two names from slime (their trainer, not installed here): a tokenizer
    loader and the Sample record; both are stood in for with the same behaviour (transformers'
    AutoTokenizer; a plain record). Started by its own ``start()``, so it runs with its own
    uvicorn settings; its training samples go to a queue drained by a thread, as their rollout
    loop does. PRM scoring is off (it would call a judge model)."""
    import enum
    import importlib.util
    import queue
    import threading
    import types
    from urllib.parse import urlsplit

    from transformers import AutoTokenizer

    from pipeline.models.tiny import ensure_tiny_model

    class Sample:
        class Status(enum.Enum):
            COMPLETED = "completed"

    utils = types.ModuleType("slime.utils")
    processing = types.ModuleType("slime.utils.processing_utils")
    processing.load_tokenizer = lambda path, trust_remote_code=False: (  # type: ignore[attr-defined]
        AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    )
    types_mod = types.ModuleType("slime.utils.types")
    types_mod.Sample = Sample  # type: ignore[attr-defined]
    for name, mod in {
        "slime": types.ModuleType("slime"),
        "slime.utils": utils,
        "slime.utils.processing_utils": processing,
        "slime.utils.types": types_mod,
    }.items():
        sys.modules[name] = mod
    path = Path(source)
    if path.is_dir():
        path = path / "openclaw-rl" / "openclaw_api_server.py"
    spec = importlib.util.spec_from_file_location("openclaw_api_server", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    backend = urlsplit(backend_url)
    cli = types.SimpleNamespace(
        hf_checkpoint=str(ensure_tiny_model()),
        prm_enable=False,
        sglang_router_ip=backend.hostname,
        sglang_router_port=backend.port,
    )
    samples: queue.Queue[Any] = queue.Queue()
    enabled = threading.Event()
    enabled.set()
    os.environ.update(HOST="127.0.0.1", PORT=str(port))
    server = module.OpenClawAPIServer(cli, samples, enabled)
    threading.Thread(target=lambda: [samples.get() for _ in iter(int, 1)], daemon=True).start()
    server.start()
    with contextlib.suppress(KeyboardInterrupt):  # the bench's SIGINT
        while True:
            time.sleep(3600)
    server.stop()


# ---- the client --------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def load(
    url: str, bodies: list[bytes], conc: int, headers: list[dict[str, str]]
) -> tuple[list[float], float]:
    """Latencies (ms) of POSTing each body with ``conc`` in flight, and req/s."""
    lat: list[float] = []
    nxt = iter(range(len(bodies)))
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:

        async def worker() -> None:
            for i in nxt:
                t = time.perf_counter()
                r = await c.post(url, content=bodies[i], headers=headers[i])
                r.raise_for_status()
                lat.append((time.perf_counter() - t) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return lat, len(bodies) / (time.perf_counter() - t0)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process used so far: unlike latency, this
    does not grow when other processes load the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


def spawn(*args: str, quiet: bool = True) -> subprocess.Popen[bytes]:
    out = subprocess.DEVNULL if quiet else None
    return subprocess.Popen([sys.executable, __file__, *args], stdout=out, stderr=None)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ensure_topic() -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    from pipeline.settings import Settings

    admin = AdminClient(Settings().kafka_client_config())
    if TOPIC not in admin.list_topics(timeout=10).topics:
        for fut in admin.create_topics([NewTopic(TOPIC, 6, 1)]).values():
            fut.result(timeout=30)


def cell(
    tok: Any,
    furl: str,
    gurl: str,
    gw_pid: int,
    mode: str,
    rnd: int,
    conc: int,
    args: argparse.Namespace,
    anchor: bool = False,
) -> None:
    """One table row: the same prompts direct to the backend, then through the gateway (or,
    ``anchor``, through OpenClaw-RL's proxy: direct is then SGLang's OpenAI endpoint, where
    that proxy forwards)."""
    from pipeline.serving.chat import render_prompt

    n = args.requests if conc > 1 else max(16, args.requests // 2)
    chat = [
        orjson.dumps(
            {
                "model": "bench",
                "messages": messages(i),
                "max_tokens": args.max_tokens,
                "seed": i,
                "stream": args.client_stream,
            }
        )
        for i in range(n)
    ]
    if anchor:
        dpath, direct = "/v1/chat/completions", chat
    else:
        dpath, direct = (
            "/generate",
            [
                orjson.dumps(
                    {
                        "input_ids": render_prompt(tok, messages(i), None),
                        "return_logprob": True,
                        "stream": args.stream != "off" and args.client_stream,
                        "sampling_params": {
                            "temperature": 1.0,
                            "top_p": 1.0,
                            "max_new_tokens": args.max_tokens,
                            "sampling_seed": i,
                        },
                    }
                )
                for i in range(n)
            ],
        )
    dh = [{"content-type": "application/json"}] * n
    gh = [
        {
            "content-type": "application/json",
            "x-session-id": f"bench-{rnd}-{conc}-{i % 8}",
            "x-turn-type": "main",
        }
        for i in range(n)
    ]
    warm = min(n, 32)
    asyncio.run(load(f"{furl}{dpath}", direct[:warm], conc, dh))
    asyncio.run(load(f"{gurl}/v1/chat/completions", chat[:warm], conc, gh))
    d_lat, d_rps = asyncio.run(load(f"{furl}{dpath}", direct, conc, dh))
    c0 = cpu_s(gw_pid)
    g_lat, g_rps = asyncio.run(load(f"{gurl}/v1/chat/completions", chat, conc, gh))
    if mode.startswith("on") and not anchor:  # count the recorder's work too
        wait_delivered(gurl)
    g_cpu = (cpu_s(gw_pid) - c0) / n * 1000
    dp50, dp99 = statistics.median(d_lat), pct(d_lat, 0.99)
    gp50, gp99 = statistics.median(g_lat), pct(g_lat, 0.99)
    label = mode if anchor else f"record {mode}"
    print(
        f"{label:<14}{conc:>5}{dp50:>12.2f}{dp99:>8.2f}{gp50:>9.2f}{gp99:>8.2f}"
        f"{gp50 - dp50:>11.2f}{gp99 - dp99:>8.2f}{d_rps:>12.0f}{g_rps:>9.0f}"
        f"{g_rps / d_rps:>7.2f}{g_cpu:>8.2f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400, help="per cell (half at concurrency 1)")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=9,
        help="answer length in tokens (the fake repeats its sentence; 9: once)",
    )
    ap.add_argument(
        "--client-stream",
        action="store_true",
        help="the client asks for a streamed answer (SSE chunks); default: whole",
    )
    ap.add_argument("--modes", nargs="+", choices=["off", "on"], default=["off", "on"])
    ap.add_argument("--conc", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--rounds", type=int, default=1, help="cells repeated, interleaved")
    ap.add_argument(
        "--stacks",
        nargs="+",
        default=["c"],
        choices=["c", "py", "granian", "sse", "tdecode"],
        help="gateway HTTP stack: c = uvicorn with httptools + uvloop (production), "
        "py = uvicorn with h11 + asyncio (before), granian = granian's Rust HTTP "
        "server (pip install granian), sse = c asking SGLang to stream answers the "
        "client takes whole (before), tdecode = c decoding answers with "
        "transformers' decode (before); several: an A/B in the same run",
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="py-spy record the gateway into this file (speedscope .json or .svg)",
    )
    ap.add_argument("--_fake", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_answer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_gateway", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_backend", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_record", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--_spool", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_stack", default="c", help=argparse.SUPPRESS)
    ap.add_argument("--_openclaw", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--openclaw-rl",
        default=None,
        metavar="PATH",
        help="also measure OpenClaw-RL's proxy, the anchor: a checkout of "
        "github.com/Gen-Verse/OpenClaw-RL (or its openclaw-rl/"
        "openclaw_api_server.py), loaded from there",
    )
    ap.add_argument(
        "--stream",
        choices=["off", "cumulative", "incremental"],
        default="cumulative",
        help="how the fake SGLang answers (and the gateway and "
        "the direct client ask): cumulative SSE events (SGLang's default), "
        "incremental ones, or one JSON body",
    )
    args = ap.parse_args()
    if args._fake is not None:
        serve_fake(args._fake, [int(t) for t in args._answer.split(",")], args.stream)
        return
    if args._openclaw is not None:
        serve_openclaw_rl(args._openclaw, args._backend, args.openclaw_rl)
        return
    if args._gateway is not None:
        serve_gateway(
            args._gateway, args._backend, bool(args._record), args._spool, args._stack, args.stream
        )
        return

    from transformers import AutoTokenizer

    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.serving.chat import render_prompt
    from pipeline.stack import free_port

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    prompt = render_prompt(tok, messages(0), None)
    words = tok(ANSWER, add_special_tokens=False)["input_ids"]
    answer = [
        *(words * (args.max_tokens // len(words) + 1))[: args.max_tokens - 1],
        tok.eos_token_id,
    ]
    if "on" in args.modes:
        ensure_topic()
    fport = free_port()
    fake = spawn(
        "--_fake", str(fport), "--_answer", ",".join(map(str, answer)), "--stream", args.stream
    )
    furl = f"http://127.0.0.1:{fport}"
    wait_up(furl, fake)
    print(
        f"fake SGLang backend, tiny tokenizer, {len(prompt)} prompt tokens, answer of "
        f"{min(len(answer), args.max_tokens)} tokens; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(
        f"{'mode':<14}{'conc':>5}{'direct p50':>12}{'p99':>8}{'gw p50':>9}{'p99':>8}"
        f"{'added p50':>11}{'p99':>8}{'direct r/s':>12}{'gw r/s':>9}{'ratio':>7}"
        f"{'gw CPU':>8}"
    )
    try:
        for rnd in range(args.rounds):
            for mode in args.modes:
                for stack in args.stacks:
                    run_gateway(
                        tok,
                        furl,
                        f"{mode} {stack}" if len(args.stacks) > 1 else mode,
                        mode == "on",
                        stack,
                        rnd,
                        args,
                    )
            if args.openclaw_rl:
                run_openclaw_rl(tok, furl, rnd, args)
    finally:
        stop(fake)
    print(
        f"latencies in ms at load average {os.getloadavg()[0]:.1f}; 'added' = gateway minus "
        "direct; ratio = gateway req/s / direct req/s; gw CPU = gateway process CPU ms per "
        "request (all threads, recording included)"
    )


def run_gateway(
    tok: Any, furl: str, label: str, record: bool, stack: str, rnd: int, args: argparse.Namespace
) -> None:
    """One gateway process: every concurrency's cell against it."""
    from pipeline.stack import free_port

    with tempfile.TemporaryDirectory() as tmp:
        gport = free_port()
        gw = spawn(
            "--_gateway",
            str(gport),
            "--_backend",
            furl,
            "--_record",
            str(int(record)),
            "--_spool",
            str(Path(tmp) / "spool"),
            "--_stack",
            stack,
            "--stream",
            args.stream,
        )
        gurl = f"http://127.0.0.1:{gport}"
        wait_up(f"{gurl}/healthz", gw)
        spy = None
        try:
            for conc in args.conc:
                if args.profile and spy is None and rnd == 0 and conc == max(args.conc):
                    spy = start_profile(args.profile, gw.pid)
                cell(tok, furl, gurl, gw.pid, label, rnd, conc, args)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
                spy = None
            if record:
                backlog = wait_delivered(gurl)
                print(f"  {label}: backlog after the run {backlog} (0: all in Kafka)")
        finally:
            if spy is not None:
                spy.kill()
            stop(gw)


def run_openclaw_rl(tok: Any, furl: str, rnd: int, args: argparse.Namespace) -> None:
    """The anchor's rows: OpenClaw-RL's proxy against the same fake, main turns (the ones it
    makes training samples of)."""
    from pipeline.stack import free_port

    port = free_port()
    proc = spawn("--_openclaw", str(port), "--_backend", furl, "--openclaw-rl", args.openclaw_rl)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(f"{url}/healthz", proc)
        for conc in args.conc:
            cell(tok, furl, url, proc.pid, "OpenClaw-RL", rnd, conc, args, anchor=True)
    finally:
        stop(proc)


def wait_delivered(gurl: str) -> int:
    deadline = time.monotonic() + 60
    backlog = -1
    while time.monotonic() < deadline:
        backlog = httpx.get(f"{gurl}/healthz", timeout=5).json()["record_backlog"]
        if backlog == 0:
            break
        time.sleep(0.2)
    return backlog


def start_profile(out: str, pid: int) -> subprocess.Popen[bytes]:
    """py-spy (``pip install py-spy``) sampling every thread of the gateway while it is busy
    (.json: speedscope, .svg: flame graph, else collapsed stacks)."""
    exe = shutil.which("py-spy") or os.environ.get("PY_SPY", "py-spy")
    fmt = {".json": "speedscope", ".svg": "flamegraph"}.get(Path(out).suffix, "raw")
    cmd = [
        exe,
        "record",
        "-p",
        str(pid),
        "-o",
        out,
        "-f",
        fmt,
        "-r",
        "250",
        *os.environ.get("GATEWAY_BENCH_PYSPY", "").split(),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
