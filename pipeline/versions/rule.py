"""Which versions the gateways may serve, stated once: ``liverl serve``, ``liverl versions``,
``liverl status`` and the trainer (which follows the version that serves) fold the weights log
with the same ``require_promoted``, so they agree on which version that is."""

from __future__ import annotations

from typing import Any


def require_promoted(settings: Any) -> bool:
    """Promoted versions only unless ``serve.require_promoted`` says otherwise, following the
    promotion gate (``trainer.gate``) when it is unset, as ``liverl serve`` decides."""
    chosen = settings.serve.require_promoted
    return bool(settings.trainer.gate) if chosen is None else chosen is not False
