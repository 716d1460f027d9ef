"""Simulated users for liverl: hidden checkable preferences, a quality guard, a session driver.

Pure Python; the session driver talks to a gateway through an ``openai.OpenAI`` client. The
capability probe (:mod:`.probe`) imports torch only when it generates or scores.
"""

from .critic import Assignment, Critic, CriticBounds
from .preferences import JARGON, PREFERENCES, Preference
from .probe import (
    PROBE,
    ProbeItem,
    ProbeResult,
    chat_prompt_ids,
    fluency,
    generate,
    is_correct,
    probe_endpoint,
    probe_model,
)
from .quality import Quality, check_quality
from .questions import QUESTIONS, Question, mentions, split
from .session import TurnResult, run_session, weight_version
from .users import Judgement, SimUser, make_users

__all__ = [
    "Assignment",
    "Critic",
    "CriticBounds",
    "JARGON",
    "PREFERENCES",
    "PROBE",
    "QUESTIONS",
    "Judgement",
    "Preference",
    "ProbeItem",
    "ProbeResult",
    "Quality",
    "Question",
    "SimUser",
    "TurnResult",
    "chat_prompt_ids",
    "check_quality",
    "fluency",
    "generate",
    "is_correct",
    "make_users",
    "mentions",
    "probe_endpoint",
    "probe_model",
    "run_session",
    "split",
    "weight_version",
]
