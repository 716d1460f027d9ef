"""Default clip ranges and caps of the trainer's losses.

Shared by the settings (their defaults) and the loss functions (their keyword defaults), so
neither imports the other.
"""

from __future__ import annotations

EPS = 0.2  # PPO clip below 1 (ratio >= 1 - EPS)
EPS_HIGH = 0.28  # clip-higher above 1 (DAPO): rarer tokens may still gain
OPD_CLIP = 1.0  # the OPD per-token advantage is clipped to [-OPD_CLIP, OPD_CLIP]
TIS_CAP = 2.0  # truncated importance weights of stale samples
TOPK = 4  # top-k tokens of the teacher's distribution (OPD's top-k loss)
