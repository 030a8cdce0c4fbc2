"""The ``elasticd`` command line: parsing only, then it delegates.

Each option of ``start`` also reads ``ELASTICD_<NAME>`` and the YAML ``--config`` file; click resolves the
precedence CLI > env > file > default (the file becomes click's ``default_map``). A user mistake ends in one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from elasticd import __version__
from elasticd import options as o
from elasticd.errors import EXIT_USAGE, ElasticdError, UsageError


class FiniteFloat(click.FloatRange):
    """Every float option's type: nan and ±inf are refused, from the command line, env and config file alike
    (click's own float accepts them, and nan slips through any range)."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from elasticd.option_values import parse_number

        try:
            number = parse_number(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return super().convert(number, param, ctx)


class SecondsOrAuto(click.ParamType):
    """``S`` (a finite number of seconds) or ``auto``; the value stays text for ``option_values.parse_hang_timeout``."""

    name = "seconds|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from elasticd.option_values import AUTO, parse_number

        if value == AUTO:
            return value
        try:
            parse_number(value)
        except ValueError as exc:
            self.fail(f"expected seconds or 'auto': {exc}", param, ctx)
        return str(value)


_CLICK_TYPES: dict[str, Callable[[o.Option], Any]] = {
    "int": lambda _: int,
    "float": lambda _: FiniteFloat(),
    "text": lambda _: str,
    "choice": lambda option: click.Choice(option.choices),
    "seconds|auto": lambda _: SecondsOrAuto(),
    "file": lambda _: click.Path(dir_okay=False),
    "dir": lambda _: click.Path(file_okay=False),
}


def _click_option(option: o.Option, command: str) -> Callable[[Any], Any]:
    """The click option of a table entry; it also reads ``ELASTICD_<NAME>`` (``--min-nodes``: ELASTICD_MIN_NODES)."""
    env: dict[str, Any] = {"envvar": option.env, "show_envvar": True} if option.reads_env else {}
    if option is o.CONFIG:  # eager: the file becomes click's default_map, so CLI and env still win over it
        return click.option(
            option.flag, **env, type=_CLICK_TYPES[option.kind](option), is_eager=True, expose_value=False,
            callback=_load_config, help=option.help,
        )  # fmt: skip
    if option.kind == "flag":
        return click.option(option.flag, option.field, is_flag=True, default=option.default, help=option.help, **env)
    return click.option(
        option.flag,
        option.field,
        type=_CLICK_TYPES[option.kind](option),
        default=option.default_for(command),
        show_default=option.show_default or True,
        help=option.help,
        **env,
    )


def _table_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Every option the table gives ``command``, in the table's order."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(o.of(command)):
            func = _click_option(option, command)(func)
        return func

    return decorate


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
            if isinstance(param, click.Option) and param.name not in {"help", "version"} and param.expose_value:
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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="elasticd")
def cli() -> None:
    """Fault-tolerant elastic training daemon for PyTorch (one per node)."""


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_table_options(o.START)
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def start(**values: Any) -> None:
    """Run SCRIPT on this node as part of an elastic job, restarting it through failures."""
    from elasticd.agent.daemon import run_daemon
    from elasticd.config import build_start_config

    _refuse_unknown_option(str(values["script"]))
    sys.exit(run_daemon(build_start_config(values)))


def _refuse_unknown_option(script: str) -> None:
    """An option ``start`` does not know, before the script, arrives as SCRIPT (what follows the script goes to it
    untouched, so unknown options must pass): name it as an option, with the nearest of ``start``'s (difflib, as
    click's own parser suggests). A file whose name starts with ``-`` is still a script."""
    if not script.startswith("-") or Path(script).is_file():
        return
    ctx = click.get_current_context()
    known = sorted(opt for param in ctx.command.params for opt in param.opts if opt.startswith("--"))
    name = script.split("=", 1)[0]
    nearest = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {nearest[0]}?" if nearest else f"'{ctx.command_path} --help' lists them"
    raise click.NoSuchOption(name, message=f"no such option: {name} ({hint})", ctx=ctx)


@cli.command()
@_table_options(o.STATUS)
def status(**values: Any) -> None:
    """Show a run: nodes, round, world size, step, last checkpoint, health."""
    from elasticd.etcd.access import access_from_options
    from elasticd.status import show_status

    v = o.resolve(_local_run(values), o.STATUS)
    sys.exit(
        show_status(
            v["etcd"],
            v["run_id"],
            v["etcd_connect_timeout_s"],
            as_json=v["as_json"],
            watch=v["watch"],
            access=access_from_options(v),
        )
    )


@cli.command()
@_table_options(o.STOP)
def stop(**values: Any) -> None:
    """Drain a run: every node checkpoints, stops its workers and exits 0."""
    from elasticd.control import request_drain
    from elasticd.etcd.access import access_from_options

    v = o.resolve(_local_run(values), o.STOP)
    sys.exit(request_drain(v["etcd"], v["run_id"], v["etcd_connect_timeout_s"], access=access_from_options(v)))


def _local_run(values: dict[str, Any]) -> dict[str, Any]:
    """Without ``--etcd``: this user's run on this machine with an embedded etcd, if there is one
    (``etcd/local_runs.py``)."""
    from click.core import ParameterSource

    from elasticd.etcd import local_runs

    ctx = click.get_current_context()

    def given(field: str) -> bool:
        return ctx.get_parameter_source(field) not in (None, ParameterSource.DEFAULT)

    return local_runs.fill_in(values, given, local_runs.find)


@cli.command(o.ETCD_DEV)
@_table_options(o.ETCD_DEV)
def etcd_cmd(**values: Any) -> None:
    """Run a local etcd (v3 API) for development until interrupted."""
    from elasticd.etcd.dev import serve_forever

    v = o.resolve(values, o.ETCD_DEV)
    sys.exit(serve_forever(v["data_dir"], v["port"]))


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
