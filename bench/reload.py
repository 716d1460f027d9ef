"""Weight reload latency: a published version until the gateway answers with it.

For each version: the trainer's atomic writer (safetensors, sha256 manifest, fsync, rename),
then the ``weights`` event on Kafka, then the gateway's reloader (verify sha256, load, swap
between requests) until an answer carries the new version. Printed next to the floor: just
reading and hashing the same files. The default model versions a LoRA adapter (peft, r=16 on
every projection: the adapter is the version); ``--model tiny`` versions full weights.

    LIVERL_STATE_DIR=.liverl/test .venv/bin/python bench/reload.py [--model tiny] [--versions 10]
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
from pipeline.models import store
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.build import build_app
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running
from pipeline.settings import Settings
from pipeline.trainer.checkpoint import Manifest, write_version

TRAINER = events.Producer(component="bench-reload", version="1")


def _write(
    root: Path, model: torch.nn.Module, policy: str, version: int, base: dict[str, str] | None
) -> Manifest:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if base is None:
                p.mul_(1.0 + 1e-3)  # a different version, same shapes
            elif "lora_B" in name:
                p.normal_(0.0, 1e-3)
    manifest = Manifest(
        policy,
        version,
        version - 1 or None,
        version,
        events.now_ms(),
        names.SAMPLES,
        {},
        [],
        base_model=base,
    )

    def files(tmp: Path) -> None:
        model.save_pretrained(tmp)
        (tmp / "README.md").unlink(missing_ok=True)  # peft's model card is not served

    write_version(root, manifest, files)
    return manifest


def _policy_model(model_dir: Path, lora: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    from pipeline.trainer.config import TrainerSettings

    cfg = TrainerSettings()
    return get_peft_model(
        model,
        LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            target_modules=cfg.lora_target_modules,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        ),
    )


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
    parser.add_argument(
        "--model",
        default=store.DEFAULT_MODEL,
        help="tiny (full weights) or a store model (LoRA adapter versions)",
    )
    args = parser.parse_args()

    settings = Settings()
    policy = f"bench-reload-{uuid.uuid4().hex[:8]}"
    model_dir = store.resolve(args.model)
    lora = args.model != store.TINY
    model = _policy_model(model_dir, lora)
    base = {"path": str(model_dir), "fingerprint": store.fingerprint(model_dir)} if lora else None
    backend = HFBackend(model_dir, policy_id=policy, workers=2)
    producer = EventProducer(settings, client_id="bench-reload")
    writes, floors, to_answer, totals, to_live = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = ServeSettings(record=False, reload=True, spool_dir=root / "spool")
        with running(build_app(cfg, settings, backend)) as url, httpx.Client(timeout=30) as c:
            body = {
                "model": policy,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
            }
            c.post(f"{url}/v1/chat/completions", json=body).raise_for_status()
            for version in range(1, args.versions + 1):
                t0 = time.perf_counter()
                manifest = _write(root, model, policy, version, base)
                t_written = time.perf_counter()
                folder = root / policy / f"v{version}"
                producer.send(
                    names.WEIGHTS,
                    events.WeightsPublished(
                        event_id=events.derive_event_id("weights", [], "bench", policy, version),
                        producer=TRAINER,
                        policy_id=policy,
                        version=version,
                        parent=manifest.parent,
                        uri=folder.as_uri() + "/",
                        files=manifest.files,
                        step=version,
                        status="candidate",
                        consumed_offsets={},
                    ),
                    key=policy,
                )
                producer.flush()
                t_event = time.perf_counter()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # swapped in: /healthz names the version
                    health = c.get(f"{url}/healthz").json()
                    if health.get("weight_version") == version:
                        break
                    time.sleep(0.002)
                else:
                    raise SystemExit(f"v{version} was not loaded within 60 s")
                t_live = time.perf_counter()
                reply = c.post(f"{url}/v1/chat/completions", json=body).json()
                if reply["system_fingerprint"] != f"liverl-v{version}":
                    raise SystemExit(f"answer from {reply['system_fingerprint']}, not v{version}")
                t_served = time.perf_counter()
                writes.append(t_written - t0)
                to_answer.append(t_served - t_event)
                to_live.append(t_live - t_event)
                totals.append(t_served - t0)
                floors.append(_read_floor(folder))
                size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6

    def ms(values: list[float]) -> str:
        return f"p50 {statistics.median(values) * 1e3:7.1f} ms   max {max(values) * 1e3:7.1f} ms"

    kind = "LoRA adapter" if lora else "full weights"
    print(
        f"{args.model} ({kind}), {size:.2f} MB of safetensors per version, "
        f"{args.versions} versions, Kafka {settings.bootstrap}"
    )
    print(f"write version (atomic, fsync)       {ms(writes)}")
    print(f"weights event -> version swapped in {ms(to_live)}")
    print(f"weights event -> first new answer   {ms(to_answer)}")
    print(f"write + event -> first new answer   {ms(totals)}")
    print(f"floor: read + sha256 the files      {ms(floors)}")
    print(
        f"reload (event -> swapped in) over the floor: "
        f"{statistics.median(to_live) / statistics.median(floors):.1f}x; "
        f"with the first answer: {statistics.median(to_answer) / statistics.median(floors):.1f}x"
    )


if __name__ == "__main__":
    main()
