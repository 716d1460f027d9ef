"""Trainer: losses, hint selection, batching, checkpoint/publish, exactly-once bookkeeping."""
