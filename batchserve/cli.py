"""Command line: flags (each also read from BATCHSERVE_<FLAG>) -> Config, and the serve loop."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import logging
import os
import signal
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import NamedTuple

from aiohttp import web

from . import preload
from .config import FLAG_GROUPS, Config
from .doors.uds import UnixSocketPath
from .engine.core import Engine
from .errors import StartupError
from .live_config import read_config_file
from .models import mkl_paths
from .observability.tracing import otlp_provider
from .server import AppRunner, create_app

log = logging.getLogger("batchserve")


def _on_off(text: str) -> bool:
    """argparse type for switches that an environment variable can also set."""
    lowered = text.strip().lower()
    if lowered in {"on", "true", "1", "yes"}:
        return True
    if lowered in {"off", "false", "0", "no"}:
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, not {text!r}")


def _octal(text: str) -> int:
    """argparse type for --uds-mode: permission bits like 600 or 0660."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected octal like 600, not {text!r}") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"expected permissions up to 777, not {text!r}")
    return mode


def _cost_pair(text: str) -> tuple[float, float]:
    """argparse type for --sim-cost: two numbers, "a,b"."""
    try:
        fixed, per_token = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers a,b, not {text!r}") from None
    return fixed, per_token


_READERS: dict[object, Callable[[str], object]] = {
    bool: _on_off,
    int: int,
    float: float,
    str: str,
    tuple[float, float]: _cost_pair,
}
"""How a flag's text becomes its field's value, by the field's type (a Literal: str)."""


class Flag(NamedTuple):
    name: str
    """As typed, less the leading dashes: max-batch-size."""
    read: Callable[[str], object]
    field: dataclasses.Field[object]
    """Config's field: its default, and its help and choices in its metadata."""


def _reader(field: dataclasses.Field[object], hint: object) -> Callable[[str], object]:
    if field.metadata["kind"] == "octal":
        return _octal
    if isinstance(hint, types.UnionType):  # X | None: a flag given is an X
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not types.NoneType)
    if typing.get_origin(hint) is typing.Literal:
        return str
    try:
        return _READERS[hint]
    except KeyError:
        raise TypeError(f"Config.{field.name}: no flag reads a {hint}") from None


def config_flags(settings: type[Config] = Config) -> list[Flag]:
    """Config's fields that are flags, in their order: each declares its help, its choices
    and any way to read it that its type does not say (config.setting). A field of a type
    no flag can read is a TypeError here, at import, not a string at run time."""
    hints = typing.get_type_hints(settings)
    return [
        Flag(field.name.replace("_", "-"), _reader(field, hints[field.name]), field)
        for field in dataclasses.fields(settings)
        if field.metadata["flag"]
    ]


_FLAGS = config_flags()


def build_parser(prog: str = "batchserve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a batch function over HTTP: one input per request, batched inside.",
        epilog="Every flag also reads from the environment: --max-queue from"
        " BATCHSERVE_MAX_QUEUE, and so on. A flag given on the command line wins.",
    )
    groups = {
        name: parser.add_argument_group(name, description)
        for name, (description, _) in FLAG_GROUPS.items()
    }
    group_of = {
        field: groups[name] for name, (_, fields) in FLAG_GROUPS.items() for field in fields
    }
    for flag, kind, field in _FLAGS:
        default = field.default
        env = f"BATCHSERVE_{field.name.upper()}"
        shown = ("on" if default else "off") if isinstance(default, bool) else default
        if kind is _octal:
            shown = f"{default:o}"
        values = "on or off; " if kind is _on_off else ""
        group_of.get(field.name, parser).add_argument(
            f"--{flag}",
            type=kind,
            default=os.environ.get(env, default),
            choices=field.metadata["choices"],
            metavar="{on,off}" if kind is _on_off else "A,B" if kind is _cost_pair else None,
            help=f"{field.metadata['help']} ({values}default: {shown}; env {env})",
        )
    groups["metrics"].add_argument(
        "--log-level",
        default=os.environ.get("BATCHSERVE_LOG_LEVEL", "INFO"),
        choices=LOG_LEVELS,
        help="logging verbosity (default: INFO; env BATCHSERVE_LOG_LEVEL)",
    )
    groups["server"].add_argument(
        "--config",
        default=os.environ.get("BATCHSERVE_CONFIG"),
        help="a TOML file of settings named as these flags (max-batch-size = 32); the"
        " environment and the command line override it. SIGHUP reads it again and applies"
        " what a running server can change: batch limits, linger, timeouts, queue bound, keys"
        " and tiers, log level, the models file (env BATCHSERVE_CONFIG)",
    )
    return parser


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def config_from_args(
    argv: Sequence[str] | None = None, prog: str = "batchserve"
) -> tuple[Config, str]:
    """The settings: command line, then environment, then --config's file, then defaults.
    A bad file or value raises StartupError (argparse's own usage errors exit, as ever)."""
    parser = build_parser(prog)
    args = vars(parser.parse_args(argv))
    if args["config"] is not None:
        known = {field.name for field in dataclasses.fields(Config)} | {"log_level"}
        from_file = read_config_file(args["config"], known)
        # Defaults from the file where the environment sets none; argparse converts a string
        # default with the flag's type, so each value is checked as a flag's would be.
        parser.set_defaults(
            **{
                name: str(value)
                for name, value in from_file.items()
                if f"BATCHSERVE_{name.upper()}" not in os.environ
            }
        )
        parser.exit_on_error = False
        try:
            args = vars(parser.parse_args(argv))
        except argparse.ArgumentError as exc:
            raise StartupError(f"--config {args['config']}: {exc}") from None
    args.pop("config")
    log_level = args.pop("log_level")
    if log_level not in LOG_LEVELS:
        raise StartupError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
    try:
        return Config(**args), log_level
    except TypeError as exc:
        raise StartupError(f"a setting has the wrong type: {exc}") from None


