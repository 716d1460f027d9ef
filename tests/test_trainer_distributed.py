"""Data-parallel trainer (``liverl train --nproc N``, pipeline/trainer/distributed.py).

Unit: two spawned ranks (gloo, localhost rendezvous) train the same batches to the same
weights as one process, for every method and aggregate, because each rank's loss keeps the
whole batch's normaliser. Integration (real broker): ``--nproc 2`` publishes exactly once,
and a rank killed mid-step (or at random) takes every rank down without a half-published
version, after which a restart trains every sample exactly once.
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner

from pipeline.events import Producer, Sample
from pipeline.settings import Settings
from pipeline.trainer import checkpoint as ck
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import TrainerCore
from pipeline.trainer.distributed import RankGroup

from .conftest import create_topic
from .test_trainer_exactly_once import (
    PARTITIONS,
    end_offsets,
    make_sample,
    produce,
    read_table,
    start,
    tiny,  # noqa: F401 - the module-scoped tiny model fixture
    trainer_cmd,
    wait_for,
)

# Methods x aggregates x options whose normalisers differ: local per-rank normalisation
# would give other weights for each of them.
CONFIGS: list[dict[str, Any]] = [
    {"method": "rl", "aggregate": "sample_mean", "ppo_epochs": 2},
    # A = r: with the batch baseline the one-row batch trains on the KL alone, a gradient
    # too small for the relative tolerances below
    {"method": "rl", "aggregate": "token_mean", "kl_coef": 0.1, "rl_baseline": "none"},
    {"method": "hybrid", "aggregate": "token_mean", "staleness": "tis"},
    {"method": "opd", "aggregate": "seq_mean", "opd_loss": "topk"},
]
VERSION = 3  # the batches' current version: behavior version 0 is stale (> max_staleness 2)


def sample(i: int, prompt: int, response: int, **kw: Any) -> Sample:
    fields: dict[str, Any] = dict(
        event_id=f"s{i}",
        producer=Producer(component="t", version="0"),
        session_id="x",
        turn=i,
        policy_id="p",
        prompt_token_ids=[1] + [40 + (7 * i + j) % 300 for j in range(prompt - 1)],
        response_token_ids=[100 + (11 * i + j) % 300 for j in range(response)],
        loss_mask=[1] * response,
        behavior_logprobs=[-6.25 - 0.01 * j for j in range(response)],
        reward=1.0 if i % 2 else -1.0,
        behavior_weight_version=VERSION,
    )
    fields.update(kw)
    return Sample(**fields)


def batches() -> list[list[Sample]]:
    """Rows of very different lengths, masks and hints, so the two shards differ in rows
    and tokens; the second batch has a single row, so one rank trains nothing."""
    first = [
        sample(0, 4, 3, hints=["run pytest", "read the grep output first"]),
        sample(1, 9, 11),
        sample(2, 5, 4, masked=True),
        sample(3, 6, 5, behavior_weight_version=0),  # stale: dropped, or tis-weighted
        sample(4, 7, 4, loss_mask=[1, 0, 1, 1], opd_mask=[1, 1, 0, 1], hints=["check types"]),
        sample(5, 3, 3, reward=0.0, loss_mask=[0, 0, 0], opd_mask=[1, 1, 1], hints=["ls"]),
        sample(6, 5, 14, hints=["a much longer hint about the failing tests"]),
        sample(7, 12, 2, reward=1.0),
    ]
    second = [sample(8, 6, 6, hints=["run the tests first"])]
    third = [sample(9, 4, 9, hints=["use git"]), sample(10, 8, 3), sample(11, 3, 7)]
    return [first, second, third]


def settings_for(model: Path, overrides: dict[str, Any]) -> TrainerSettings:
    return TrainerSettings(
        model=str(model), device="cpu", lr=1e-3, teacher="reference", **overrides
    )


def train(core: TrainerCore) -> list[dict[str, Any]]:
    out = []
    for batch in batches():
        r = core.train_step(batch, VERSION)
        out.append(
            {
                "losses": r.losses,
                "trained_tokens": r.trained_tokens,
                "grad_norm": r.grad_norm,
                "kl": r.kl,
                "clip_fraction": r.clip_fraction,
                "status": [o.status for o in r.outcomes],
                "hints": [o.selected_hint for o in r.outcomes],
                "metrics": r.metrics,
            }
        )
    return out


def _rank_main(rank: int, port: int, model: str, out: str) -> None:
    """One rank of the unit test: every config, the same batches, saved for the parent."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=120))
    group = RankGroup.connect(rank, 2, store, "gloo", 120)
    shards: list[list[bool]] = []
    plain_shard = group.shard

    def recording(samples: Any, active: torch.Tensor, uses_opd: bool) -> torch.Tensor:
        mine = plain_shard(samples, active, uses_opd)
        shards.append(mine.tolist())
        return mine

    group.shard = recording  # type: ignore[method-assign]
    saved = []
    for overrides in CONFIGS:
        core = TrainerCore.load(settings_for(Path(model), overrides))
        group.attach(core)
        results = train(core)
        saved.append({"state": core.model.state_dict(), "results": results})
    torch.save({"configs": saved, "shards": shards}, Path(out) / f"rank{rank}.pt")
    group.close()


