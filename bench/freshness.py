"""Freshness: from the end of a session to the first answer served by weights trained on it.

Runs the whole loop (``liverl up --model tiny``, a fresh policy each time) and measures, per
session, the time from the user's closing reply (``X-Session-Done``) to the moment the
gateway first serves the version whose step consumed that session's sample (the version is
read from the Delta ``trajectories`` table afterwards; "first served" from ``/healthz``,
polled every 10 ms). Two batching rules side by side, in the same run: waiting for a full
batch or ``batch_max_wait_s`` (``--batch-idle 0``, the former behaviour) and training what is
buffered once the input has been idle for ``batch_idle_s`` (the default); each with the
measured sessions alone, and under load (background clients keep closing sessions).
Prints figures; asserts nothing.

The loop's workers are the default processors group (``liverl-rewards``), so they first work
through whatever backlog that group has on the broker: after other benchmarks wrote to the
live topics (``bench/rewards.py`` does), no session is measured until that is done. Use a
broker without that history (``liverl broker down``; remove ``.liverl/kafka/data`` and, since
the archiver refuses a lake ahead of the broker, ``.liverl/lake``; ``liverl broker up &&
liverl topics apply``); ``liverl status`` shows the group's lag.

    .venv/bin/python bench/freshness.py [--sessions 12] [--load-clients 3] [--idle 0 0.3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from pathlib import Path

import httpx

from pipeline.demo.loop import LoopConfig, running_loop
from pipeline.demo.runner import consumed_versions
from pipeline.settings import Settings


def session(client: httpx.Client, url: str, model: str, sid: str) -> float:
    """One two-turn session; returns time.time() when its closing reply was sent."""
    body = {
        "model": model,
        "max_tokens": 4,
        "temperature": 0.7,
        "messages": [{"role": "user", "content": "Say hi."}],
    }
    r = client.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": sid})
    r.raise_for_status()
    answer = r.json()["choices"][0]["message"]["content"] or ""
    body["messages"] += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Thanks, that was great!"},
    ]
    body["max_tokens"] = 1
    ended = time.time()
    client.post(
        f"{url}/chat/completions",
        json=body,
        headers={"X-Session-Id": sid, "X-Session-Done": "true"},
    ).raise_for_status()
    return ended


def trainer_figures(lake: Path, policy: str) -> str:
    """Steps, samples per step and samples trained per second (first to last step) from the
    Delta ``gradient_steps`` table: what the batching rule did to throughput."""
    from deltalake import DeltaTable

    uri = str(lake / "gradient_steps")
    if not DeltaTable.is_deltatable(uri):
        return "no steps"
    import pyarrow.compute as pc

    from pipeline.lake.reading import dataset

    rows = (
        dataset(uri)
        .to_table(columns=["samples", "ts_ms"], filter=pc.field("policy_id") == policy)
        .to_pylist()
    )
    if not rows:
        return "no steps"
    n = sum(r["samples"] for r in rows)
    span = (max(r["ts_ms"] for r in rows) - min(r["ts_ms"] for r in rows)) / 1000
    rate = f", {n / span:.1f} samples/s trained" if span > 0 else ""
    return f"{len(rows)} steps, {n / len(rows):.1f} samples/step{rate}"


def measure(
    idle_s: float, load_clients: int, sessions: int, policy: str
) -> tuple[list[float], str]:
    settings = Settings()
    state = Path(settings.state_dir)
    lake = Path(settings.trainer.under_state_dir(state).lake_root)
    loop = LoopConfig(
        policy=policy,
        method="rl",
        model="tiny",
        state_dir=state,
        batch_samples=16,
        batch_wait_s=2.0,
        extra_env={
            "LIVERL_TRAINER_BATCH_IDLE_S": str(idle_s),
            "LIVERL_TRAINER_PUBLISH_MAX_OVERHEAD": "0.5",
        },
    )
    first_seen: dict[int, float] = {}
    stop = threading.Event()  # the version poller
    stop_load = threading.Event()  # the background clients
    with running_loop(loop) as running:
        base = running.url.removesuffix("/v1")

        def poll() -> None:
            with httpx.Client(timeout=5) as c:
                while not stop.is_set():
                    try:
                        v = c.get(f"{base}/healthz").json().get("weight_version")
                    except (httpx.HTTPError, ValueError):
                        v = None
                    if isinstance(v, int) and v not in first_seen:
                        first_seen[v] = time.time()
                    time.sleep(0.01)

        def background() -> None:
            with httpx.Client(timeout=30) as c:
                while not stop_load.is_set():
                    session(c, running.url, policy, f"load-{uuid.uuid4().hex[:8]}")

        threads = [threading.Thread(target=poll, daemon=True)]
        threads += [threading.Thread(target=background, daemon=True) for _ in range(load_clients)]
        for t in threads:
            t.start()
        ended: dict[str, float] = {}
        with httpx.Client(timeout=30) as c:
            for i in range(sessions):
                sid = f"fresh-{i}-{uuid.uuid4().hex[:6]}"
                ended[sid] = session(c, running.url, policy, sid)
                seen = len(first_seen)
                deadline = time.time() + 8  # wait for the next version (or give up)
                while len(first_seen) == seen and time.time() < deadline:
                    time.sleep(0.02)
                time.sleep(0.3)
        stop_load.set()
        # A loaded loop may still be working through the measured sessions: keep watching
        # versions until each one's training step is in the lake and served (bounded).
        deadline = time.time() + 180
        consumed: dict[str, int] = {}
        while time.time() < deadline:
            consumed = consumed_versions(lake, policy)
            if all(consumed.get(sid) in first_seen for sid in ended):
                break
            time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(timeout=35)
    consumed = consumed_versions(lake, policy)
    missing = [sid for sid in ended if consumed.get(sid) not in first_seen]
    if missing:
        print(
            f"  {len(missing)} session(s) without a served version: consumed "
            f"{[consumed.get(s) for s in missing]}, versions seen {sorted(first_seen)}"
        )
    out = []
    for sid, at in ended.items():
        v = consumed.get(sid)
        if v is not None and v in first_seen and first_seen[v] >= at:
            out.append(first_seen[v] - at)
    return out, trainer_figures(lake, policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--load-clients", type=int, default=3)
    ap.add_argument(
        "--idle",
        nargs="+",
        type=float,
        default=[0.0, 0.3],
        help="batch_idle_s values to compare (0: wait for a full batch)",
    )
    args = ap.parse_args()
    print(f"tiny model, batch 16, batch_max_wait_s 2.0, {args.sessions} measured sessions")
    for load in (0, args.load_clients):
        for idle_s in args.idle:
            policy = f"bench-fresh-i{idle_s:g}-l{load}-{time.strftime('%H%M%S')}"
            fresh, trained = measure(idle_s, load, args.sessions, policy)
            what = "alone" if not load else f"under load ({load} clients)"
            if not fresh:
                print(f"batch_idle_s {idle_s:<4g} {what:<24} no session measured")
                continue
            print(
                f"batch_idle_s {idle_s:<4g} {what:<24} freshness p50 "
                f"{statistics.median(fresh):.2f} s, max {max(fresh):.2f} s "
                f"({len(fresh)}/{args.sessions} sessions); trainer: {trained}",
                flush=True,
            )


if __name__ == "__main__":
    main()
