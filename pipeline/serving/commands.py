"""``liverl serve``: the capture gateway (registered in ``pipeline.cli``)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from pipeline.options import explicit, field_option, merged

from .settings import ApiKey, ServeSettings, hash_key, is_loopback

FC = TypeVar("FC", bound=Callable[..., Any])

if TYPE_CHECKING:
    import uvicorn


def _keys(cli_keys: tuple[str, ...], keys_file: Path | None) -> tuple[list[str], list[ApiKey]]:
    """The keys typed, in ``LIVERL_SERVE_API_KEYS`` and in the keys file, hashed: plain ones
    (a user of their own) and the file's ``<key> <user> [operator]`` lines."""
    keys = list(cli_keys)
    env = os.environ.get("LIVERL_SERVE_API_KEYS", "")
    keys += [k.strip() for k in env.split(",") if k.strip()]
    entries: list[ApiKey] = []
    if keys_file is not None:
        for n, line in enumerate(keys_file.read_text().splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) == 1:
                keys.append(fields[0])
                continue
            if len(fields) > 3 or (len(fields) == 3 and fields[2] not in ("user", "operator")):
                raise click.UsageError(f"{keys_file}:{n}: expected '<key> [<user> [operator]]'")
            role = fields[2] if len(fields) == 3 else "user"
            try:
                entries.append(
                    ApiKey.model_validate(
                        {"sha256": hash_key(fields[0]), "user": fields[1], "role": role}
                    )
                )
            except ValueError as exc:
                raise click.UsageError(f"{keys_file}:{n}: {exc}") from None
    return [hash_key(k) for k in keys], entries  # raw keys go no further than this function


class _HeaderTimer:
    """The clock of :func:`header_timeout_protocol`, mixed in before a uvicorn protocol
    class: it runs from connecting, and again from a request's first byte, until the
    request's headers are complete (``_headers_pending``)."""

    loop: Any
    transport: Any
    timeout_s: float
    _header_timer: Any = None

    def _headers_pending(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]  # (the parser's callbacks run here)
        if self._headers_pending():
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self._headers_pending() and not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's HTTP protocol (httptools' C parser where installed, else h11), closing a
    connection whose request headers take longer than ``timeout_s`` from its first byte (or
    from connecting): uvicorn has no such option, and slowly dribbled headers would hold a
    connection forever. Bodies are bounded by the app (``body_timeout_s``: 408, then closed).
    httptools parses a request with a fraction of h11's CPU (bench/gateway.py)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools not installed
        return _h11_header_timeout(timeout_s)

    class HeaderTimeoutHttpTools(_HeaderTimer, HttpToolsProtocol):
        _awaiting_headers = True  # from connecting, and from each request's first byte

        def _headers_pending(self) -> bool:
            return self._awaiting_headers

        def on_message_begin(self) -> None:
            self._awaiting_headers = True
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._awaiting_headers = False
            super().on_headers_complete()

    HeaderTimeoutHttpTools.timeout_s = timeout_s
    return HeaderTimeoutHttpTools


def _h11_header_timeout(timeout_s: float) -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(_HeaderTimer, H11Protocol):
        def _headers_pending(self) -> bool:
            return self.conn.their_state is h11.IDLE  # part of a request line or headers

    HeaderTimeoutH11.timeout_s = timeout_s
    return HeaderTimeoutH11


