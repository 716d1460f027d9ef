"""Two versions served at once (issue 39 item 2): the hf backend's arms (two adapters over one
base, a rollout that loads nothing again, the base again), the gateway's routing by user or
session, the reloader following a canary's start, rollout and withdraw with a report per arm,
and the SGLang backend's two adapters against the fake server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import pytest
import torch

from pipeline import events
from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.base import Done, Piece, SamplingParams
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.settings import ServeSettings
from pipeline.serving.threaded import running
from pipeline.versions.table import arm_fraction

from .test_serving_hf import FakeRecorder, write_version
from .test_versions import act, on_disk, weights

if TYPE_CHECKING:
    from pipeline.serving.backends.base import Backend

MODULE = "model.layers.0.self_attn.q_proj"


def write_adapter(root: Path, version: int, scale: float) -> Path:
    """A peft-layout LoRA folder for the tiny model: one q_proj adapter of rank 2, its
    B filled with ``scale`` (a different answer per scale)."""
    from safetensors.torch import save_file

    out = root / f"a{version}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]})
    )
    gen = torch.Generator().manual_seed(version)
    save_file(
        {
            f"base_model.model.{MODULE}.lora_A.weight": torch.randn(2, 64, generator=gen),
            f"base_model.model.{MODULE}.lora_B.weight": torch.full((64, 2), scale),
        },
        str(out / "adapter_model.safetensors"),
    )
    return out


@pytest.fixture
def tiny() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), policy_id="p", workers=4)


def answer(backend: HFBackend, canary: bool) -> tuple[list[int], list[float], int]:
    async def go() -> tuple[list[int], list[float], int]:
        ids: list[int] = []
        lps: list[float] = []
        version = -1
        async for item in backend.generate(
            [1, 2, 3, 4], SamplingParams(max_tokens=6, temperature=0.0), canary=canary
        ):
            if isinstance(item, Piece):
                ids += item.token_ids
                lps += item.logprobs
            elif isinstance(item, Done):
                version = item.weight_version
        return ids, lps, version

    return asyncio.run(go())


# ---- the hf backend's two arms --------------------------------------------------------------


def test_hf_serves_two_adapters_at_once_and_a_rollout_loads_nothing_again(
    tiny: HFBackend, tmp_path: Path
) -> None:
    base_ids, base_lps, v = answer(tiny, canary=True)
    assert v == 0, "no canary loaded: the canary arm is the stable one"
    asyncio.run(tiny.reload(write_adapter(tmp_path, 1, 0.5), 1))
    stable_alone = answer(tiny, canary=False)
    asyncio.run(tiny.load_canary(write_adapter(tmp_path, 2, -0.5), 2, 0.3))
    assert tiny.canary == (2, 0.3) and tiny.version == 1

    async def both() -> list[Any]:
        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(
                *(loop.run_in_executor(None, answer, tiny, c) for c in (False, True, False, True))
            )
        )

    got = asyncio.run(both())
    assert [g[2] for g in got] == [1, 2, 1, 2], "each request answered by its arm's version"
    assert got[0][1] == pytest.approx(stable_alone[1], abs=1e-5), (
        "a stable request beside canary ones computes exactly what it did alone"
    )
    assert got[1][1] != pytest.approx(got[0][1], abs=1e-3), "the canary's adapter applies"
    canary_adapter = tiny._canary[0] if tiny._canary else None  # type: ignore[index]
    asyncio.run(tiny.reload(tmp_path / "does-not-exist", 2))  # rollout: nothing read
    assert tiny.version == 2 and tiny._live == canary_adapter
    asyncio.run(tiny.drop_canary())
    assert tiny.canary is None and answer(tiny, canary=True)[2] == 2
    asyncio.run(tiny.serve_base())
    ids, lps, v = answer(tiny, canary=False)
    assert (ids, v) == (base_ids, 0) and lps == pytest.approx(base_lps, abs=1e-5)


def test_hf_full_weight_canary_is_a_second_model_and_older_versions_load(
    tiny: HFBackend, tmp_path: Path
) -> None:
    asyncio.run(tiny.reload(write_version(tmp_path, tiny, 3, scale=1.0), 3))
    stable_model = tiny._live[0]
    asyncio.run(tiny.load_canary(write_version(tmp_path, tiny, 4, scale=0.5), 4, 0.5))
    assert tiny._canary is not None and tiny._canary[0][0] is not stable_model
    assert answer(tiny, canary=True)[2] == 4 and answer(tiny, canary=False)[2] == 3
    asyncio.run(tiny.load_canary(tmp_path / "v4", 4, 0.2))  # the same version: its share
    assert tiny.canary == (4, 0.2)
    asyncio.run(tiny.reload(write_version(tmp_path, tiny, 2, scale=1.0), 2))
    assert tiny.version == 2, "an older version loads when the reloader says so"


# ---- the gateway's routing ------------------------------------------------------------------


def test_each_request_is_answered_by_its_users_arm(tiny: HFBackend, tmp_path: Path) -> None:
    asyncio.run(tiny.reload(write_adapter(tmp_path, 1, 0.5), 1))
    asyncio.run(tiny.load_canary(write_adapter(tmp_path, 2, -0.5), 2, 0.5))
    gw = Gateway(ServeSettings(record=False, reload=False), tiny, FakeRecorder())  # type: ignore[arg-type]
    sessions = [f"s-{i}" for i in range(12)]
    # alice 0.171 < 0.5: canary; bob 0.507 >= 0.5: stable (tests/test_versions_canary.py)
    users = {"alice": 2, "bob": 1}
    with running(create_app(gw)) as url, httpx.Client(base_url=url, timeout=60) as c:

        def ask(headers: dict[str, str]) -> int:
            r = c.post(
                "/v1/chat/completions",
                headers=headers,
                json={
                    "model": "p",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
            )
            assert r.status_code == 200, r.text
            return int(r.headers["X-Liverl-Weight-Version"])

        by_session = {s: ask({"X-Session-Id": s}) for s in sessions}
        by_user = {u: ask({"X-Session-Id": "shared", "X-Liverl-User": u}) for u in users}
        health = c.get("/healthz").json()
    assert by_session == {s: 2 if arm_fraction(s) < 0.5 else 1 for s in sessions}
    assert set(by_session.values()) == {1, 2}, "this key set has users on both arms"
    assert by_user == users, "the user, not the session, picks the arm"
    assert health["weight_version"] == 1 and health["canary"] == {"version": 2, "share": 0.5}


# ---- the reloader ---------------------------------------------------------------------------


class ArmsBackend:
    """Records what each arm was told; a version whose folder lacks its files fails in the
    reloader's check, before the backend sees it."""

    def __init__(self, refuse_canary: set[int] | None = None) -> None:
        self.policy_id = "p"
        self.version = 0
        self.canary: tuple[int, float] | None = None
        self.calls: list[tuple[str, int, float]] = []
        self.refuse = refuse_canary or set()

    async def reload(self, path: Path, version: int) -> None:
        self.version = version
        self.calls.append(("stable", version, 1.0))

    async def load_canary(self, path: Path, version: int, share: float) -> None:
        if version in self.refuse:
            raise RuntimeError("full weights cannot be a canary here")
        self.canary = (version, share)
        self.calls.append(("canary", version, share))

    async def drop_canary(self) -> None:
        self.canary = None
        self.calls.append(("drop", self.version, 0.0))

    async def serve_base(self) -> None:
        self.version = 0
        self.calls.append(("base", 0, 1.0))


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(5)


