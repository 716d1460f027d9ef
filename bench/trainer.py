"""Trainer throughput on CPU: samples/s, tokens/s and the share of wall time spent outside
forward/backward/optimizer (Kafka, checks, publishing, Delta). Prints figures; asserts nothing.

    python bench/trainer.py [--samples 2048] [--batch 16] [--publish-every default 1] [--no-kafka]
    python bench/trainer.py --model smollm2-135m-instruct --samples 64 --batch 8 \
        --prompt 128 --response 64 --methods rl --publish-every 1

``--model tiny`` (default here, full fine-tuning) or a store model (LoRA adapter: what a
version publishes is the adapter).

With Kafka (default) it needs a broker at the configured bootstrap (``liverl broker up``);
it writes to a throwaway topic and a temporary folder.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
import uuid
from pathlib import Path

from pipeline.events import Producer, Sample
from pipeline.models import store
from pipeline.models.tiny import ensure_tiny_model
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import TrainerCore


def samples(n: int, policy: str, prompt: int, response: int) -> list[Sample]:
    rng = random.Random(0)
    return [
        Sample(
            event_id=f"bench-{i}", producer=Producer(component="bench", version="0"),
            session_id=f"s{i % 64}", turn=i, policy_id=policy,
            prompt_token_ids=[rng.randrange(10, 500) for _ in range(prompt)],
            response_token_ids=[rng.randrange(10, 500) for _ in range(response)],
            loss_mask=[1] * response, behavior_logprobs=[-6.0] * response,
            reward=rng.choice([-1.0, 1.0]), hints=["run the tests first"],
            behavior_weight_version=0,
        )
        for i in range(n)
    ]


def report(label: str, n: int, tokens: int, wall: float, compute: float) -> None:
    print(
        f"{label:<28} {n / wall:8.1f} samples/s {tokens / wall:10.0f} tokens/s  "
        f"outside fwd/bwd/opt {100 * (1 - compute / wall):5.1f}%  (wall {wall:.2f}s)"
    )


def bench_core(model: Path, data: list[Sample], batch: int, method: str) -> None:
    core = TrainerCore.load(TrainerSettings(model=str(model), device="cpu", method=method,
                                            teacher="policy"))
    core.train_step(data[:batch], 0)  # warm-up
    compute, start = 0.0, time.perf_counter()
    for i in range(0, len(data), batch):
        r = core.train_step(data[i : i + batch], 0)
        compute += r.timings["compute_s"] + r.timings["optimizer_s"]
    wall = time.perf_counter() - start
    tokens = sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in data)
    report(f"core only ({method})", len(data), tokens, wall, compute)


def bench_kafka(model: Path, data: list[Sample], batch: int, publish_every: str) -> None:
    """``publish_every``: ``default`` (the settings' cadence) or N (every N steps, no
    overhead budget: the pre-budget behaviour)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from pipeline.kafka import EventProducer
    from pipeline.settings import Settings
    from pipeline.trainer.loop import TrainerLoop

    settings = Settings()
    topic = f"bench.trainer.{uuid.uuid4().hex[:8]}"
    admin = AdminClient(settings.kafka_client_config())
    for f in admin.create_topics([NewTopic(topic, 6, 1)]).values():
        f.result(30)
    try:
        producer = EventProducer(settings, client_id="bench")
        for s in data:
            producer.send(topic, s)
        producer.flush()
        idle = 1.0
        with tempfile.TemporaryDirectory() as tmp:
            cfg = TrainerSettings(
                policy="bench", model=str(model), input_topic=topic, device="cpu",
                weights_root=Path(tmp) / "w", lake_root=Path(tmp) / "lake",
                batch_max_samples=batch, batch_max_wait_s=0.2,
                exit_when_idle_s=idle,
            )
            if publish_every != "default":
                cfg.publish_every_steps, cfg.publish_max_overhead = int(publish_every), 1.0
            marks: dict[str, float] = {}

            def echo(line: str) -> None:
                for word in ("ready", "stopped"):
                    if word in line:
                        marks[word] = time.perf_counter()

            stats = TrainerLoop(settings, cfg, echo=echo).run()
            # from ready to the final publish, less the idle wait before exiting
            wall = marks["stopped"] - marks["ready"] - idle
        tokens = sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in data)
        t = stats.timings
        compute = t["compute_s"] + t["optimizer_s"]
        label = (
            "default cadence" if publish_every == "default" else f"publish/{publish_every} steps"
        )
        report(f"kafka loop, {label}", stats.samples, tokens, wall, compute)
        print(
            f"{'':<28} {stats.published} versions, {stats.steps} steps; publishing "
            f"{100 * t['publish_s'] / wall:.1f}% ({1000 * t['publish_s'] / stats.published:.0f} "
            f"ms/version), polling {100 * t['poll_s'] / wall:.1f}% of wall"
        )
    finally:
        for f in admin.delete_topics([topic]).values():
            f.result(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--publish-every", nargs="+", default=["default", "1"],
                    help="'default' (settings cadence) and/or step counts")
    ap.add_argument("--no-kafka", action="store_true")
    ap.add_argument("--model", default="tiny", help="tiny or a store model (LoRA)")
    ap.add_argument("--methods", nargs="+", default=["rl", "hybrid"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model = ensure_tiny_model(Path(tmp) / "tiny")
        else:
            model = store.resolve(args.model)
        data = samples(args.samples, "bench", args.prompt, args.response)
        kind = "full fine-tuning" if args.model == "tiny" else "LoRA r=16"
        print(f"{args.model} ({kind}), {args.samples} samples of {args.prompt}+{args.response} "
              f"tokens, batch {args.batch}, CPU")
        for method in args.methods:
            bench_core(model, data, args.batch, method)
        if not args.no_kafka:
            for every in args.publish_every:
                bench_kafka(model, data, args.batch, every)


if __name__ == "__main__":
    main()