def server_config(app: Any, cfg: ServeSettings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration of a gateway: header timeout, bounded graceful shutdown."""
    import uvicorn

    opts: dict[str, Any] = {
        "host": cfg.host,
        "port": cfg.port,
        "log_level": "info",
        "http": header_timeout_protocol(cfg.header_timeout_s),
        "loop": "auto",  # uvloop where installed: ~30 % less event-loop CPU per request
        "access_log": cfg.access_log,
        "timeout_graceful_shutdown": max(1, round(cfg.shutdown_timeout_s)),
        **overrides,
    }
    return uvicorn.Config(app, **opts)


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket bound with SO_REUSEPORT: every gateway process that binds
    ``host:port`` this way gets its own accept queue, and the kernel spreads new connections
    over them (a load balancer needs no stickiness: any replica serves any turn)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise click.UsageError("--reuse-port needs SO_REUSEPORT (Linux, BSD, macOS)")
    family, kind, proto, _name, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


def check_writable(path: Path, what: str) -> None:
    """A clear error naming the path instead of a traceback from deep inside start-up."""
    from pipeline.durable import writable_problem

    if (problem := writable_problem(path)) is not None:
        raise click.ClickException(
            f"{what} {problem}; choose another with --spool-dir, or set state_dir "
            "(LIVERL_STATE_DIR / --config)"
        )


def _serve_option(field: str, *param_decls: str, **attrs: Any) -> Callable[[FC], FC]:
    return field_option(ServeSettings, field, *param_decls, **attrs)


@click.command("serve")
@_serve_option("host", "--host")
@_serve_option("port", "--port")
@_serve_option("backend", "--backend")
@_serve_option(
    "model_path",
    "--model",
    help="smollm2-135m-instruct (default; pulled into ~/.cache/liverl/models on first use), "
    "'tiny' (built in code, for tests) or a local Hugging Face model dir.",
)
@_serve_option("sglang_url", "--sglang-url")
@_serve_option("policy_id", "--policy-id", help="Default: the model dir's name.")
@_serve_option("served_model_name", "--served-model-name", help="Name clients send as `model`.")
@_serve_option("weight_version", "--weight-version")
@_serve_option("device", "--device")
@_serve_option("dtype", "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]))
@_serve_option("context_length", "--context-length", type=int)
@_serve_option("workers", "--workers")
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help="Accepted bearer key (repeatable), a user of its own; also LIVERL_SERVE_API_KEYS=k1,k2.",
)
@click.option(
    "--api-keys-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="One key a line: '<key>', or '<key> <user>' (the key speaks for <user>), or "
    "'<key> <user> operator' (may post for any session and name any user); # comments.",
)
@_serve_option(
    "rate_limit_per_min",
    "--rate-limit",
    type=float,
    help="Requests per minute per key (0: unlimited).",
)
@_serve_option("max_body_bytes", "--max-body-bytes")
@_serve_option(
    "record",
    "--no-record",
    is_flag=True,
    flag_value=False,
    help="Serve without recording interactions.",
)
@_serve_option(
    "serve_without_training",
    "--serve-without-training",
    is_flag=True,
    show_default=False,
    help="While events could be lost (spool unwritable), serve turns that would train "
    "anyway instead of answering 503 (losses are counted, /healthz says degraded).",
)
@_serve_option(
    "reload",
    "--no-reload",
    is_flag=True,
    flag_value=False,
    help="Do not follow liverl.weights.v1.",
)
@_serve_option(
    "require_promoted",
    "--require-promoted/--any-version",
    default=None,
    show_default=False,
    help="Load only versions the promotion gate promoted, or every new version. Default: "
    "promoted only while the trainer's gate is on (trainer.gate, on by default).",
)
@click.option(
    "--spool-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Default: <state_dir>/spool/<replica-id>.",
)
@_serve_option("replica_id", "--replica-id")
@_serve_option(
    "reuse_port",
    "--reuse-port",
    is_flag=True,
    show_default=False,
    help="Share host:port with other gateway processes (SO_REUSEPORT; Linux): the kernel "
    "spreads connections over them. Any replica may serve any turn of a session.",
)
@_serve_option(
    "session_prefix_messages",
    "--session-prefix-messages",
    help="Messages hashed to name sessions clients did not name.",
)
@click.pass_context
def serve(
    ctx: click.Context,
    api_keys: tuple[str, ...],
    api_keys_file: Path | None,
    spool_dir: Path | None,
    **opts: object,
) -> None:
    """OpenAI-compatible gateway that records every main turn and hot-reloads weights.

    Sessions: X-Session-Id, X-Turn-Type: main|side, X-Session-Done: true, X-Liverl-Train: false
    (body fields session_id/turn_type/session_done/train as fallbacks).
    """
    import uvicorn

    from pipeline.settings import Settings

    from .build import build_app

    kafka = (ctx.obj or {}).get("settings") if ctx.obj else None
    kafka = kafka or Settings()
    # [serve] in the settings file / LIVERL_SERVE_* first, then options typed on the command.
    hashes, entries = _keys(api_keys, api_keys_file)
    forced: dict[str, Any] = {
        "api_key_hashes": list(dict.fromkeys([*kafka.serve.api_key_hashes, *hashes])),
        "keys": [*kafka.serve.keys, *entries],
    }
    if spool_dir is not None:
        forced["spool_dir"] = spool_dir
    elif kafka.serve.spool_dir == ServeSettings().spool_dir:
        replica = explicit(ctx, opts).get("replica_id", kafka.serve.replica_id)
        forced["spool_dir"] = Path(kafka.state_dir) / "spool" / str(replica)
    if explicit(ctx, opts).get("require_promoted") is None and kafka.serve.require_promoted is None:
        forced["require_promoted"] = kafka.trainer.gate  # follow the promotion gate
    try:
        cfg = merged(kafka.serve, ctx, opts, **forced)
        cfg.check()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if cfg.open_access:
        click.echo(
            f"no API keys configured: listening on {cfg.host} (loopback) only and "
            "accepting any key",
            err=True,
        )
    else:
        keys = cfg.accepted_keys
        operators = sum(k.role == "operator" for k in keys)
        click.echo(
            f"{len(keys)} API key(s) configured (stored hashed), {operators} operator(s)", err=True
        )
    if not is_loopback(cfg.host) and cfg.open_access:  # pragma: no cover - check() refuses
        sys.exit(2)
    if cfg.record:
        check_writable(Path(cfg.spool_dir), "spool directory")
    app = build_app(cfg, kafka)
    server = uvicorn.Server(server_config(app, cfg))
    server.run(sockets=[shared_socket(cfg.host, cfg.port)] if cfg.reuse_port else None)