async def serve(engine: Engine, settings: Callable[[], tuple[Config, str]] | None = None) -> int:
    """Serves until SIGTERM or SIGINT, then drains and returns 0; returns 1 at once if the
    engine fails, rather than serve into it. SIGHUP reloads `settings()` (see `_reload`).

    A drain first stops taking connections: the listening sockets close and so does every
    keep-alive connection once its request in hand (if any) is answered, so that a load
    balancer in front (nginx) finds this replica gone and sends new requests to another,
    while every request already accepted here finishes, and so does one an open connection
    received as the drain began."""
    config = engine.config
    app = create_app(engine)
    runner = AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5)
    await runner.setup()
    loop = asyncio.get_running_loop()
    uds = UnixSocketPath(config.uds) if config.uds else None
    try:
        where = await _listen(runner, config, uds)
        tune_for_serving()
        models = ",".join(
            f"{model['name']}@{version['version']}"
            for model in engine.view.models()
            for version in model["versions"]
        )
        print(
            f"batchserve listening on {where} devices={','.join(engine.device_names)}"
            f" models={models} policy={config.policy} max_batch_size={config.max_batch_size}"
            f" max_linger_ms={config.max_linger_ms:g}",
            flush=True,
        )
        stop = asyncio.Event()
        # Installed until the drain has answered everything: a signal's default action
        # would kill the process and drop every request it holds.
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, _on_stop_signal, engine, stop, signum)
        loop.add_signal_handler(signal.SIGHUP, _on_hangup, engine, stop, settings)
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(engine.failed.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        stop.set()  # failed or stopping: no reload from here on
        if engine.failed.is_set():
            log.critical("exiting 1: %s", engine.failure)
            return 1
        log.info("stopping: draining %d accepted requests", engine.stats().pending)
        return 0
    finally:
        try:
            # Closes the listeners, then each connection once its request in hand is
            # answered; drains the engine (server.py's on_shutdown) and stops it.
            await runner.cleanup()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(signum)
            if uds is not None:
                uds.release()


def _on_stop_signal(engine: Engine, stop: asyncio.Event, signum: int) -> None:
    """SIGTERM or SIGINT: the first starts the drain; a later one only says how it stands,
    since every request accepted is answered (or, past --drain-timeout-s, answered 503)
    whatever the signals. SIGKILL is the way to stop at once."""
    if not stop.is_set():
        stop.set()
        return
    log.warning(
        "%s: already draining %d accepted requests; they finish first (at most"
        " --drain-timeout-s %gs). SIGKILL stops at once and drops them",
        signal.Signals(signum).name,
        engine.stats().pending,
        engine.config.drain_timeout_s,
    )


def _on_hangup(
    engine: Engine, stop: asyncio.Event, settings: Callable[[], tuple[Config, str]] | None
) -> None:
    """SIGHUP: a reload while serving; logged and ignored while draining, or when the
    server was started without settings to read again."""
    if stop.is_set():
        log.warning("SIGHUP ignored: the server is draining")
    elif settings is None:
        log.warning("SIGHUP ignored: this server has no settings to read again")
    else:
        _reload(engine, settings)


def tune_for_serving() -> None:
    """The interpreter's settings for serving, once everything is loaded; for `serve` and
    for benchmarks that serve as it does."""
    # Everything loaded so far lives for the whole run: keep it out of the collector's
    # scans, and collect young objects less often (each request makes a few).
    gc.freeze()
    gc.set_threshold(10_000, 50, 1000)
    # A device thread must take the GIL to start and to return each batch call; while the
    # loop writes a batch's responses, the default 5 ms switch interval idles the device.
    sys.setswitchinterval(0.001)


def _reload(engine: Engine, settings: Callable[[], tuple[Config, str]]) -> None:
    """SIGHUP: the settings read again and applied whole, or (a bad file or value) not at
    all, with one line naming the fault; what needs a restart is named and kept."""
    try:
        wanted, log_level = settings()
        changes = engine.reconfigure(wanted)
    except StartupError as error:
        log.error("reload refused, the running settings stay: %s", error)
        return
    logging.getLogger().setLevel(log_level)
    log.info("reloaded: %s", ", ".join(changes.changed) or "nothing changed")
    if changes.kept:
        log.warning("reload: these apply only after a restart and keep their running values: %s",
                    ", ".join(changes.kept))  # fmt: skip


async def _listen(runner: web.AppRunner, config: Config, uds: UnixSocketPath | None) -> str:
    """Starts the TCP site (unless --tcp off) and the Unix socket's (--uds); returns where
    they listen, in words. The runner owns them and closes them in its cleanup; `uds`
    refuses a path in use and removes only the socket this process made."""
    where: list[str] = []
    if config.tcp:
        tcp = web.TCPSite(runner, config.host, config.port, backlog=4096)
        await _start(tcp, f"{config.host}:{config.port}")
        host, port = runner.addresses[0][:2]
        where.append(f"http://{host}:{port}")
    if uds is not None:
        uds.claim()
        unix = web.UnixSite(runner, uds.path, backlog=4096)
        # The socket is created with the mode asked for, never briefly wider.
        umask = os.umask(0o777 & ~config.uds_mode)
        try:
            await _start(unix, uds.path)
        finally:
            os.umask(umask)
        uds.bound()
        os.chmod(uds.path, config.uds_mode)
        where.append(f"unix:{uds.path}")
    return " and ".join(where)


async def _start(site: web.BaseSite, where: str) -> None:
    try:
        await site.start()
    except OSError as exc:
        cause = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise StartupError(f"cannot listen on {where}: {cause}") from None


def _route_access_log_to_stdout() -> None:
    """Access-log lines are bare JSON on stdout, apart from the diagnostics on stderr."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("batchserve.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def _preload(config: Config) -> None:
    """--preload on: this process again, with tcmalloc and Intel OpenMP preloaded where they
    are installed and not loaded (preload.py); the process so started says what it got."""
    done = preload.preloaded(os.environ)
    if done is not None:
        log.info("preloaded: %s", done)
    elif config.preload:
        env = preload.preload_env(
            os.environ, dirs=preload.library_dirs(), exists=os.path.exists,
            loaded=preload.current_maps(),
        )  # fmt: skip
        if env is None:
            log.info("--preload on: nothing to preload (tcmalloc and Intel OpenMP are"
                     " not installed, or are loaded already)")  # fmt: skip
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(sys.executable, sys.orig_argv, env)


def _mkl_paths(config: Config) -> None:
    """--mkl-intel-paths on: MKL's Intel kernels on an AMD CPU, before anything imports torch
    (models/mkl_paths.py), where a model may run on a CPU device (--devices cpu, or a models
    file, whose entries name their own); its model logs what was done, or why not. `cpu`
    stands alone in a --devices spec (models/device_names.py), which is parsed later: for
    cuda, parsing imports torch."""
    if config.mkl_intel_paths and (config.devices.strip() == "cpu" or config.models is not None):
        mkl_paths.apply()


def main(argv: Sequence[str] | None = None, prog: str = "batchserve") -> int:
    """`batchserve` and `python -m batchserve`: 0 after a clean drain, 1 if it could not
    start (one line on stderr) or its engine failed."""
    import uvloop

    try:
        config, log_level = config_from_args(argv, prog)
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
        )
        _route_access_log_to_stdout()
        if argv is None:  # the process's own command line: it may start again, preloaded
            _preload(config)
            _mkl_paths(config)
        provider = otlp_provider() if config.trace else None
        try:
            engine = Engine(config, tracer_provider=provider)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(serve(engine, functools.partial(config_from_args, argv, prog)))
        finally:
            if provider is not None:
                provider.shutdown()  # sends the spans not yet sent
    except StartupError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
