"""``liverl train``: the click command (registered in ``pipeline.cli``).

``LIVERL_TRAINER_CRASH_AT=<stage>`` kills the process (``os._exit``) when the publish
protocol reaches that stage (``before_rename``, ``after_folder``, ``after_delta_trajectories``,
``after_delta_gradient_steps``, ``after_delta_weights``, ``after_events``, with the gate
``after_verdict_file``, ``after_delta_verdict``, ``after_verdict_event``, then
``after_offsets``): a test hook for exactly-once, inert unless set. With ``--nproc``,
``rank<R>_step<K>`` kills rank R in its K-th step (``pipeline/trainer/distributed.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from pipeline.options import field_option
from pipeline.settings import Settings
from pipeline.trainer.config import FULL_LR, LORA_LR, TrainerSettings

FC = TypeVar("FC", bound=Callable[..., Any])


def _crash_hook() -> Callable[[str], None] | None:
    target = os.environ.get("LIVERL_TRAINER_CRASH_AT")
    if not target:
        return None

    def on_stage(stage: str) -> None:
        if stage == target:
            os._exit(137)

    return on_stage


def _sci(value: float) -> str:
    """``2e-4``, not ``0.0002`` or ``2e-04``."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def _option(field: str, *param_decls: str, **attrs: Any) -> Callable[[FC], FC]:
    return field_option(TrainerSettings, field, *param_decls, **attrs)


