"""The restart soak (issue 37), on the real broker: two exactly-once workers over the session
topics' six partitions, killed and restarted while 100 five-turn sessions flow from four
clients for 100 s — a kill every ~9 s, the restart 3 s later, every third restart killed again
while it starts or recovers. Every interaction must end with exactly one reward and one sample
(by event id), nothing dead-lettered. Before the offset ledger (``ledger_consumer.py``) such a
run lost turns silently: the committed offset passed records no unit processed (2 of 500 in a
run of this test with the workers of 7ed65b3). Each table write the workers buffer waits 0.12 s
before the producer takes it, as on a loaded machine: with Faust's own buffer a commit then
left a session's state write for the next transaction, and a kill lost the session (339 of
500 turns in ``bench/results/eos-soak-2026-12-07c.txt``; ``producer_buffer.py``).
``bench/eos_soak.py`` is the soak; it runs longer ones."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipeline.settings import Settings
from tests import bench_module

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_killed_and_restarted_workers_lose_and_double_no_turn(
    kafka_settings: Settings, unique: str, tmp_path: Path
) -> None:
    soak = bench_module.load("eos_soak")
    plan = soak.SoakPlan(sessions=100, send_s=100.0, seed=random.randrange(1 << 30),
                         slow_table_writes_s=0.12)  # fmt: skip
    result = soak.run_soak(kafka_settings, plan, str(tmp_path), app_id=f"soak-{unique}")
    detail = f"seed {plan.seed}: {result.summary()}\n{result.log_tail}"
    assert result.kills >= 8 and result.recovery_kills >= 2, detail
    assert result.workers_alive, detail
    assert result.dead_letters == [], detail
    assert result.missing_reward == [] and result.missing_sample == [], detail
    assert result.second_reward_id == [] and result.second_sample_id == [], detail
