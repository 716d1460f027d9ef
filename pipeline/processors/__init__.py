"""Reward pipeline: next-state pairing, judges, path penalties, rewards and samples.

The logic lives in pure modules (``pairing``, ``judges``, ``penalties``, ``rewards``) that are
unit-testable without Kafka; ``app`` wires them into Faust agents and ``commands`` exposes the
``liverl workers`` and ``liverl record-outcome`` commands.
"""
