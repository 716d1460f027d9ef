"""Plug-ins by name with their own options: judges and training methods share one pattern."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from pipeline.events import examples
from pipeline.processors.app import build_judge
from pipeline.processors.config import ProcessorSettings
from pipeline.processors.judges import LlmJudge, TurnContext, make_judge
from pipeline.registry import NoOptions, Registry, load_plugins
from pipeline.settings import load_settings

CTX = TurnContext("s", 0, "question", "answer")


class Opts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = 1


def test_registry_names_what_it_knows_and_validates_options() -> None:
    reg: Registry[str] = Registry("widget", "thing.widget")
    reg.register("a", "item-a", Opts)
    reg.register("b", "item-b")
    assert reg.names() == ["a", "b"] and "a" in reg and "c" not in reg
    assert reg.get("a").item == "item-a"
    with pytest.raises(ValueError, match=r"unknown widget 'c'; known: a, b \(thing.widget;"):
        reg.get("c")
    assert reg.options("a", {"n": 3}) == Opts(n=3)
    assert reg.options("a", None) == Opts(n=1)
    with pytest.raises(ValueError, match=r"thing.widget_options.m: Extra inputs .* takes n\)"):
        reg.options("a", {"m": 1})
    with pytest.raises(ValueError, match=r"thing.widget_options.n: Input should be a valid int"):
        reg.options("a", {"n": "many"})
    with pytest.raises(ValueError, match=r"takes no options"):
        reg.options("b", {"n": 1})
    assert isinstance(reg.options("b", {}), NoOptions)


def test_a_missing_plugin_module_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"processors plugin 'no.such' cannot be imported"):
        load_plugins(["no.such"], "processors")
    with pytest.raises(ValueError, match=r"processors plugin 'no.such' cannot be imported"):
        ProcessorSettings(plugins=["no.such"])


def test_a_judge_plugin_is_configured_from_toml(tmp_path: Path) -> None:
    config = tmp_path / "liverl.toml"
    config.write_text(
        '[processors]\nplugins = ["tests.toy_judge"]\njudge = "toy-length"\n'
        '[processors.judge_options]\nmax_chars = 10\nhint = "Shorter."\n'
    )
    cfg = load_settings(config).processors
    judge = build_judge(cfg)
    assert (judge.judge_id, judge.version) == ("toy-length", "toy-length-1")
    state = examples.examples()["next_state"]
    short = asyncio.run(judge.judge(CTX, _with(state, "ok thanks")))  # 9 chars
    long = asyncio.run(judge.judge(CTX, _with(state, "that is not it")))  # 14 chars
    assert (short.score, short.hints) == (1, [])
    assert (long.score, long.hints) == (-1, ["Shorter."])


def test_a_judge_option_typo_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"processors.judge_options.max_char: Extra inputs"):
        ProcessorSettings(
            plugins=["tests.toy_judge"], judge="toy-length", judge_options={"max_char": 3}
        )
    # the known list holds every registered judge (other tests' plug-ins too), sorted
    with pytest.raises(ValueError, match=r"unknown judge 'toy-lenght'; known: ") as typo:
        ProcessorSettings(plugins=["tests.toy_judge"], judge="toy-lenght")
    known = str(typo.value).split("known: ", 1)[1].split(" (", 1)[0].split(", ")
    assert {"llm", "panel", "replies", "toy-length"} <= set(known)
    assert known == sorted(known)


def test_the_llm_judge_takes_the_llm_fields_then_judge_options() -> None:
    cfg = ProcessorSettings(judge="llm", llm_model="m", llm_votes=3, judge_options={"votes": 5})
    judge = build_judge(cfg)
    assert isinstance(judge, LlmJudge)
    assert (judge.judge_id, judge.votes) == ("llm:m", 5)
    # a built-in without options refuses any (it used to swallow the LLM's keywords)
    with pytest.raises(ValueError, match=r"processors.judge_options.base_url"):
        make_judge("replies", base_url="http://x")


def _with(state, content: str):  # type: ignore[no-untyped-def]
    import dataclasses

    return dataclasses.replace(state, content=content, score=None, exit_code=None)


@pytest.mark.integration
def test_liverl_workers_judges_with_a_plugin_configured_from_toml(
    kafka_settings,
    unique,
    tmp_path,
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """The plug-in judge, named in a settings file, scores every turn of a real session."""
    from pipeline.kafka import EventProducer, names
    from tests.test_processors_integration import (
        RULES,
        Collector,
        drop_internal_topics,
        high_watermarks,
        input_ends,
        script,
        start_group_at,
        start_worker,
        stop,
    )

    config = tmp_path / "liverl.toml"
    config.write_text(
        '[processors]\nplugins = ["tests.toy_judge"]\njudge = "toy-length"\n'
        '[processors.judge_options]\nmax_chars = 30\nhint = "Shorter."\n'
    )
    monkeypatch.setenv("LIVERL_CONFIG", str(config))
    sid, app_id = f"plug-{unique}", f"plug-{unique}"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    start = high_watermarks(kafka_settings)
    start_group_at(kafka_settings, app_id, input_ends(kafka_settings))
    producer = EventProducer(kafka_settings, client_id="plug", partitioner="murmur2_random")
    for inter in script(sid):
        producer.send(names.INTERACTIONS, inter)
    producer.flush()
    col = Collector(kafka_settings, sid, start)
    proc = start_worker(app_id, sid, rules, tmp_path)
    try:
        col.poll_until(
            lambda by: (
                len({e.turn for e in by[names.PRM_SCORES]}) >= 5
                and len({e.turn for e in by[names.SAMPLES]}) >= 5
            ),
            proc,
        )
    finally:
        stop(proc)
        col.close()
        drop_internal_topics(kafka_settings, app_id)
    log = (tmp_path / f"{app_id}.log").read_text()[-3000:]
    prm = {e.turn: e for e in col.by_topic[names.PRM_SCORES]}
    assert len(prm) == 5, log
    assert {e.judge_id for e in prm.values()} == {"toy-length"}
    # next states: 39, 35, 35 chars of tool output, a 22-char reply, an empty session end
    assert {t: p.score for t, p in prm.items()} == {0: -1, 1: -1, 2: -1, 3: 1, 4: 1}
    # its hints reach the samples (OPD's teacher prompt), only on the turns it voted down
    hints = {e.turn: e.hints for e in col.by_topic[names.SAMPLES]}
    assert hints == {0: ["Shorter."], 1: ["Shorter."], 2: ["Shorter."], 3: [], 4: []}
