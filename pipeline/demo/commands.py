"""``liverl demo``: watch a real model learn a user's preference from their replies."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click


@click.command("demo")
@click.option(
    "--quick",
    is_flag=True,
    help="A short run (10 rounds of 6 users; about 20 minutes "
    "on 2 cores with the promotion gate on).",
)
@click.option(
    "--method",
    default="opd",
    show_default=True,
    help="Training method of the demo's trainer: rl, opd, hybrid, or one a [trainer] plugins "
    "module registers.",
)
@click.option(
    "--preference",
    default="concise",
    show_default=True,
    help="The users' hidden preference (see pipeline/sim/preferences.py).",
)
@click.option(
    "--hint-rate",
    type=float,
    default=1.0,
    show_default=True,
    help="Share of corrections that say what the user wants.",
)
@click.option(
    "--rounds", type=int, default=None, help="Rounds of sessions [default: 20; 10 with --quick]."
)
@click.option(
    "--users",
    type=int,
    default=6,
    show_default=True,
    help="Users per round (concurrent sessions; also the trainer's batch).",
)
@click.option(
    "--eval-questions",
    type=int,
    default=None,
    help="Held-out questions per evaluation [default: 16; 8 with --quick].",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--pace/--no-pace",
    default=True,
    show_default=True,
    help="Users wait for the weights trained on a round before the next one "
    "(serving and training share 2 cores; without it rounds run on old weights).",
)
@click.option(
    "--model",
    default=None,
    help="Model of the demo's loop (with --url: the base "
    "the gateway serves; it scores the probe's fluency) [default: "
    "smollm2-135m-instruct].",
)
@click.option(
    "--probe/--no-probe",
    default=True,
    show_default=True,
    help="Ask 20 fixed factual questions (unrecorded) before and after: greedy "
    "answers checked, sampled ones scored by the base model (fluency).",
)
@click.option(
    "--frontier/--no-frontier",
    default=False,
    show_default=True,
    help="Draw the users' questions by frontier sampling (those the policy gets "
    "right about half the time first; a quarter always uniform) instead of "
    "uniformly (pipeline/sim/critic.py).",
)
@click.option(
    "--adapt/--no-adapt",
    default=False,
    show_default=True,
    help="A critic adapts the users' phrasing to the policy's recent success: "
    "easier (the hint in the question, at most half the users) while it fails, "
    "chattier while it succeeds. Held-out users always ask plainly.",
)
@click.option(
    "--feedback",
    type=click.FloatRange(0.0, 1.0),
    default=0.0,
    show_default=True,
    help="Share of training sessions whose user also gives thumbs up or down "
    "(POST /v1/feedback): outcomes that count in the reward and that `liverl "
    "judges compare` checks the judges against.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the PNG and JSON go [default: <state_dir>/demo/<policy>].",
)
@click.option(
    "--url",
    default=None,
    help="Use a running gateway (…/v1) instead of starting "
    "a loop; its trainer's cadence is then its own.",
)
@click.option("--policy", default=None, help="With --url: the policy it serves.")
@click.pass_context
def demo(
    ctx: click.Context,
    quick: bool,
    method: str,
    preference: str,
    hint_rate: float,
    rounds: int | None,
    users: int,
    eval_questions: int | None,
    seed: int,
    pace: bool,
    model: str | None,
    probe: bool,
    frontier: bool,
    adapt: bool,
    feedback: float,
    out: Path | None,
    url: str | None,
    policy: str | None,
) -> None:
    """Simulated users with a hidden preference talk to the live policy through the gateway.

    Each user asks a question, checks the answer against their preference (e.g. one short
    sentence) and against answering the question at all, and replies with thanks or a
    correction that often says what they want. Those replies become rewards and hints, the
    trainer publishes LoRA versions, and the gateway serves them while the users keep
    talking. Before and after, held-out users ask held-out questions, and a fixed probe of
    factual questions checks that other users' answers stay right and fluent (nothing
    recorded).
    Writes learning_curve.png and summary.json.
    """
    from pipeline.demo.display import Display
    from pipeline.demo.loop import LoopConfig, LoopError, running_loop
    from pipeline.demo.plot import write_outputs
    from pipeline.demo.runner import DemoConfig, DemoRunner
    from pipeline.settings import Settings
    from pipeline.sim import PREFERENCES

    if preference not in PREFERENCES:
        known = ", ".join(sorted(PREFERENCES))
        raise click.BadParameter(f"known: {known}", param_hint="--preference")
    if not 0.0 <= hint_rate <= 1.0:
        raise click.BadParameter("must be within [0, 1]", param_hint="--hint-rate")
    if url is not None and policy is None:
        raise click.UsageError("--url needs --policy (the served model name)")
    settings: Settings = (ctx.obj or {}).get("settings") or Settings()
    if url is None:  # a running gateway's trainer has its own method
        from pipeline.trainer import methods

        try:  # an unknown method fails here, not in the loop's trainer log minutes later
            methods.load_plugins(settings.trainer.plugins)
            methods.get(method)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--method") from None
    cfg = DemoConfig(
        method=method,
        preference=preference,
        hint_rate=hint_rate,
        users=users,
        rounds=rounds or (10 if quick else 20),
        eval_questions=eval_questions or (8 if quick else 16),
        seed=seed,
        pace=pace,
        probe=probe,
        model=model,
        frontier=frontier,
        adapt=adapt,
        feedback=feedback,
    )
    policy = policy or f"demo-{method}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = out or Path(settings.state_dir) / "demo" / policy
    lake = Path(settings.trainer.under_state_dir(Path(settings.state_dir)).lake_root)

    def run(gateway: str) -> None:
        with Display(cfg, policy) as display:
            result = DemoRunner(gateway, policy, cfg, on_progress=display).run(lake)
        png, summary = write_outputs(result, out)
        s = result.summary()
        b, a = s["heldout_before"], s["heldout_after"]
        click.echo(
            f"held-out users: satisfied {b['satisfied']:.0%} (v{b['version']}) -> "
            f"{a['satisfied']:.0%} (v{a['version']}); answers the question "
            f"{b['quality_ok']:.0%} -> {a['quality_ok']:.0%}"
        )
        pb, pa = s["probe_before"], s["probe_after"]
        if pb and pa:

            def flu(p: dict) -> str:
                return "n/a" if p["fluency"] is None else f"{p['fluency']:.2f}"

            click.echo(
                f"capability probe: {pb['correct']}/{pb['n']} -> {pa['correct']}/{pa['n']} "
                f"correct (greedy); fluency {flu(pb)} -> {flu(pa)} (mean log-prob per "
                f"token of sampled answers under the base model)"
            )
        if s["probe_note"]:
            click.echo(s["probe_note"])
        until = s["sessions_until_3_consecutive"]
        click.echo(
            "sessions until 3 consecutive satisfied: "
            + (str(until) if until is not None else f"not within {s['sessions']}")
        )
        f = s["freshness_s"]
        if f["n"]:
            click.echo(
                f"freshness (reply -> first answer from weights trained on it): "
                f"p50 {f['p50']:.1f} s, max {f['max']:.1f} s over {f['n']} sessions"
            )
        g = s["gate"]
        if g["promoted"] or g["rejected"]:
            click.echo(
                f"promotion gate: {g['promoted']} version(s) promoted, {g['rejected']} "
                f"rejected (never served); reject share {g['reject_share']:.0%}"
            )
        click.echo(f"wrote {png} and {summary}")

    if url is not None:
        run(url)
        return
    loop_cfg = LoopConfig(
        policy=policy,
        method=method,
        model=model,
        state_dir=Path(settings.state_dir),
        # a session is two turns (the answer, then the closing reply):
        # one round of sessions makes one step
        batch_samples=2 * users,
    )
    click.echo(
        f"starting the loop for policy {policy} (model, broker, workers, trainer, "
        f"gateway; logs in {Path(settings.state_dir).resolve() / 'logs'})…"
    )
    try:
        with running_loop(loop_cfg) as loop:
            click.echo(f"loop ready at {loop.url}")
            run(loop.url)
    except LoopError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
