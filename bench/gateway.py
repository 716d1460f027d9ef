"""Gateway overhead: latency added over calling an SGLang-compatible backend directly.

Three processes, so the model's cost is out of the figure and the gateway is measured as it
runs in production: a fake SGLang server (``POST /generate`` answering fixed tokens with
log-probs, as SGLang does), the gateway (``build_app`` with the ``sglang`` backend and the
production uvicorn config from ``server_config``) and this client. For each concurrency (1
and 16) it times the same requests sent to the fake backend directly (the rendered prompt's
token ids, what the gateway sends it) and through the gateway (OpenAI chat completions), with
recording off and on (Kafka + spool; needs the local broker). Prints p50/p99 of each, the
added p50/p99 (gateway minus direct) and the req/s ratio; no assertions.

    .venv/bin/python bench/gateway.py [--requests 400] [--modes off on] [--conc 1 16]
    .venv/bin/python bench/gateway.py --profile /tmp/gw.svg   # py-spy record of the gateway
    GATEWAY_BENCH_CPROFILE=/tmp/gw.prof .venv/bin/python bench/gateway.py  # cProfile, loop CPU
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


def fake_sglang_app(answer: list[int]) -> Any:
    """A bare ASGI app answering ``/generate`` like SGLang (kept minimal so that its own cost,
    paid equally by both paths, stays small)."""

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
        if scope["path"] != "/generate":  # the start-up probe
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        req = orjson.loads(body)
        n = min(len(answer), req["sampling_params"]["max_new_tokens"])
        out = answer[:n]
        doc = orjson.dumps({
            "text": "",
            "output_ids": out,
            "meta_info": {
                "finish_reason": {"type": "stop" if n == len(answer) else "length"},
                "output_token_logprobs": [[-0.5, t, None] for t in out],
                "prompt_tokens": len(req["input_ids"]),
                "weight_version": "0",
            },
        })
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": doc})

    return app


def serve_fake(port: int, answer: list[int]) -> None:
    import uvicorn

    with contextlib.suppress(KeyboardInterrupt):  # stopped by the bench's SIGINT
        uvicorn.run(fake_sglang_app(answer), host="127.0.0.1", port=port,
                    log_level="warning", access_log=False)


# ---- the gateway (its own process) -----------------------------------------------------------


def serve_gateway(port: int, backend_url: str, record: bool, spool: str, stack: str) -> None:
    import uvicorn

    from pipeline.serving.build import build_app
    from pipeline.serving.commands import _h11_header_timeout, server_config
    from pipeline.serving.settings import ServeSettings
    from pipeline.settings import Settings

    cfg = ServeSettings(
        port=port, backend="sglang", sglang_url=backend_url, model_path="tiny", policy_id="bench",
        record=record, reload=False, spool_dir=Path(spool), interactions_topic=TOPIC,
        turn_recovery_s=0,
    )
    # "py": uvicorn's pure-Python stack (h11, asyncio's loop), the gateway's before httptools
    # and uvloop, for an A/B in the same run.
    py = {"http": _h11_header_timeout(cfg.header_timeout_s), "loop": "asyncio"}
    server = uvicorn.Server(server_config(build_app(cfg, Settings()), cfg,
                                          **(py if stack == "py" else {})))
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


# ---- the client --------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def load(url: str, bodies: list[bytes], conc: int, headers: list[dict[str, str]]
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


def cell(tok: Any, furl: str, gurl: str, gw_pid: int, mode: str, rnd: int, conc: int,
         args: argparse.Namespace) -> None:
    """One table row: the same prompts direct to the backend, then through the gateway."""
    from pipeline.serving.chat import render_prompt

    n = args.requests if conc > 1 else max(16, args.requests // 2)
    direct = [orjson.dumps({
        "input_ids": render_prompt(tok, messages(i), None), "return_logprob": True,
        "stream": False, "sampling_params": {"temperature": 1.0, "top_p": 1.0,
                                             "max_new_tokens": args.max_tokens,
                                             "sampling_seed": i}}) for i in range(n)]
    chat = [orjson.dumps({"model": "bench", "messages": messages(i),
                          "max_tokens": args.max_tokens, "seed": i}) for i in range(n)]
    dh = [{"content-type": "application/json"}] * n
    gh = [{"content-type": "application/json", "x-session-id": f"bench-{rnd}-{conc}-{i % 8}"}
          for i in range(n)]
    warm = min(n, 32)
    asyncio.run(load(f"{furl}/generate", direct[:warm], conc, dh))
    asyncio.run(load(f"{gurl}/v1/chat/completions", chat[:warm], conc, gh))
    d_lat, d_rps = asyncio.run(load(f"{furl}/generate", direct, conc, dh))
    c0 = cpu_s(gw_pid)
    g_lat, g_rps = asyncio.run(load(f"{gurl}/v1/chat/completions", chat, conc, gh))
    if mode.startswith("on"):  # count the recorder's work for these requests too
        wait_delivered(gurl)
    g_cpu = (cpu_s(gw_pid) - c0) / n * 1000
    dp50, dp99 = statistics.median(d_lat), pct(d_lat, 0.99)
    gp50, gp99 = statistics.median(g_lat), pct(g_lat, 0.99)
    print(f"record {mode:<7}{conc:>5}{dp50:>12.2f}{dp99:>8.2f}{gp50:>9.2f}{gp99:>8.2f}"
          f"{gp50 - dp50:>11.2f}{gp99 - dp99:>8.2f}{d_rps:>12.0f}{g_rps:>9.0f}"
          f"{g_rps / d_rps:>7.2f}{g_cpu:>8.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400, help="per cell (half at concurrency 1)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--modes", nargs="+", choices=["off", "on"], default=["off", "on"])
    ap.add_argument("--conc", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--rounds", type=int, default=1, help="cells repeated, interleaved")
    ap.add_argument("--stacks", nargs="+", choices=["c", "py"], default=["c"],
                    help="gateway HTTP stack: c = httptools + uvloop (production), py = h11 + "
                    "asyncio (before); several: an A/B in the same run")
    ap.add_argument("--profile", default=None,
                    help="py-spy record the gateway into this file (speedscope .json or .svg)")
    ap.add_argument("--_fake", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_answer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_gateway", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_backend", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_record", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--_spool", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_stack", default="c", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._fake is not None:
        serve_fake(args._fake, [int(t) for t in args._answer.split(",")])
        return
    if args._gateway is not None:
        serve_gateway(args._gateway, args._backend, bool(args._record), args._spool,
                      args._stack)
        return

    from transformers import AutoTokenizer

    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.serving.chat import render_prompt
    from pipeline.stack import free_port

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    prompt = render_prompt(tok, messages(0), None)
    answer = tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    if "on" in args.modes:
        ensure_topic()
    fport = free_port()
    fake = spawn("--_fake", str(fport), "--_answer", ",".join(map(str, answer)))
    furl = f"http://127.0.0.1:{fport}"
    wait_up(furl, fake)
    print(f"fake SGLang backend, tiny tokenizer, {len(prompt)} prompt tokens, answer of "
          f"{min(len(answer), args.max_tokens)} tokens; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'mode':<14}{'conc':>5}{'direct p50':>12}{'p99':>8}{'gw p50':>9}{'p99':>8}"
          f"{'added p50':>11}{'p99':>8}{'direct r/s':>12}{'gw r/s':>9}{'ratio':>7}"
          f"{'gw CPU':>8}")
    try:
        for rnd in range(args.rounds):
            for mode in args.modes:
                for stack in args.stacks:
                    run_gateway(tok, furl, f"{mode} {stack}" if len(args.stacks) > 1 else mode,
                                mode == "on", stack, rnd, args)
    finally:
        stop(fake)
    print(f"latencies in ms at load average {os.getloadavg()[0]:.1f}; 'added' = gateway minus "
          "direct; ratio = gateway req/s / direct req/s; gw CPU = gateway process CPU ms per "
          "request (all threads, recording included)")


def run_gateway(tok: Any, furl: str, label: str, record: bool, stack: str, rnd: int,
                args: argparse.Namespace) -> None:
    """One gateway process: every concurrency's cell against it."""
    from pipeline.stack import free_port

    with tempfile.TemporaryDirectory() as tmp:
        gport = free_port()
        gw = spawn("--_gateway", str(gport), "--_backend", furl, "--_record", str(int(record)),
                   "--_spool", str(Path(tmp) / "spool"), "--_stack", stack)
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
    cmd = [exe, "record", "-p", str(pid), "-o", out, "-f", fmt, "-r", "250"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
