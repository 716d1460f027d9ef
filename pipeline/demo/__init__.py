"""``liverl demo``: simulated users teach the live policy their preference, visibly."""

from pipeline.demo.runner import DemoConfig, DemoResult, DemoRunner, sessions_until_met

__all__ = ["DemoConfig", "DemoResult", "DemoRunner", "sessions_until_met"]