def run_two_ranks(model: Path, out: Path) -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    ctx = mp.spawn(_rank_main, args=(store.port, str(model), str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + 600
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish in 600 s")


def test_two_ranks_train_the_same_weights_as_one_process(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    run_two_ranks(tiny, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    initial = TrainerCore.load(settings_for(tiny, {})).model.state_dict()
    for i, overrides in enumerate(CONFIGS):
        one = TrainerCore.load(settings_for(tiny, overrides))
        expected = train(one)
        state = one.model.state_dict()
        got = [rank["configs"][i] for rank in ranks]
        for name, tensor in state.items():
            # the ranks stay bit-identical: they step on the same summed gradient
            assert torch.equal(got[0]["state"][name], got[1]["state"][name]), (overrides, name)
            # Float noise only: measured <= 1.5e-5 (top-k OPD; <= 5e-6 otherwise) of the
            # weights and <= 2e-4 of the update, where each rank normalising by its own rows
            # is off by 1e-2..6e-2 of the weights and 10-70% of the update.
            diff = (got[0]["state"][name] - tensor).norm()
            assert diff <= 5e-5 * tensor.norm(), (overrides, name)
            assert diff <= 1e-3 * (tensor - initial[name]).norm() + 1e-9, (overrides, name)
        for step, (a, b) in enumerate(zip(got[0]["results"], expected, strict=True)):
            where = f"{overrides} step {step + 1}"
            assert a["status"] == b["status"], where
            assert a["hints"] == b["hints"], where
            assert a["trained_tokens"] == b["trained_tokens"], where
            assert a["losses"] == pytest.approx(b["losses"], rel=1e-4, abs=1e-7), where
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), where
            if overrides.get("opd_loss") != "topk":  # top-k: token-weighted approximation
                assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-7), where
                assert a["clip_fraction"] == pytest.approx(b["clip_fraction"], abs=1e-6), where
                assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-4, abs=1e-6), where
        # the steps moved the weights, so equal weights say something
        assert any(not torch.allclose(state[n], initial[n]) for n in state), overrides
    # Both ranks trained rows of the first batch, not the same ones; in the single-row batch
    # one rank had nothing to train and still took part in the all-reduce.
    first, second = ranks[0]["shards"][0], ranks[1]["shards"][0]
    assert any(first) and any(second)
    assert not any(a and b for a, b in zip(first, second, strict=True))
    assert sum(ranks[0]["shards"][1]) + sum(ranks[1]["shards"][1]) == 1


def test_nproc_options_are_checked() -> None:
    from pipeline.trainer.commands import train as train_command

    runner = CliRunner()
    for args, message in [
        (["--nproc", "0"], "--nproc"),
        (["--nproc", "2", "--device", "cuda:1"], "rank r on cuda:r"),
        (["--nproc", "2", "--device", "cpu", "--dist-backend", "nccl"], "nccl backend needs"),
    ]:
        result = runner.invoke(train_command, ["--model", "tiny", *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output


# ---- integration: the real broker ------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def _gone(pids: list[int], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _ranks(lines: Any, proc: Any, log: Path) -> list[int]:
    """The rank pids the trainer prints before it is ready."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if match := re.search(r"distributed: 2 ranks, gloo backend, pids \[(\d+), (\d+)\]", line):
            return [int(match[1]), int(match[2])]
    proc.kill()
    pytest.fail(f"trainer did not start its ranks:\n{log.read_text()[-3000:]}")


def _check_published(root: Path, policy: str) -> list[dict[str, Any]]:
    """Every version on disk is whole, in the lake, and its rows' steps are contiguous."""
    assert not list((root / "weights" / policy).glob(".tmp-*"))
    versions = ck.versions(root / "weights", policy)
    for v in versions:
        ck.verify_version(ck.version_dir(root / "weights", policy, v))
    weights = sorted(r["version"] for r in read_table(root, "weights"))
    assert weights == versions == list(range(1, len(versions) + 1))
    steps = read_table(root, "gradient_steps")
    step_version = {r["step"]: r["published_version"] for r in steps}
    assert sorted(step_version) == list(range(1, len(steps) + 1))
    rows = read_table(root, "trajectories")
    for r in rows:
        assert step_version[r["step"]] == r["weight_version"]
    return rows


@pytest.mark.integration
def test_nproc_2_stops_on_sigterm_resumes_and_consumes_exactly_once(
    kafka_settings: Settings,
    admin: Any,
    unique: str,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    topic, policy = f"test.trainer.dist.{unique}", f"p-{unique}"
    create_topic(admin, topic, PARTITIONS)
    rng = random.Random(11)
    samples = [make_sample(i, policy, rng) for i in range(36)]
    produce(kafka_settings, topic, samples)
    log = tmp_path / "trainer.log"
    cmd = [*trainer_cmd(tiny, topic, policy, tmp_path, idle_s=2.0), "--nproc", "2"]
    # SIGTERM reaches rank 0 only: it finishes the step with rank 1, publishes, stops it.
    proc, lines = start(cmd, kafka_settings, log)
    pids = _ranks(lines, proc, log)
    assert wait_for(lines, "published v2", proc, timeout=120), log.read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    assert _gone(pids)
    stopped = ck.versions(tmp_path / "weights", policy)
    assert len(stopped) >= 2
    _check_published(tmp_path, policy)

    proc, lines = start(cmd, kafka_settings, log)
    pids = _ranks(lines, proc, log)
    assert wait_for(lines, f"resumed from v{stopped[-1]}", proc, timeout=120)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert _gone(pids)  # the worker was told to stop and did

    rows = _check_published(tmp_path, policy)
    assert sorted(r["event_id"] for r in rows) == sorted(s.event_id for s in samples)
    steps = read_table(tmp_path, "gradient_steps")
    assert all(r["grad_norm"] is not None for r in steps)
    assert sum(r["trained_tokens"] > 0 for r in steps) >= 3  # later ones: stale samples
    newest = ck.latest_manifest(tmp_path / "weights", policy)
    assert newest is not None and newest.offsets() == end_offsets(kafka_settings, topic)


@pytest.mark.integration
def test_a_killed_rank_stops_all_and_a_restart_trains_each_sample_once(
    kafka_settings: Settings,
    admin: Any,
    unique: str,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    topic, policy = f"test.trainer.distkill.{unique}", f"p-{unique}"
    create_topic(admin, topic, PARTITIONS)
    rng = random.Random(5)
    samples = [make_sample(i, policy, rng) for i in range(60)]
    produce(kafka_settings, topic, samples)
    log = tmp_path / "trainer.log"
    # one update per step: the crash point counts the rank's updates
    cmd = [
        *trainer_cmd(tiny, topic, policy, tmp_path, idle_s=2.0),
        "--nproc",
        "2",
        "--ppo-epochs",
        "1",
    ]

    # Rank 1 dies in its 4th step, between its backward pass and the all-reduce: rank 0 exits
    # too, and steps 1-3 are published whole (one version per step), step 4 not at all.
    os.environ["LIVERL_TRAINER_CRASH_AT"] = "rank1_step4"
    try:
        proc, lines = start(cmd, kafka_settings, log)
    finally:
        del os.environ["LIVERL_TRAINER_CRASH_AT"]
    pids = _ranks(lines, proc, log)
    assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
    assert "rank 1 exited (status 137): stopping every rank" in log.read_text()
    assert _gone(pids)
    rows = _check_published(tmp_path, policy)
    assert ck.versions(tmp_path / "weights", policy) == [1, 2, 3]
    assert (
        len(rows)
        == len({r["event_id"] for r in rows})
        == sum(r["samples"] for r in read_table(tmp_path, "gradient_steps"))
    )

    # SIGKILL rank 0 or rank 1 at random moments: the other one never outlives it.
    for kill in range(4):
        proc, lines = start(cmd, kafka_settings, log)
        pids = _ranks(lines, proc, log)
        if not wait_for(lines, "trainer ready", proc, timeout=120):
            pytest.fail(f"trainer did not start:\n{log.read_text()[-3000:]}")
        for _ in range(rng.randint(0, 2)):
            if not wait_for(lines, "published v", proc, timeout=60):
                break
        time.sleep(rng.uniform(0.0, 0.15))
        victim = pids[kill % 2]
        if _alive(victim):
            os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=60)
        assert _gone(pids), f"rank pids {pids} outlived the kill of {victim}"

    proc, _ = start(cmd, kafka_settings, log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    rows = _check_published(tmp_path, policy)
    assert sorted(r["event_id"] for r in rows) == sorted(s.event_id for s in samples)
    newest = ck.latest_manifest(tmp_path / "weights", policy)
    assert newest is not None and newest.offsets() == end_offsets(kafka_settings, topic)
