"""Where the project's contracts live: the topic specs (``topics/*.yaml``) and the event
schemas (``schemas/*.json``).

They stay at the top of the checkout, where people edit them and review their diffs. A wheel
carries a copy as package data under ``pipeline/_contracts/`` (setup.py's build step puts it
there), so an installed liverl (a Docker image, a registry package) starts without a checkout;
an editable install has no such copy and reads the checkout's folders.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Literal

Contract = Literal["topics", "schemas"]
_CHECKOUT = Path(__file__).resolve().parents[1]


def contracts_dir(kind: Contract) -> Path:
    """The folder of ``kind``: the wheel's copy when there is one, else the checkout's."""
    shipped = Path(str(files("pipeline") / "_contracts" / kind))
    return shipped if shipped.is_dir() else _CHECKOUT / kind
