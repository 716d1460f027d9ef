"""The judge agent, for judges that are not inline (the LLM PRM: slow, batched, bounded
concurrency).

It reads interactions and next states, judges each next state once its turn is known and
publishes PRM scores and hints, which the session agent then reads. Its own state per session
(``judging``) and the next states that wait for their turn (``judge_parked``) are changelogged
like the session agent's. Records are taken in batches: every ready next state of a batch is
judged concurrently (the judge bounds its own concurrency), and offsets move on after the
batch's verdicts are sent.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import faust

from pipeline import events
from pipeline.kafka import names

from . import judging, runtime
from .judges import Judge
from .judging import JudgeState
from .records import JUDGE_PARKED, JUDGING, park, parked_key, parked_next_state, touched
from .runtime import Runtime
from .state_json import StateJson


@dataclass(slots=True)
class JudgeAgentState:
    """The judge agent's value per session."""

    judging: JudgeState = field(default_factory=JudgeState)
    touched_ms: int = 0


_STATE: StateJson[JudgeAgentState] = StateJson(JudgeAgentState)


class JudgeAgent:
    """The agent body and its timers over two tables (see the module docstring)."""

    def __init__(self, rt: Runtime, judge: Judge, *, state_max_bytes: int) -> None:
        self.rt, self.judge, self.state_max_bytes = rt, judge, state_max_bytes
        self.states = rt.table(JUDGING)  # session id -> JudgeAgentState
        self.parked = rt.session_table(JUDGE_PARKED)  # as the session agent's ``parked``
        # Next-state ids being judged right now: judge_grace must not dead-letter them meanwhile.
        self.in_flight: set[str] = set()

    async def load(self, key: bytes) -> JudgeAgentState:
        """Like the session agent's: a value another code version wrote (the four-agent
        pipeline kept dicts in this table) is dead-lettered, never a crash loop."""
        state = await self.rt.read_state(self.states, key, _STATE.load, "judge state")
        return JudgeAgentState() if state is None else state

    def save(self, key: bytes, state: JudgeAgentState) -> None:
        state.touched_ms = runtime.now_ms()
        self.states[key] = _STATE.dump(state)

    async def run_judge(self, work: list[judging.JudgeWork]) -> None:
        results = await asyncio.gather(*(judging.judge_one(self.judge, w) for w in work))
        for res in results:
            await self.rt.send(names.PRM_SCORES, res.prm)
            for hint in res.hints:
                await self.rt.send(names.HINTS, hint)

    async def release_parked(self, done: list[tuple[bytes, str]]) -> None:
        """Forget parked next states once their verdicts are acknowledged. Their offsets were
        committed long ago, so until then the table entry is the only copy; a restart in
        between judges them again (the same verdict id: downstream drops it by id)."""
        await self.rt.app.producer.flush()
        for key, nid in done:
            state = await self.load(key)
            if state.judging.pending.pop(nid, None) is not None:
                self.save(key, state)
            self.parked.pop(parked_key(key, nid), None)
            self.in_flight.discard(nid)

    async def process(self, stream: faust.StreamT) -> None:
        cfg = self.rt.cfg
        async for evs in self.rt.unit_batches(stream, cfg.judge_batch, within=0.1):
            batch: list[judging.JudgeWork] = []
            unparked: list[tuple[bytes, str]] = []
            for raw_ev in evs:
                item = await self.rt.decode_one(raw_ev, ())  # the session agent dead-letters
                if item is None:
                    continue
                key, ev = item
                state = await self.load(key)
                if isinstance(ev, events.Interaction):
                    state.judging = judging.on_interaction(
                        state.judging, ev, text_chars=cfg.state_text_chars,
                        max_bytes=self.state_max_bytes,
                    )  # fmt: skip
                    for nid, entry in list(state.judging.pending.items()):
                        if entry.turn != ev.turn or nid in self.in_flight:
                            continue
                        raw = self.parked.get(parked_key(key, nid))
                        if raw is None:
                            continue
                        work = judging.take_ready(state.judging, parked_next_state(raw))
                        if work:
                            state.judging.pending[nid] = entry  # kept until acknowledged
                            self.in_flight.add(nid)
                            unparked.append((key, nid))
                            batch.append(work)
                elif isinstance(ev, events.NextState):
                    state.judging, todo = judging.on_next_state(state.judging, ev, runtime.now_ms())
                    for nxt in todo:
                        work = judging.take_ready(state.judging, nxt)
                        if work:
                            batch.append(work)
                        else:
                            self.parked[parked_key(key, nxt.event_id)] = park(raw_ev.message)
                else:
                    continue
                self.save(key, state)
            if batch:
                await self.run_judge(batch)
            if unparked:
                await self.release_parked(unparked)

    async def judge_grace(self) -> None:
        """Dead-letter next states whose turn never came within ``grace_s``."""
        grace_s = self.rt.cfg.grace_s
        for key in list(self.states.keys()):
            state = await self.load(key)
            gone = [
                n
                for n in judging.expired(state.judging, runtime.now_ms(), int(grace_s * 1000))
                if n not in self.in_flight
            ]
            if not gone:
                continue
            for nid in gone:
                turn = state.judging.pending.pop(nid).turn
                await self.rt.dead_letter_parked(self.parked, key, nid, turn)
            self.save(key, state)

    async def expire_judge_state(self) -> None:
        """Drop judge states untouched for ``retain_s``, and the parked records they left."""
        cutoff = runtime.now_ms() - int(self.rt.cfg.retain_s * 1000)
        for key, raw in list(self.states.items()):
            if touched(raw) < cutoff:
                del self.states[key]
        self.rt.drop_orphans(self.parked, self.states)
