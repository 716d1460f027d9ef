"""Weight reload latency: a published version until the gateway answers with it.

For each version: the trainer's atomic writer (safetensors, sha256 manifest, fsync, rename),
then the ``weights`` event on Kafka, then the gateway's reloader (verify sha256, load into
a shadow copy, swap between requests) until an answer carries the new version. Printed
next to the floor: just reading and hashing the same files.

    LIVERL_STATE_DIR=.liverl/test .venv/bin/python bench/reload.py [--versions 10]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import torch

from pipeline import events
from pipeline.kafka import EventProducer, names
from pipeline.models.tiny import ensure_tiny_model
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.build import build_app
from pipeline.serving.settings import ServeSettings
from pipeline.serving.testing import running
from pipeline.settings import Settings
from pipeline.trainer.checkpoint import Manifest, write_version

TRAINER = events.Producer(component="bench-reload", version="1")


def _write(root: Path, model: torch.nn.Module, policy: str, version: int) -> Manifest:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 1e-3)  # a different version, same shapes
    manifest = Manifest(policy, version, version - 1 or None, version, events.now_ms(),
                        names.SAMPLES, {}, [])
    write_version(root, manifest, lambda tmp: model.save_pretrained(tmp))
    return manifest


def _read_floor(folder: Path) -> float:
    from safetensors.torch import load_file

    start = time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        hashlib.sha256(path.read_bytes()).hexdigest()
        load_file(str(path))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=10)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    settings = Settings()
    policy = f"bench-reload-{uuid.uuid4().hex[:8]}"
    model_dir = ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    backend = HFBackend(model_dir, policy_id=policy, workers=2)
    producer = EventProducer(settings, client_id="bench-reload")
    writes, floors, to_answer, totals = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = ServeSettings(record=False, reload=True, spool_dir=root / "spool")
        with running(build_app(cfg, settings, backend)) as url, httpx.Client(timeout=30) as c:
            body = {"model": policy, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1}
            c.post(f"{url}/v1/chat/completions", json=body).raise_for_status()
            for version in range(1, args.versions + 1):
                t0 = time.perf_counter()
                manifest = _write(root, model, policy, version)
                t_written = time.perf_counter()
                folder = root / policy / f"v{version}"
                producer.send(names.WEIGHTS, events.WeightsPublished(
                    event_id=events.derive_event_id("weights", [], "bench", policy, version),
                    producer=TRAINER, policy_id=policy, version=version,
                    parent=manifest.parent, uri=folder.as_uri() + "/", files=manifest.files,
                    step=version, status="candidate", consumed_offsets={},
                ), key=policy)
                producer.flush()
                t_event = time.perf_counter()
                while True:
                    reply = c.post(f"{url}/v1/chat/completions", json=body).json()
                    if reply["system_fingerprint"] == f"liverl-v{version}":
                        break
                t_served = time.perf_counter()
                writes.append(t_written - t0)
                to_answer.append(t_served - t_event)
                totals.append(t_served - t0)
                floors.append(_read_floor(folder))
                size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6

    def ms(values: list[float]) -> str:
        return f"p50 {statistics.median(values) * 1e3:7.1f} ms   max {max(values) * 1e3:7.1f} ms"

    print(f"tiny model, {size:.2f} MB of safetensors, {args.versions} versions, "
          f"Kafka {settings.bootstrap}")
    print(f"write version (atomic, fsync)       {ms(writes)}")
    print(f"weights event -> first new answer   {ms(to_answer)}")
    print(f"write + event -> first new answer   {ms(totals)}")
    print(f"floor: read + sha256 the files      {ms(floors)}")
    print(f"reload overhead over the floor: "
          f"{statistics.median(to_answer) / statistics.median(floors):.1f}x")


if __name__ == "__main__":
    main()
