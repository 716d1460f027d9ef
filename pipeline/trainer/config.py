"""Trainer settings (one policy per trainer process).

The ``[trainer]`` section of ``pipeline.settings.Settings`` (``LIVERL_TRAINER_*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from pipeline.kafka import names
from pipeline.trainer.defaults import EPS, EPS_HIGH, OPD_CLIP, TIS_CAP, TOPK

# A training method's name (pipeline/trainer/methods.py registry: rl, opd, hybrid, plugins).
Method = str
# LoRA moves few parameters from zero, so it takes a larger step than full fine-tuning; 2e-4
# is the usual LoRA rate and trained SmolLM2-135M in the pilot runs without degenerating.
LORA_LR = 2e-4
FULL_LR = 1e-5
# Clip ranges, OPD advantage clip, TIS cap and top-k: stated once in trainer/defaults.py,
# the loss functions' defaults too.


class TrainerSettings(BaseModel):
    """Everything the trainer needs besides the Kafka connection."""

    policy: str = "default"
    model: str = Field(
        default="smollm2-135m-instruct",
        description="A store model name (pulled on first use), 'tiny' (built in code) or a "
        "local HF model dir.",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description="Python modules imported first; they may register methods and loss parts.",
    )
    method: Method = Field(
        # opd learned fastest in bench/learning.py (docs/benchmarks.md)
        default="opd",
        validate_default=True,  # so plugins load even for the default method
        description="Training method: opd (default), hybrid, rl or one a plugin registers.",
    )
    method_options: dict[str, Any] = Field(
        default_factory=dict,
        description="The method's own options ([trainer.method_options]), validated by the "
        "options model it registered with; its loss parts read them as x.options.",
    )
    input_topic: str = names.SAMPLES
    group_id: str | None = Field(
        default=None, description="Group for informational offset commits (lag monitoring)."
    )
    weights_root: Path = Path(".liverl/weights")
    lake_root: Path = Path(".liverl/lake")
    start: Literal["earliest", "latest"] = Field(
        default="earliest", description="Where a trainer with no manifest starts reading."
    )
    # offline retraining (pipeline/trainer/offline.py): input from a Delta table, not Kafka
    from_delta: str | None = Field(
        default=None,
        description="Train from this lake table (trajectories) instead of input_topic, then "
        "exit; the new policy gets its own weights folder.",
    )
    where: str | None = Field(
        default=None, description="SQL filter on the --from-delta rows (DuckDB syntax)."
    )
    allocate: Literal["all", "uniform", "frontier"] = Field(
        default="all",
        description="With from_delta: train on every selected row (all), or on allocate_budget "
        "of them drawn uniformly or by frontier sampling over tasks (success near 50 %).",
    )
    allocate_budget: int | None = Field(
        default=None, ge=1, description="Rows an allocation draws (allocate uniform|frontier)."
    )
    allocate_seed: int = Field(default=0, description="Seed of the allocation's draws.")

    # batching: every bound holds at once
    batch_max_samples: int = Field(default=16, ge=1)
    batch_max_tokens: int = Field(
        default=32_768, ge=2, description="Bound on padded tokens (samples x longest sequence)."
    )
    batch_max_wait_s: float = Field(default=2.0, ge=0.0)
    batch_idle_s: float = Field(
        default=0.3,
        ge=0.0,
        description="Train what is buffered once no sample arrived for this long (0: off): "
        "full batches under load, fresh weights when traffic is light.",
    )

    # what is trained: a LoRA adapter (peft) on the frozen base, or every weight
    adapter: Literal["auto", "lora", "full"] = Field(
        default="auto",
        description="auto: lora for store models (the default), full for 'tiny' and other dirs.",
    )
    lora_r: int = Field(default=16, ge=1)
    lora_alpha: float = Field(default=32.0, gt=0)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lora_target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        description="Projection names adapted (all attention and MLP ones of Llama/Qwen).",
    )

    # optimisation
    lr: float | None = Field(
        default=None, description="None: 2e-4 for a LoRA adapter, 1e-5 for full fine-tuning."
    )
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    aggregate: Literal["sample_mean", "token_mean", "seq_mean"] = Field(
        default="sample_mean",
        description="sample_mean: slime's per-sample mean, then the mean over the batch "
        "(OpenClaw-RL's launchers); token_mean: one mean over all tokens.",
    )
    old_logprobs: Literal["engine", "trainer"] = Field(
        default="engine",
        description="PPO ratio reference for fresh samples: the serving engine's recorded "
        "log-probs, or the trainer's own recomputation (detached).",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0.0,
        description="Weight of the KL to the frozen reference (k3 estimator) added to the "
        "loss; 0 leaves it out (OpenClaw-RL's launchers train without it).",
    )
    eps: float = EPS
    eps_high: float = EPS_HIGH
    lr_warmup_steps: int = Field(
        default=4,
        ge=0,
        description="Linear learning-rate warm-up over this many optimizer updates (0: none): "
        "Adam's first updates move every LoRA entry by about lr whatever the gradient.",
    )
    ppo_epochs: int = Field(
        default=4,
        ge=1,
        description="Optimizer updates per batch (PPO epochs): the clip (eps, eps_high) against "
        "the sampling log-probs bounds how far they go.",
    )
    rl_baseline: Literal["none", "batch_mean"] = Field(
        default="batch_mean",
        description="Binary RL advantage A = r - b: batch_mean subtracts the batch's mean "
        "reward (an all -1 batch is then no push-away); none: A = r.",
    )
    hybrid_combine: Literal["advantage", "loss"] = Field(
        default="advantage",
        description="advantage: OpenClaw-RL's per-token sum of the RL and OPD advantages in one "
        "clipped surrogate; loss: w_rl * L_rl + w_opd * L_opd.",
    )

    # OPD / hybrid
    teacher: Literal["reference", "policy"] = Field(
        default="reference", description="Frozen copy of --model, or the current policy."
    )
    hint_selection: Literal["sequence", "token", "shortest"] = "sequence"
    opd_loss: Literal["token", "topk"] = "token"
    topk: int = TOPK
    topk_subset: Literal["student", "teacher", "overlap"] = "student"
    opd_clip: float = OPD_CLIP
    w_rl: float = 1.0
    w_opd: float = 1.0

    # off-policy samples
    staleness: Literal["drop", "tis"] = "drop"
    max_staleness: int = Field(default=2, ge=0)
    tis_cap: float = TIS_CAP

    # publishing (docs/architecture.md#publish-cadence). A version is *due* after
    # ``publish_every_steps`` steps or ``publish_every_s`` after the last publish; a due
    # version is then published as soon as publishing stays within ``publish_max_overhead``
    # of wall time (1.0: immediately).
    publish_every_steps: int = Field(default=1, ge=1)
    publish_every_s: float = Field(default=60.0, gt=0.0)
    publish_max_overhead: float = Field(
        default=0.05,
        gt=0.0,
        le=1.0,
        description="Largest share of wall time spent publishing (weights, Delta, events, "
        "gate); the next version waits until the time since the last one is last_cost*(1-f)/f.",
    )
    save_optimizer: bool = True

    # promotion gate (on by default): candidates answer held-out prompts and the capability
    # probe freshly, judges vote candidate vs live, and only promoted versions are served
    # (see pipeline/trainer/gate.py)
    gate: bool = Field(
        default=True,
        description="Promote a version only by fresh rollouts and votes; gateways serve "
        "promoted versions (serve.require_promoted follows this by default).",
    )
    canary_share: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="Share of users (a stable hash of user id, else session id) a new servable "
        "version serves first, as a canary beside the previous version, until it is rolled "
        "out (liverl versions rollout, or the canary decider) or withdrawn; stamped on the "
        "gate's promoted verdict (on the candidate when the gate is off). 0: every new "
        "version serves everyone at once.",
    )
    gate_holdout: float = Field(
        default=0.1, ge=0.0, lt=1.0, description="Fraction of samples held out from training."
    )
    gate_eval_samples: int = Field(
        default=4,
        ge=0,
        description="Newest distinct held-out prompts answered freshly by each candidate.",
    )
    gate_min_samples: int = Field(
        default=0,
        ge=0,
        description="Fewer held-out prompts: no verdict, version stays candidate (and is not "
        "served). 0: the capability probe alone can decide.",
    )
    gate_tolerance: float = Field(
        default=0.01,
        ge=0.0,
        description="Tie margin of the hint and reward judges (nats per token).",
    )
    gate_probe: bool = Field(
        default=True, description="Judge candidates on the capability probe too."
    )
    gate_probe_questions: int = Field(
        default=8,
        ge=0,
        description="How many of the probe's questions (the first ones) each verdict asks; "
        "0: all. Every question is two rollouts of each candidate: on 2 CPU cores that is "
        "the gate's cost.",
    )
    gate_probe_file: Path | None = Field(
        default=None,
        description="Your own capability probe (JSON lines: question, answers or pattern; "
        "pipeline/sim/probe.py: load_probe) instead of the built-in 20 questions.",
    )
    gate_probe_tolerance: int = Field(
        default=1,
        ge=0,
        description="Largest drop in probe questions answered right vs live before rejection.",
    )
    gate_fluency_tolerance: float = Field(
        default=1.0,
        ge=0.0,
        description="Largest drop of mean fluency (log-prob per token of sampled answers under "
        "the frozen base) vs live before rejection, nats per token. A collapse reads -2.7 to "
        "-8.8 against the base's -1.05; a concise style alone read -1.65 after one OPD step "
        "(short answers average over their less predictable first tokens), so this catches "
        "gibberish, not a preference.",
    )
    gate_fluency_margin: float = Field(
        default=0.5,
        ge=0.0,
        description="Fluency difference per prompt counted as a tie: one sampled answer per "
        "prompt varies by a few tenths of a nat on its own.",
    )
    gate_min_decided: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="Share of the verdict's prompts that some judge must have decided (compared "
        "two scores, a tie within the margin included, or found an answer that says nothing); "
        "fewer (and always none) is no decision: the version stays a candidate, never "
        "promoted. The verdict is a majority vote over prompts; when most judges abstained "
        "it would be a majority of nothing.",
    )
    # Cumulative budgets: the tolerances above compare a candidate with the live version only,
    # so a small loss at every step passes each time and adds up; these hold every candidate
    # against a fixed reference, the base model, on the same prompts (gate.py: budget).
    gate_budget_probe: int = Field(
        default=1,
        ge=0,
        description="Most probe questions a candidate may answer right fewer than the base "
        "model does on the same questions, however many steps the loss took (the learning "
        "target: the probe within one question of the base).",
    )
    gate_budget_fluency: float = Field(
        default=0.4,
        ge=0.0,
        description="Most mean fluency (nats per token) a candidate may lose against the base "
        "model's on the same prompts. Measured runs that learned moved by at most 0.14 on the "
        "probe; the drift issue 38 saw read 0.5-0.65 below the base, with answers off topic. "
        "0.75 was tried and learned no more (docs/benchmarks.md, 2026-12-07): the figure is "
        "one sampled answer per prompt over 8-12 prompts, so its noise is of the budget's "
        "order.",
    )
    gate_budget_relevance: float = Field(
        default=0.25,
        ge=0.0,
        le=1.0,
        description="Most share of held-out prompts whose sampled answer is on topic (the "
        "on_topic reader) a candidate may lose against the base model's: with the default 4 "
        "held-out prompts, one more answer off topic than the base's.",
    )
    gate_max_new_tokens: int = Field(
        default=16,
        ge=1,
        le=512,
        description="Longest fresh answer (tokens): each one costs a forward pass of every "
        "rollout of the verdict.",
    )
    gate_temperature: float = Field(
        default=0.7, gt=0.0, description="Sampling temperature of the fluency rollouts."
    )
    gate_on_reject: Literal["rollback", "continue"] = Field(
        default="rollback",
        description="rollback: the next steps start from the live version's weights and "
        "optimizer state (a rejected candidate is never a parent); continue: train on from "
        "the rejected candidate.",
    )
    gate_llm_url: str | None = Field(
        default=None,
        description="OpenAI-compatible base URL of an LLM that votes too (None: no LLM judge).",
    )
    gate_llm_model: str = Field(default="default", description="Model name sent to it.")
    gate_llm_timeout_s: float = Field(default=30.0, gt=0.0)
    gate_judge_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Weight of each gate judge's vote in a prompt's tally (capability, "
        "fluency, hint, reward, llm; default 1).",
    )
    gate_consistency_file: Path | None = Field(
        default=None,
        description="A `liverl judges compare NAME --format json` file: a gate judge with a "
        "row of the same judge_id votes with weight max(0, log(p / (1 - p))) of that "
        "consistency p (over gate_judge_weights): a judge at 0.5 weighs 0.",
    )
    gate_consistency_live: bool = Field(
        default=False,
        description="Weight the gate's judges by their consistency now on the "
        "judge_consistency topic (`liverl judges watch` keeps it), read while the trainer "
        "runs, as log-odds like gate_consistency_file, and 0 while the watcher has the judge "
        "flagged; over gate_consistency_file for a judge the topic has.",
    )
    gate_reward_judge: str | None = Field(
        default="replies",
        description="The reward pipeline's judge (its judge_id) whose consistency row in "
        "gate_consistency_file (or on the topic) weights the gate's reward votes: recorded "
        "rewards are its verdicts. None: the reward judge matches only a row named reward.",
    )

    # devices
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto", description="auto: bf16 autocast on CUDA, fp32 on CPU."
    )
    gradient_checkpointing: bool = False
    seed: int = 0

    # data parallelism (docs/architecture.md#distributed-training; pipeline/trainer/distributed.py)
    nproc: int = Field(
        default=1,
        ge=1,
        description="Processes training the policy together (rank r on cuda:r, or all on the "
        "CPU); rank 0 alone reads Kafka and publishes. 1: a single process.",
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="auto: nccl on CUDA, gloo on the CPU."
    )
    dist_timeout_s: float = Field(
        default=300.0,
        gt=0.0,
        description="Longest a rank waits for the others in a gradient all-reduce (a hung "
        "rank) before the step fails.",
    )

    # following the operator (pipeline/trainer/follow.py): the weights log folded as the
    # gateways fold it, so the trainer trains on from the version that serves
    follow_serving: bool = Field(
        default=True,
        description="After an operator's rollback, pin or promote (liverl versions) makes "
        "another version serve, train on from it: its weights and saved optimizer state, "
        "the gate's live baseline too. Off: train on from the trainer's own newest version.",
    )
    while_pinned: Literal["pause", "train"] = Field(
        default="pause",
        description="While a version is pinned: pause (consume no sample, publish nothing; "
        "they are read after unpin, and those answered by a version more than "
        "max_staleness behind the trainer's are dropped as stale, counted like any stale "
        "sample) or train (from the pinned version, publishing candidates that do not serve "
        "while the pin holds).",
    )
    progress_every_s: float = Field(
        default=10.0,
        gt=0.0,
        description="Seconds between progress lines (a step summary, the gate's 'prompt i "
        "of n, ETA') in the log and trainer_status events.",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics (liverl_trainer_*) on this port (None: off).",
    )
    metrics_host: str = Field(
        default="127.0.0.1", description="Interface the metrics server binds to."
    )

    # process
    exit_when_idle_s: float | None = Field(
        default=None, description="Exit after this long with no input and nothing pending."
    )
    config_version: str = Field(
        default="trainer-1", description="Goes into derived event ids; bump on semantic change."
    )

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str, info: ValidationInfo) -> str:
        """Plugins (declared, hence validated, first) load before the name is checked, so a
        method they register is known; the error names ``trainer.method``."""
        from pipeline.trainer import methods

        methods.load_plugins(info.data.get("plugins") or [])
        methods.get(method)
        return method

    @model_validator(mode="after")
    def _method_options_fit(self) -> TrainerSettings:
        from pipeline.trainer import methods

        methods.options(self.method, self.method_options)
        return self

    @model_validator(mode="after")
    def _ranks_fit_devices(self) -> TrainerSettings:
        """Rank r trains on cuda:r, so several ranks need every GPU, not one named GPU."""
        if self.nproc == 1:
            return self
        if self.device.startswith("cuda:"):
            raise ValueError(
                f"nproc {self.nproc} puts rank r on cuda:r: give device 'cuda' or "
                f"'auto', not {self.device!r}"
            )
        if not self.device.startswith(("cuda", "auto")):  # cpu (or mps): gloo
            if self.dist_backend == "nccl":
                raise ValueError("the nccl backend needs CUDA devices: use gloo on the CPU")
            return self
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0 and (self.device == "cuda" or self.dist_backend == "nccl"):
            raise ValueError(f"nproc {self.nproc} on {self.device}: no GPU is visible")
        if 0 < gpus < self.nproc:
            raise ValueError(f"nproc {self.nproc} needs {self.nproc} GPUs, {gpus} visible")
        return self

    @property
    def uses_lora(self) -> bool:
        """auto: LoRA for store models (the real default), full for the tiny model and
        other local directories."""
        if self.adapter != "auto":
            return self.adapter == "lora"
        from pipeline.models.store import is_store_model

        return is_store_model(self.model)

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return LORA_LR if self.uses_lora else FULL_LR

    @property
    def app_id(self) -> str:
        """Delta application-transaction id: one per policy."""
        return f"liverl-trainer/{self.policy}"

    def under_state_dir(self, state_dir: Path) -> TrainerSettings:
        """Weights and lake roots left at their defaults follow ``state_dir``; roots set in
        settings or on the command line stay. ``liverl train`` and ``liverl report`` both
        resolve them here, so they always look at the same lake."""
        defaults = TrainerSettings()
        update: dict[str, Path] = {}
        if self.weights_root == defaults.weights_root:
            update["weights_root"] = Path(state_dir) / "weights"
        if self.lake_root == defaults.lake_root:
            update["lake_root"] = Path(state_dir) / "lake"
        return self.model_copy(update=update)
