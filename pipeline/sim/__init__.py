"""Simulated users for liverl: hidden checkable preferences, a quality guard, a session driver.

Pure Python; the session driver talks to a gateway through an ``openai.OpenAI`` client.
"""

from .preferences import JARGON, PREFERENCES, Preference
from .quality import Quality, check_quality
from .questions import QUESTIONS, Question, mentions, split
from .session import TurnResult, run_session, weight_version
from .users import Judgement, SimUser, make_users

__all__ = [
    "JARGON",
    "PREFERENCES",
    "QUESTIONS",
    "Judgement",
    "Preference",
    "Quality",
    "Question",
    "SimUser",
    "TurnResult",
    "check_quality",
    "make_users",
    "mentions",
    "run_session",
    "split",
    "weight_version",
]
