"""Trainer throughput on CPU: samples/s, tokens/s and the share of wall time spent outside
forward/backward/optimizer (Kafka, checks, publishing, Delta). Prints figures; asserts nothing.

    python bench/trainer.py [--samples 2048] [--batch 16] [--publish-every default 1] [--no-kafka]
    python bench/trainer.py --model smollm2-135m-instruct --samples 64 --batch 8 \
        --prompt 128 --response 64 --methods rl --publish-every 1
    python bench/trainer.py --nproc 1 2 --threads 1   # data-parallel ranks (train --nproc)

With ``--nproc 2`` the ranks share the machine's cores (each takes cores/N threads), so on a
small CPU box the figures show the cost of the protocol (batch broadcast, gradient all-reduce,
waiting for the slower shard: "sync"), not a speed-up; N GPUs are where N ranks pay. Compare
with a single process on as many threads as one rank (``--threads``): on a busy machine,
torch's default (every core) can be several times slower than one thread.

``--model tiny`` (default here, full fine-tuning) or a store model (LoRA adapter: what a
version publishes is the adapter).

With Kafka (default) it needs a broker at the configured bootstrap (``liverl broker up``);
it writes to a throwaway topic and a temporary folder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import tempfile
import time
import uuid
from pathlib import Path

import torch

from pipeline.events import Producer, Sample
from pipeline.models import store
from pipeline.models.tiny import ensure_tiny_model
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import StepResult, TrainerCore
from pipeline.trainer.distributed import spawn_ranks


def samples(n: int, policy: str, prompt: int, response: int) -> list[Sample]:
    rng = random.Random(0)
    return [
        Sample(
            event_id=f"bench-{i}",
            producer=Producer(component="bench", version="0"),
            session_id=f"s{i % 64}",
            turn=i,
            policy_id=policy,
            prompt_token_ids=[rng.randrange(10, 500) for _ in range(prompt)],
            response_token_ids=[rng.randrange(10, 500) for _ in range(response)],
            loss_mask=[1] * response,
            behavior_logprobs=[-6.0] * response,
            reward=rng.choice([-1.0, 1.0]),
            hints=["run the tests first"],
            behavior_weight_version=0,
        )
        for i in range(n)
    ]


def report(label: str, n: int, tokens: int, wall: float, compute: float) -> None:
    print(
        f"{label:<28} {n / wall:8.1f} samples/s {tokens / wall:10.0f} tokens/s  "
        f"outside fwd/bwd/opt {100 * (1 - compute / wall):5.1f}%  (wall {wall:.2f}s)"
    )


def bench_core(model: Path, data: list[Sample], batch: int, method: str, nproc: int = 1) -> None:
    """One process, or rank 0 of ``nproc`` (the others spawned, as ``liverl train`` does):
    each batch is broadcast, trained in shards and its gradients summed."""
    cfg = TrainerSettings(
        model=str(model), device="cpu", method=method, teacher="policy", nproc=nproc
    )
    with contextlib.ExitStack() as stack:
        group = None
        if nproc > 1:
            threads = torch.get_num_threads()
            stack.callback(torch.set_num_threads, threads)
            group = stack.enter_context(spawn_ranks(cfg, lambda _line: None))
            core = group.load_core(cfg, None, 0)
        else:
            core = TrainerCore.load(cfg)

        def step(rows: list[Sample]) -> StepResult:
            if group is not None:
                group.send_step(rows, 0)
            return core.train_step(rows, 0)

        step(data[:batch])  # warm-up
        compute = sync = 0.0
        start = time.perf_counter()
        for i in range(0, len(data), batch):
            r = step(data[i : i + batch])
            compute += r.timings["compute_s"] + r.timings["optimizer_s"]
            sync += r.timings.get("sync_s", 0.0)
        wall = time.perf_counter() - start
    tokens = sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in data)
    report(f"core only ({method}), nproc {nproc}", len(data), tokens, wall, compute)
    if nproc > 1:
        print(f"{'':<28} gradient all-reduce and metrics {100 * sync / wall:.1f}% of wall")


def bench_kafka(
    model: Path,
    data: list[Sample],
    batch: int,
    publish_every: str,
    nproc: int = 1,
    batch_idle_s: float | None = None,
) -> None:
    """``publish_every``: ``default`` (the settings' cadence) or N (every N steps, no
    overhead budget: the pre-budget behaviour); ``nproc``: ranks, as ``liverl train``;
    ``batch_idle_s``: the idle trigger (None: the settings' default). The samples are all in
    the topic before the trainer starts: a backlog, the trainer's load at its limit."""
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
                policy="bench",
                model=str(model),
                input_topic=topic,
                device="cpu",
                weights_root=Path(tmp) / "w",
                lake_root=Path(tmp) / "lake",
                batch_max_samples=batch,
                batch_max_wait_s=0.2,
                exit_when_idle_s=idle,
                nproc=nproc,
            )
            if publish_every != "default":
                cfg.publish_every_steps, cfg.publish_max_overhead = int(publish_every), 1.0
            if batch_idle_s is not None:
                cfg.batch_idle_s = batch_idle_s
            marks: dict[str, float] = {}

            def echo(line: str) -> None:
                for word in ("ready", "stopped"):
                    if word in line:
                        marks[word] = time.perf_counter()

            threads = torch.get_num_threads()  # ranks share the cores; restored after
            stats = TrainerLoop(settings, cfg, echo=echo).run()
            torch.set_num_threads(threads)
            # from ready to the final publish, less the idle wait before exiting
            wall = marks["stopped"] - marks["ready"] - idle
        tokens = sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in data)
        t = stats.timings
        compute = t["compute_s"] + t["optimizer_s"]
        label = (
            "default cadence" if publish_every == "default" else f"publish/{publish_every} steps"
        )
        if batch_idle_s is not None:
            label += f", idle {batch_idle_s:g} s"
        report(f"kafka loop, {label}, nproc {nproc}", stats.samples, tokens, wall, compute)
        print(
            f"{'':<28} {stats.published} versions, {stats.steps} steps "
            f"({stats.samples / max(1, stats.steps):.1f} samples each); publishing "
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
    ap.add_argument(
        "--publish-every",
        nargs="+",
        default=["default", "1"],
        help="'default' (settings cadence) and/or step counts",
    )
    ap.add_argument("--no-kafka", action="store_true")
    ap.add_argument(
        "--batch-idle",
        nargs="+",
        type=float,
        default=None,
        help="batch_idle_s values to compare on the Kafka backlog (e.g. 0 0.3: "
        "does the idle trigger shrink batches when the input is never idle?)",
    )
    ap.add_argument("--model", default="tiny", help="tiny or a store model (LoRA)")
    ap.add_argument("--methods", nargs="+", default=["rl", "hybrid"])
    ap.add_argument(
        "--nproc",
        nargs="+",
        type=int,
        default=[1],
        help="rank counts to compare, e.g. 1 2 (CPU: the ranks share the cores)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of a single process (default: torch's, all cores); "
        "ranks always take cores/N each",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model = ensure_tiny_model(Path(tmp) / "tiny")
        else:
            model = store.resolve(args.model)
        data = samples(args.samples, "bench", args.prompt, args.response)
        kind = "full fine-tuning" if args.model == "tiny" else "LoRA r=16"
        print(
            f"{args.model} ({kind}), {args.samples} samples of {args.prompt}+{args.response} "
            f"tokens, batch {args.batch}, CPU ({os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads for nproc 1)"
        )
        for method in args.methods:
            for nproc in args.nproc:
                bench_core(model, data, args.batch, method, nproc)
        if not args.no_kafka:
            for every in args.publish_every:
                for nproc in args.nproc:
                    for idle in args.batch_idle or [None]:
                        bench_kafka(model, data, args.batch, every, nproc, idle)


if __name__ == "__main__":
    main()