def canary_weights(root: Path, v: int, share: float) -> list[events.WeightsPublished]:
    verdict = on_disk(root, weights(v, "promoted"))
    verdict.canary_share = share
    return [on_disk(root, weights(v)), verdict]


def test_the_reloader_follows_a_canary_through_rollout_and_withdraw(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    from pipeline.serving.reloader import Reloader
    from pipeline.settings import Settings

    backend = ArmsBackend()
    statuses: list[events.ServingStatus] = []
    r = Reloader(
        Settings(),
        cast("Backend", backend),
        loop,
        replica_id="r0",
        require_promoted=True,
        emit=lambda _topic, ev: statuses.append(ev),
    )
    for ev in [
        on_disk(tmp_path, weights(1)),
        on_disk(tmp_path, weights(1, "promoted")),
        *canary_weights(tmp_path, 2, 0.1),
        *canary_weights(tmp_path, 3, 0.2),
    ]:
        r.log.add(ev)
    assert r.load_newest() == 1 and backend.canary == (2, 0.1)
    assert r.load_newest() is None and len(backend.calls) == 2, "nothing moves: no call"
    act(r.log, "rollout", 2, by="canary")
    assert r.load_newest() == 2 and backend.canary == (3, 0.2), "v3's turn"
    act(r.log, "withdraw", 3, by="canary")
    assert r.load_newest() is None and backend.canary is None and backend.version == 2
    act(r.log, "withdraw", 2, by="watch", reason="regressed")
    r.load_newest()
    act(r.log, "withdraw", 1, by="watch")
    r.load_newest()
    assert backend.calls == [
        ("stable", 1, 1.0),
        ("canary", 2, 0.1),
        ("stable", 2, 1.0),
        ("canary", 3, 0.2),
        ("drop", 2, 0.0),
        ("stable", 1, 1.0),
        ("base", 0, 1.0),
    ]
    assert [(s.arm, s.version, s.ok) for s in statuses] == [
        ("stable", 1, True),
        ("canary", 2, True),
        ("stable", 2, True),
        ("canary", 3, True),
        ("canary", 2, True),  # the canary arm dropped: its users are answered by v2
        ("stable", 1, True),
        ("stable", 0, True),
    ]
    assert len({s.event_id for s in statuses}) == len(statuses)
    for s in statuses:
        events.decode(events.encode(s), expected_type="serving_status")


def test_a_canary_the_backend_cannot_hold_keeps_its_users_on_stable_until_rolled_out(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    from pipeline.serving.reloader import Reloader
    from pipeline.settings import Settings

    backend = ArmsBackend(refuse_canary={2})
    statuses: list[events.ServingStatus] = []
    r = Reloader(
        Settings(),
        cast("Backend", backend),
        loop,
        replica_id="r0",
        require_promoted=True,
        emit=lambda _topic, ev: statuses.append(ev),
    )
    for ev in [
        on_disk(tmp_path, weights(1)),
        on_disk(tmp_path, weights(1, "promoted")),
        *canary_weights(tmp_path, 2, 0.1),
    ]:
        r.log.add(ev)
    r.load_newest()
    r.load_newest()
    assert backend.canary is None and backend.version == 1 and r.canary_failed == {2}
    assert [(s.arm, s.version, s.ok) for s in statuses] == [
        ("stable", 1, True),
        ("canary", 1, False),
    ]
    act(r.log, "rollout", 2, by="ops")
    assert r.load_newest() == 2, "the stable arm may load what the canary arm could not"


# ---- SGLang: both arms as adapters ----------------------------------------------------------


def test_sglang_serves_both_arms_as_adapters(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.serving.backends.sglang import SGLangBackend, SGLangError

    from .test_serving_sglang import fake_sglang

    path = ensure_tiny_model()
    app, state = fake_sglang(AutoTokenizer.from_pretrained(path))
    dirs = {}
    for v in (1, 2):
        dirs[v] = tmp_path / f"v{v}"
        dirs[v].mkdir()
        (dirs[v] / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')

    async def go(url: str) -> None:
        backend = SGLangBackend(url, path, policy_id="pol")

        async def served(canary: bool) -> tuple[str | None, int]:
            items = [
                i
                async for i in backend.generate([1, 2], SamplingParams(max_tokens=2), canary=canary)
            ]
            return state["requests"][-1].get("lora_path"), items[-1].weight_version

        await backend.reload(dirs[1], 1)
        await backend.load_canary(dirs[2], 2, 0.1)
        assert set(state["adapters"]) == {"pol-v1", "pol-v2"}
        assert await served(False) == ("pol-v1", 1) and await served(True) == ("pol-v2", 2)
        loads = len(state["lora_calls"])
        await backend.reload(dirs[2], 2)  # rollout: the canary's adapter, not loaded again
        assert len(state["lora_calls"]) == loads + 1, "one call: v1 unloaded, nothing loaded"
        assert state["lora_calls"][-1] == ("unload", {"lora_name": "pol-v1"})
        await backend.drop_canary()
        assert await served(True) == ("pol-v2", 2) and set(state["adapters"]) == {"pol-v2"}
        full = tmp_path / "full"
        full.mkdir()
        with pytest.raises(SGLangError, match="cannot be a canary"):
            await backend.load_canary(full, 3, 0.1)
        await backend.serve_base()
        assert await served(False) == (None, 0) and state["adapters"] == {}
        await backend.close()

    with running(app) as url:
        asyncio.run(go(url))
