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
from pathlib import Path

import click

from pipeline.kafka import names
from pipeline.settings import Settings
from pipeline.trainer.config import TrainerSettings


def _crash_hook() -> object:
    target = os.environ.get("LIVERL_TRAINER_CRASH_AT")
    if not target:
        return None

    def on_stage(stage: str) -> None:
        if stage == target:
            os._exit(137)

    return on_stage


@click.command("train")
@click.option("--policy", default="default", show_default=True,
              help="Policy id; samples of other policies are skipped.")
@click.option(
    "--model",
    default="smollm2-135m-instruct",
    show_default=True,
    help="Store model (pulled on first use), 'tiny' (built in code) or a local HF model dir.",
)
@click.option(
    "--adapter",
    type=click.Choice(["auto", "lora", "full"]),
    default="auto",
    show_default=True,
    help="Train a LoRA adapter (peft; versions are the adapter only) or every weight; "
    "auto: lora for store models, full for 'tiny' and other model dirs.",
)
@click.option("--lora-r", type=int, default=16, show_default=True, help="LoRA rank.")
@click.option("--lora-alpha", type=float, default=32.0, show_default=True)
@click.option(
    "--method", default="rl", show_default=True,
    help="Training method: rl, opd, hybrid, or one registered by a --plugin module.",
)
@click.option(
    "--plugin", "plugins", multiple=True,
    help="Python module imported before training; it may register methods and loss parts "
    "(pipeline/trainer/methods.py). Repeatable.",
)
@click.option(
    "--topic", "input_topic", default=names.SAMPLES, show_default=True, help="Input samples topic."
)
@click.option(
    "--from-delta",
    type=click.Choice(["trajectories"]),
    default=None,
    help="Offline retraining: train on rows of this lake table instead of --topic, then exit. "
    "Give the new policy its own --policy id.",
)
@click.option(
    "--where",
    default=None,
    help="With --from-delta: SQL filter on its rows (DuckDB), e.g. \"policy_id = 'default' "
    "AND reward <> 0\".",
)
@click.option(
    "--namespace", default=None, help="Train in replay namespace NAME: its samples topic, "
    "groups and weights (<state_dir>/replay/NAME/); never the live ones.",
)
@click.option(
    "--weights-root",
    type=click.Path(path_type=Path),
    default=None,
    help="Default: <state_dir>/weights.",
)
@click.option(
    "--lake-root", type=click.Path(path_type=Path), default=None, help="Default: <state_dir>/lake."
)
@click.option("--batch-samples", "batch_max_samples", type=int, default=16, show_default=True)
@click.option(
    "--batch-tokens",
    "batch_max_tokens",
    type=int,
    default=32_768,
    show_default=True,
    help="Bound on padded tokens per batch.",
)
@click.option("--batch-wait", "batch_max_wait_s", type=float, default=2.0, show_default=True,
              help="Longest a buffered sample waits for its batch to fill.")
@click.option("--batch-idle", "batch_idle_s", type=float, default=0.3, show_default=True,
              help="Train what is buffered once no sample arrived for this long (0: off).")
@click.option("--lr", type=float, default=None,
              help="Learning rate [default: 2e-4 with LoRA, 1e-5 for full fine-tuning].")
@click.option(
    "--teacher", type=click.Choice(["reference", "policy"]), default="reference", show_default=True
)
@click.option(
    "--hint-selection",
    type=click.Choice(["sequence", "token", "shortest"]),
    default="sequence",
    show_default=True,
)
@click.option(
    "--opd-loss", type=click.Choice(["token", "topk"]), default="token", show_default=True
)
@click.option("--kl-coef", type=float, default=0.0, show_default=True,
              help="Weight of the KL to the frozen reference added to the loss (0: off).")
@click.option("--w-rl", type=float, default=1.0, show_default=True)
@click.option("--w-opd", type=float, default=1.0, show_default=True)
@click.option("--staleness", type=click.Choice(["drop", "tis"]), default="drop", show_default=True)
@click.option("--old-logprobs", type=click.Choice(["engine", "trainer"]), default="engine",
              show_default=True,
              help="PPO ratio reference: the engine's recorded log-probs, or the trainer's own "
              "recomputation (slime's default).")
@click.option("--max-staleness", type=int, default=2, show_default=True)
@click.option("--publish-every-steps", type=int, default=1, show_default=True,
              help="Steps that make a version due.")
@click.option("--publish-every-s", type=float, default=60.0, show_default=True,
              help="Age of pending steps that makes a version due.")
@click.option("--publish-max-overhead", type=float, default=0.05, show_default=True,
              help="Largest share of wall time spent publishing; 1 publishes every due version "
              "at once.")
@click.option("--gate/--no-gate", default=False, show_default=True,
              help="Promote a version only without regression on held-out turns.")
@click.option("--gate-holdout", type=float, default=0.1, show_default=True,
              help="Fraction of samples held out from training for the gate.")
@click.option("--gate-tolerance", type=float, default=0.01, show_default=True,
              help="Allowed drop of the gate score (nats per token).")
@click.option("--gate-eval-samples", type=int, default=256, show_default=True,
              help="Newest held-out turns the verdict is computed on.")
@click.option("--gate-min-samples", type=int, default=16, show_default=True,
              help="Fewer held-out turns: no verdict yet (the version stays candidate).")
@click.option("--device", default="auto", show_default=True)
@click.option(
    "--precision", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True
)
@click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=False)
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes training the policy data-parallel (spawned by this command; rank "
              "r on cuda:r, or all on the CPU); rank 0 alone reads Kafka and publishes.")
@click.option("--dist-backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto",
              show_default=True, help="With --nproc > 1: auto is nccl on CUDA, gloo on the CPU.")
@click.option(
    "--exit-when-idle",
    "exit_when_idle_s",
    type=float,
    default=None,
    help="Exit after this many seconds without input (batch jobs, tests).",
)
@click.pass_context
def train(ctx: click.Context, **options: object) -> None:
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

        settings = enter_checked(settings, namespace)  # type: ignore[arg-type]
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
    if cfg.where and not cfg.from_delta:
        raise click.UsageError("--where filters --from-delta rows; give --from-delta too")
    loop = TrainerLoop(
        settings,
        cfg,
        on_stage=_crash_hook(),  # type: ignore[arg-type]
        echo=lambda line: click.echo(line, err=False),
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
