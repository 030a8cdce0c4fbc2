"""The ``elasticd`` command line: parsing only, then it delegates.

Each option of ``start`` also reads ``ELASTICD_<NAME>`` and the YAML ``--config`` file; click resolves the
precedence CLI > env > file > default (the file becomes click's ``default_map``). A user mistake ends in one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from elasticd import __version__
from elasticd.errors import EXIT_USAGE, ElasticdError, UsageError

_ENV_PREFIX = "ELASTICD_"


def _env(name: str) -> str:
    return _ENV_PREFIX + name.upper().replace("-", "_")


class FiniteFloat(click.FloatRange):
    """Every float option's type: nan and ±inf are refused, from the command line, env and config file alike
    (click's own float accepts them, and nan slips through any range)."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from elasticd.config import parse_number

        try:
            number = parse_number(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return super().convert(number, param, ctx)


class SecondsOrAuto(click.ParamType):
    """``S`` (a finite number of seconds) or ``auto``; the value stays text for ``config.parse_hang_timeout``."""

    name = "seconds|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from elasticd.config import parse_number

        if value == "auto":
            return value
        try:
            parse_number(value)
        except ValueError as exc:
            self.fail(f"expected seconds or 'auto': {exc}", param, ctx)
        return str(value)


def _option(flag: str, *dest: str, **kwargs: Any) -> Callable[[Any], Any]:
    """A long option that also reads ``ELASTICD_<FLAG>`` (``--min-nodes`` → ``ELASTICD_MIN_NODES``).

    ``type=float`` becomes :class:`FiniteFloat`, so no float option can take nan or inf."""
    name = flag.lstrip("-")
    if kwargs.get("type") is float:
        kwargs["type"] = FiniteFloat()
    kwargs.setdefault("show_default", True)
    return click.option(flag, *dest, envvar=_env(name), show_envvar=True, **kwargs)


def _load_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """Eager callback: the YAML file becomes click's default_map, so CLI and env still win over it."""
    if not value:
        return value
    from elasticd.config_file import load_config_file

    converters: dict[str, Callable[[Any], Any]] = {}
    dest: dict[str, str] = {}  # option name -> click parameter name (--drain-timeout -> drain_timeout_s)
    # status and stop read the same file as start: start's other keys are checked, then ignored
    for command in (start, ctx.command):
        for param in command.params:
            if isinstance(param, click.Option) and param.name not in {"config", "help", "version"}:
                name = param.opts[0].lstrip("-")
                converters[name] = _converter(param, ctx)
                if command is ctx.command:
                    dest[name] = str(param.name)
    loaded = load_config_file(Path(value), converters)
    ctx.default_map = {dest[key]: val for key, val in loaded.items() if key in dest}
    return value


def _converter(param: click.Option, ctx: click.Context) -> Callable[[Any], Any]:
    def convert(raw: Any) -> Any:
        try:
            return param.type.convert(raw, param, ctx)
        except click.BadParameter as exc:
            raise ValueError(exc.format_message()) from None

    return convert


def _etcd_access_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """TLS and credentials for etcd; the password comes from a file or ELASTICD_ETCD_PASSWORD, never a flag."""
    options = [
        _option("--etcd-cacert", default=None, help="CA certificate that signed etcd's server certificate."),
        _option("--etcd-cert", default=None, help="Client certificate for etcd (with --etcd-key)."),
        _option("--etcd-key", default=None, help="Client certificate key for etcd."),
        _option("--etcd-user", default=None, help="etcd user (password: --etcd-password-file or env)."),
        _option("--etcd-password-file", default=None, help="File holding the etcd password."),
    ]
    for opt in reversed(options):
        func = opt(func)
    return func


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="elasticd")
def cli() -> None:
    """Fault-tolerant elastic training daemon for PyTorch (one per node)."""


_config_option = click.option(
    "--config",
    envvar=_env("config"),
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_load_config,
    help="YAML file of option names to values (CLI > env > file > default).",
)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_config_option
@_option("--min-nodes", type=int, default=1, help="Fewest nodes the job runs with.")
@_option("--max-nodes", type=int, default=1, help="Most nodes the job grows to.")
@_option("--nproc-per-node", default="1", help="Workers per node: N or 'auto' (GPUs, else 1).")
@_option("--etcd", default=None, help="etcd endpoints HOST:PORT[,...]; absent: an embedded etcd on 127.0.0.1.")
@_option("--etcd-connect-timeout", "etcd_connect_timeout_s", type=float, default=10.0, help="Seconds.")
@_etcd_access_options
@_option("--run-id", default="default", help="Names the job in etcd and in the checkpoint dir.")
@_option("--node-id", default=None, help="This node's name in the run (default: the host name).")
@_option("--local-addr", default=None, help="Address other nodes reach this one at (default: its FQDN).")
@_option("--checkpoint-dir", default="checkpoints", help="Where committed checkpoints live.")
@_option("--checkpoint-every-steps", type=int, default=100, help="0 disables step-based checkpoints.")
@_option("--checkpoint-every-seconds", type=float, default=0.0, help="0 disables time-based checkpoints.")
@_option("--keep-checkpoints", type=int, default=3, help="Committed checkpoints kept.")
@_option(
    "--hang-timeout",
    type=SecondsOrAuto(),
    default="auto",
    help="No-progress timeout in seconds, or 'auto' (learned from step times).",
)
@_option("--hang-attempts", type=int, default=3, help="Exit 1 when one step hangs this many times in a row.")
@_option(
    "--startup-timeout",
    "startup_timeout_s",
    type=float,
    default=600.0,
    help="Seconds allowed for start-up to the first step, and for each checkpoint save or load.",
)
@_option("--straggler-factor", type=float, default=1.5, help="Report a rank this much slower than the others; 0: off.")
@_option("--straggler-window", "straggler_window_s", type=float, default=30.0, help="Seconds a straggler must last.")
@_option(
    "--drain-timeout",
    "drain_timeout_s",
    type=float,
    default=120.0,
    help="SIGTERM or stop: seconds to wait for the checkpoint before stopping the workers.",
)
@_option("--on-nan", type=click.Choice(["skip", "rollback", "stop"]), default="rollback")
@_option(
    "--recovery",
    type=click.Choice(["hot", "cold"]),
    default="hot",
    help="hot: survivors keep their processes and re-form in place; cold: restart from the newest checkpoint.",
)
@_option("--max-restarts", type=int, default=20, help="Worker-group restarts on failure (torchrun's meaning).")
@_option("--monitor-interval", "monitor_interval_s", type=float, default=0.1, help="Worker poll, seconds.")
@_option("--rdzv-conf", default="", help="Rendezvous timing, e.g. last_call_timeout=2,keep_alive_interval=1.")
@_option("--metrics-port", type=int, default=9400, help="Prometheus endpoint port; 0 disables.")
@_option("--metrics-addr", default="127.0.0.1", help="Address the metrics endpoint binds.")
@_option(
    "--accelerate-config",
    type=click.Path(dir_okay=False),
    default=None,
    show_default="accelerate's default, where `accelerate config` writes it",
    help="accelerate's config file: the workers get the environment `accelerate launch` would give them.",
)
@_option("--log-format", type=click.Choice(["json", "console"]), default=None, help="Default: console on a TTY.")
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def start(**values: Any) -> None:
    """Run SCRIPT on this node as part of an elastic job, restarting it through failures."""
    from elasticd.agent.daemon import run_daemon
    from elasticd.config import build_start_config

    sys.exit(run_daemon(build_start_config(values)))


_etcd_opts = [
    _option("--etcd", default="127.0.0.1:2379", help="etcd endpoints HOST:PORT[,...]."),
    _option("--run-id", default="default"),
    _option(
        "--etcd-connect-timeout",
        "etcd_connect_timeout_s",
        type=FiniteFloat(min=0, min_open=True),
        default=5.0,
        help="Seconds.",
    ),
]


def _with_etcd_opts(func: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(_etcd_opts):
        func = opt(func)
    return _config_option(_etcd_access_options(func))


@cli.command()
@_with_etcd_opts
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", is_flag=True, help="A live view, redrawn every second until Ctrl-C.")
def status(etcd: str, run_id: str, etcd_connect_timeout_s: float, as_json: bool, watch: bool, **access: Any) -> None:
    """Show a run: nodes, round, world size, step, last checkpoint, health."""
    from elasticd.config import access_from_options
    from elasticd.status import show_status

    options = access_from_options(access)
    sys.exit(show_status(etcd, run_id, etcd_connect_timeout_s, as_json=as_json, access=options, watch=watch))


@cli.command()
@_with_etcd_opts
def stop(etcd: str, run_id: str, etcd_connect_timeout_s: float, **access: Any) -> None:
    """Drain a run: every node checkpoints, stops its workers and exits 0."""
    from elasticd.config import access_from_options
    from elasticd.control import request_drain

    sys.exit(request_drain(etcd, run_id, etcd_connect_timeout_s, access=access_from_options(access)))


@cli.command("etcd")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, help="Default: a temporary dir.")
@click.option("--port", type=int, default=2379, show_default=True, help="Client port on 127.0.0.1.")
def etcd_cmd(data_dir: str | None, port: int) -> None:
    """Run a local etcd (v3 API) for development until interrupted."""
    from elasticd.etcd.dev import serve_forever

    sys.exit(serve_forever(Path(data_dir) if data_dir else None, port))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    try:
        cli.main(args=argv, prog_name="elasticd", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        return EXIT_USAGE
    except click.MissingParameter as exc:
        if exc.ctx is not None and isinstance(exc.param, click.Argument):  # e.g. `elasticd start` without a script
            click.echo(exc.ctx.get_usage(), err=True)
            click.echo(f"Try '{exc.ctx.command_path} --help' for the options.", err=True)
        _error(exc.format_message())
        return EXIT_USAGE
    except click.UsageError as exc:  # includes BadParameter, from flags and env alike
        _error(exc.format_message())
        return EXIT_USAGE
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.Abort:
        return 130
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int | None) else 1
    except UsageError as exc:
        _error(str(exc))
        return exc.exit_code
    except ElasticdError as exc:
        _error(str(exc))
        return exc.exit_code
    return 0


def _error(message: str) -> None:
    click.echo(f"elasticd: error: {' '.join(message.split())}", err=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
