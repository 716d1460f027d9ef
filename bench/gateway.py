"""Gateway overhead: latency added over calling the backend directly, and throughput.

Prints p50/p99 of (gateway HTTP round trip) and of (direct in-process backend call) for the
same prompt, seed and max_tokens, at concurrency 1 and 32, with recording on (Kafka + spool)
and off. Needs the local broker for recording on (``liverl broker up``); no assertions.

    .venv/bin/python bench/gateway.py [--requests 64] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import _support  # noqa: F401  (puts tests/support on the path)
import httpx
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline.models.tiny import ensure_tiny_model
from pipeline.serving.backends.base import SamplingParams
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.build import build_app
from pipeline.serving.chat import render_prompt
from pipeline.serving.settings import ServeSettings
from pipeline.settings import Settings
from tests.support.serving import running

TOPIC = "bench.gateway.interactions"  # keeps bench traffic out of the real topic
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France? Answer briefly."}]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def direct(
    backend: HFBackend, n: int, conc: int, max_tokens: int
) -> tuple[list[float], float]:
    prompt = render_prompt(backend.tokenizer, MESSAGES, None)
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            t = time.perf_counter()
            async for _ in backend.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=i)):
                pass
            lat.append((time.perf_counter() - t) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return lat, n / (time.perf_counter() - t0)


async def via_gateway(url: str, model: str, n: int, conc: int, max_tokens: int
                      ) -> tuple[list[float], float]:
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:

        async def one(i: int) -> None:
            async with sem:
                t = time.perf_counter()
                r = await c.post(f"{url}/v1/chat/completions", json={
                    "model": model, "messages": MESSAGES, "max_tokens": max_tokens, "seed": i},
                    headers={"X-Session-Id": f"bench-{i % 8}"})
                r.raise_for_status()
                lat.append((time.perf_counter() - t) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
    return lat, n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    path = ensure_tiny_model()
    kafka = Settings()
    admin = AdminClient(kafka.kafka_client_config())
    if TOPIC not in admin.list_topics(timeout=10).topics:
        for fut in admin.create_topics([NewTopic(TOPIC, 6, 1)]).values():
            fut.result(timeout=30)
    print(f"tiny model, max_tokens={args.max_tokens}, {args.requests} requests per cell")
    print(f"{'mode':<14}{'conc':>5}{'direct p50':>12}{'p99':>8}{'gw p50':>9}{'p99':>8}"
          f"{'added p50':>11}{'p99':>8}{'gw req/s':>10}{'direct req/s':>14}")
    for record in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            backend = HFBackend(path, workers=4)
            cfg = ServeSettings(record=record, reload=False, spool_dir=Path(tmp) / "spool",
                                interactions_topic=TOPIC)
            app = build_app(cfg, kafka, backend)
            with running(app) as url:
                for conc in (1, 32):
                    n = args.requests if conc > 1 else max(16, args.requests // 2)
                    asyncio.run(via_gateway(url, backend.policy_id, 4, 1, args.max_tokens))
                    d_lat, d_rps = asyncio.run(direct(backend, n, conc, args.max_tokens))
                    g_lat, g_rps = asyncio.run(via_gateway(url, backend.policy_id, n, conc,
                                                           args.max_tokens))
                    dp50, dp99 = statistics.median(d_lat), pct(d_lat, 0.99)
                    gp50, gp99 = statistics.median(g_lat), pct(g_lat, 0.99)
                    mode = "record on" if record else "record off"
                    print(f"{mode:<14}{conc:>5}{dp50:>12.1f}{dp99:>8.1f}{gp50:>9.1f}{gp99:>8.1f}"
                          f"{gp50 - dp50:>11.1f}{gp99 - dp99:>8.1f}{g_rps:>10.1f}{d_rps:>14.1f}")
                if record:
                    rec = app.state.recorder
                    deadline = time.monotonic() + 30
                    while rec.backlog and time.monotonic() < deadline:
                        time.sleep(0.1)
                    print(f"recorded and delivered to Kafka: {rec.delivered}, "
                          f"backlog {rec.backlog}")
    print("latencies in ms; 'added' = gateway minus direct backend call (same tokens)")


if __name__ == "__main__":
    main()