@click.command("train")
@_option("policy", "--policy", help="Policy id; samples of other policies are skipped.")
@_option(
    "model",
    "--model",
    help="Store model (pulled on first use), 'tiny' (built in code) or a local HF model dir.",
)
@_option(
    "adapter",
    "--adapter",
    help="Train a LoRA adapter (peft; versions are the adapter only) or every weight; "
    "auto: lora for store models, full for 'tiny' and other model dirs.",
)
@_option("lora_r", "--lora-r", help="LoRA rank.")
@_option("lora_alpha", "--lora-alpha")
@_option(
    "method",
    "--method",
    help="Training method: rl, opd, hybrid, or one registered by a --plugin module.",
)
@_option(
    "plugins",
    "--plugin",
    multiple=True,
    show_default=False,
    help="Python module imported before training; it may register methods and loss parts "
    "(pipeline/trainer/methods.py). Repeatable.",
)
@_option("input_topic", "--topic", help="Input samples topic.")
@_option(
    "from_delta",
    "--from-delta",
    type=click.Choice(["trajectories"]),
    help="Offline retraining: train on rows of this lake table instead of --topic, then exit. "
    "Give the new policy its own --policy id.",
)
@_option(
    "where",
    "--where",
    help="With --from-delta: SQL filter on its rows (DuckDB), e.g. \"policy_id = 'default' "
    'AND reward <> 0".',
)
@_option(
    "allocate",
    "--allocate",
    type=click.Choice(["all", "uniform", "frontier"]),
    help="With --from-delta: train on every selected row, or on --budget of them drawn "
    "uniformly or by frontier sampling (tasks solved near 50 % get the most; recorded per "
    "row in the lake's allocations table).",
)
@_option(
    "allocate_budget",
    "--budget",
    type=click.IntRange(min=1),
    help="Rows --allocate uniform|frontier draws.",
)
@_option("allocate_seed", "--allocate-seed", help="Seed of the allocation's draws.")
@click.option(
    "--namespace",
    default=None,
    help="Train in replay namespace NAME: its samples topic, "
    "groups and weights (<state_dir>/replay/NAME/); never the live ones.",
)
@_option(  # the field's default is a placeholder that under_state_dir() relocates
    "weights_root",
    "--weights-root",
    type=click.Path(path_type=Path),
    default=None,
    help="Default: <state_dir>/weights.",
)
@_option(
    "lake_root",
    "--lake-root",
    type=click.Path(path_type=Path),
    default=None,
    help="Default: <state_dir>/lake.",
)
@_option("batch_max_samples", "--batch-samples")
@_option("batch_max_tokens", "--batch-tokens", help="Bound on padded tokens per batch.")
@_option(
    "batch_max_wait_s",
    "--batch-wait",
    help="Longest a buffered sample waits for its batch to fill.",
)
@_option(
    "batch_idle_s",
    "--batch-idle",
    help="Train what is buffered once no sample arrived for this long (0: off).",
)
@_option(
    "lr",
    "--lr",
    type=float,
    help=f"Learning rate [default: {_sci(LORA_LR)} with LoRA, {_sci(FULL_LR)} for full "
    "fine-tuning].",
)
@_option("teacher", "--teacher")
@_option("hint_selection", "--hint-selection")
@_option("opd_loss", "--opd-loss")
@_option(
    "kl_coef",
    "--kl-coef",
    help="Weight of the KL to the frozen reference added to the loss (0: off).",
)
@_option("w_rl", "--w-rl")
@_option("w_opd", "--w-opd")
@_option("staleness", "--staleness")
@_option(
    "old_logprobs",
    "--old-logprobs",
    help="PPO ratio reference: the engine's recorded log-probs, or the trainer's own "
    "recomputation (slime's default).",
)
@_option("max_staleness", "--max-staleness")
@_option(
    "ppo_epochs",
    "--ppo-epochs",
    type=click.IntRange(min=1),
    help="Optimizer updates per batch, clipped against the sampling log-probs.",
)
@_option(
    "lr_warmup_steps",
    "--lr-warmup-steps",
    type=click.IntRange(min=0),
    help="Linear learning-rate warm-up over this many updates (0: none).",
)
@_option(
    "rl_baseline",
    "--rl-baseline",
    help="Binary RL advantage A = r - b: the batch's mean reward, or none (A = r).",
)
@_option(
    "hybrid_combine",
    "--hybrid-combine",
    help="hybrid: RL and OPD advantages added per token in one clip, or the two losses summed.",
)
@_option("publish_every_steps", "--publish-every-steps", help="Steps that make a version due.")
@_option(
    "publish_every_s", "--publish-every-s", help="Age of pending steps that makes a version due."
)
@_option(
    "publish_max_overhead",
    "--publish-max-overhead",
    help="Largest share of wall time spent publishing; 1 publishes every due version at once.",
)
@_option(
    "gate",
    "--gate/--no-gate",
    help="Promote a version only by fresh rollouts and judges' votes against the live "
    "one (held-out prompts and the capability probe); gateways serve promoted versions.",
)
@_option(
    "gate_holdout",
    "--gate-holdout",
    help="Fraction of samples held out from training for the gate.",
)
@_option(
    "gate_tolerance",
    "--gate-tolerance",
    help="Tie margin of the hint and reward judges (nats per token).",
)
@_option(
    "gate_eval_samples",
    "--gate-eval-samples",
    help="Newest distinct held-out prompts each candidate answers freshly.",
)
@_option(
    "gate_min_samples",
    "--gate-min-samples",
    help="Fewer held-out prompts: no verdict yet (the version stays candidate).",
)
@_option(
    "gate_probe_file",
    "--gate-probe-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Your own capability probe (JSON lines: question, answers or pattern).",
)
@_option(
    "gate_probe_tolerance",
    "--gate-probe-tolerance",
    help="Probe questions a candidate may lose against live before it is rejected.",
)
@_option(
    "gate_fluency_tolerance",
    "--gate-fluency-tolerance",
    help="Fluency drop (nats per token of sampled answers under the base) allowed.",
)
@_option(
    "gate_on_reject",
    "--gate-on-reject",
    help="rollback: after a rejection, train on from the live version's weights and "
    "optimizer state; continue: from the rejected candidate.",
)
@_option("device", "--device")
@_option("precision", "--precision")
@_option("gradient_checkpointing", "--gradient-checkpointing/--no-gradient-checkpointing")
@_option(
    "nproc",
    "--nproc",
    type=click.IntRange(min=1),
    help="Processes training the policy data-parallel (spawned by this command; rank "
    "r on cuda:r, or all on the CPU); rank 0 alone reads Kafka and publishes.",
)
@_option(
    "dist_backend",
    "--dist-backend",
    help="With --nproc > 1: auto is nccl on CUDA, gloo on the CPU.",
)
@_option(
    "follow_serving",
    "--follow-serving/--no-follow-serving",
    help="After an operator's rollback, pin or promote, train on from the version that "
    "serves (its weights and optimizer state).",
)
@_option(
    "while_pinned",
    "--while-pinned",
    help="While a version is pinned: pause (samples wait for unpin) or train (from the "
    "pinned version; its candidates do not serve while the pin holds).",
)
@_option(
    "metrics_port",
    "--metrics-port",
    type=int,
    help="Serve Prometheus metrics (liverl_trainer_*) on this port.",
)
@_option("metrics_host", "--metrics-host", help="Interface the metrics server binds to.")
@_option(
    "exit_when_idle_s",
    "--exit-when-idle",
    type=float,
    help="Exit after this many seconds without input (batch jobs, tests).",
)
@click.pass_context
def train(ctx: click.Context, **options: Any) -> None:
    """Train the --policy from the samples topic and publish versioned weights.

    With --from-delta, train from history instead (offline retraining): the selected rows
    of the lake table, deduplicated by event id, are trained once in a fixed order with
    the same exactly-once publishing, and the command exits when they are consumed.

    \b
    See docs/architecture.md#training-losses
    and docs/architecture.md#exactly-once-publishing.
    """
    from pipeline.options import explicit, merged
    from pipeline.trainer.loop import TrainerLoop, install_signal_handlers

    namespace = options.pop("namespace", None)
    settings: Settings = (ctx.obj or {}).get("settings") or Settings()
    if namespace or settings.kafka.namespace:
        from pipeline.replay.namespace import enter_checked

        settings = enter_checked(settings, namespace)
    from pydantic import ValidationError

    try:
        cfg: TrainerSettings = merged(settings.trainer, ctx, options).under_state_dir(
            settings.state_dir
        )
    except ValidationError as exc:  # e.g. an unknown --method: one line, no traceback
        raise click.UsageError("; ".join(e["msg"] for e in exc.errors())) from None
    if settings.kafka.namespace:
        from pipeline.replay.namespace import trainer_settings

        cfg = trainer_settings(cfg, settings, explicit(ctx, options))
    from pipeline.durable import writable_problem

    for root in (cfg.weights_root, cfg.lake_root):
        if (problem := writable_problem(Path(root))) is not None:
            raise click.ClickException(
                f"{problem}; set --weights-root/--lake-root or state_dir (LIVERL_STATE_DIR)"
            )
    if cfg.allocate != "all" and not cfg.from_delta:
        raise click.UsageError("--allocate draws from --from-delta rows; give --from-delta too")
    if cfg.allocate != "all" and cfg.allocate_budget is None:
        raise click.UsageError(f"--allocate {cfg.allocate} needs --budget N")
    if cfg.where and not cfg.from_delta:
        raise click.UsageError("--where filters --from-delta rows; give --from-delta too")
    from pipeline.versions.rule import require_promoted

    loop = TrainerLoop(
        settings,
        cfg,
        on_stage=_crash_hook(),
        echo=lambda line: click.echo(line, err=False),
        require_promoted=require_promoted(settings),
    )
    try:
        install_signal_handlers(loop)
    except ValueError as exc:  # a bad LIVERL_TRAINER_SHUTDOWN_S
        raise click.UsageError(str(exc)) from None
    from pipeline.trainer.offline import OfflineInputError

    try:
        stats = loop.run()
    except OfflineInputError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(
        f"done: {stats.steps} steps, {stats.samples} samples, {stats.published} versions, "
        f"{stats.dead_lettered} dead-lettered, {stats.dropped_stale} stale dropped, "
        f"{stats.duplicates} duplicates skipped"
    )


if __name__ == "__main__":
    train()
