"""The ``liverl judges compare --format json`` file, read in one place: the panel judge and
the trainer's promotion gate both weight judges by it, so both get the same checks (size,
shape, consistency in [0, 1]) and the same errors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from .consistency import log_odds_weight

MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class JudgeRow:
    judge_id: str
    judge_version: str
    consistency: float
    decided: int  # agree + disagree: the evidence behind the score
    # Flagged by `liverl judges watch` and not recovered (the topic says so; a compare file
    # never does): weight 0 in panels and the promotion gate whatever its consistency.
    excluded: bool = False
    recent: float | None = None  # consistency over the judge's last decided matches (topic)

    @property
    def weight(self) -> float:
        """Its vote weight: 0 while excluded, else the log-odds of its consistency."""
        return 0.0 if self.excluded else log_odds_weight(self.consistency)


def read_compare_file(path: Path) -> list[JudgeRow]:
    """The file's rows; ``ValueError`` naming the file and the problem otherwise."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the consistency file ({exc.strerror})") from exc
    if len(raw) > MAX_BYTES:
        raise ValueError(f"{path}: larger than {MAX_BYTES} bytes")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    rows = doc.get("judges") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: no 'judges' list (write it with liverl judges compare "
                         "NAME --format json)")  # fmt: skip
    out = []
    for r in rows:
        try:
            c = float(r["consistency"])
            row = JudgeRow(str(r["judge_id"]), str(r["judge_version"]), c,
                           int(r.get("agree", 0)) + int(r.get("disagree", 0)))  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: a judges row without judge_id, judge_version and a "
                             f"numeric consistency: {r!r:.200}") from exc  # fmt: skip
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"{path}: consistency {c} of {row.judge_id} is not in [0, 1]")
        out.append(row)
    return out
