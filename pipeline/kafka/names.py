"""Topic names used in code; ``tests/test_topics.py`` checks them against ``topics/``."""

INTERACTIONS = "liverl.interactions.v1"
NEXT_STATES = "liverl.next_states.v1"
PRM_SCORES = "liverl.prm_scores.v1"
HINTS = "liverl.hints.v1"
PATH_PENALTIES = "liverl.path_penalties.v1"
REWARDS = "liverl.rewards.v1"
SAMPLES = "liverl.samples.v1"
GRADIENT_STEPS = "liverl.gradient_steps.v1"
WEIGHTS = "liverl.weights.v1"
SERVING_STATUS = "liverl.serving_status.v1"
DLQ = "liverl.dlq.v1"

ALL = (
    INTERACTIONS,
    NEXT_STATES,
    PRM_SCORES,
    HINTS,
    PATH_PENALTIES,
    REWARDS,
    SAMPLES,
    GRADIENT_STEPS,
    WEIGHTS,
    SERVING_STATUS,
    DLQ,
)
