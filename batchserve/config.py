"""The server's settings: one frozen object, checked once, built by the CLI or by tests."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from .errors import StartupError

BACKEND_BATCH_LIMIT = 100
"""The batch-function contract: at most this many inputs per call."""

TIMEOUT_MS_MAX = 86_400_000.0
"""The longest request deadline --timeout-ms may set: a day."""
RESULT_TTL_S_MAX = 31_536_000.0
"""The longest --result-ttl-s: a year (a store's expiries must be finite milliseconds)."""

PolicyName = Literal["adaptive", "fixed"]
GenerateMode = Literal["continuous", "static"]
GENERATE_MODES: tuple[GenerateMode, ...] = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
"""A real generator's precision; auto: float32 on CPU, bfloat16 on a GPU that has it."""
POLICIES: tuple[PolicyName, ...] = ("adaptive", "fixed")


@dataclass(frozen=True, kw_only=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8000
    tcp: bool = True
    uds: str | None = None
    uds_mode: int = 0o600
    devices: str = "sim:4"
    fn: str | None = None
    fn_per_device: str | None = None
    models: str | None = None
    generator: str | None = None
    generate_mode: GenerateMode = "continuous"
    max_tokens: int = 256
    """What a generation request without max_tokens may generate (at most the cap)."""
    max_tokens_cap: int = 4096
    model_path: str | None = None
    """A real generator's local model folder or GGUF file (None: its own default)."""
    dtype: str = "auto"
    kv_cache_bytes: int = 256 * 2**20
    """The KV cache a real generator preallocates on each device: its token budget."""
    step_tokens: int = 256
    """Tokens one generation step processes at most: a longer prefill goes in chunks."""
    policy: PolicyName = "adaptive"
    max_batch_size: int = BACKEND_BATCH_LIMIT
    max_linger_ms: float = 50.0
    timeout_ms: float = 5000.0
    max_queue: int = 10_000
    max_input_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0
    keys_file: str | None = None
    admin_key: str | None = field(default=None, repr=False)
    anonymous_tier: str | None = None
    slo_ms: float = 1000.0
    metrics: bool = True
    public_metrics: bool = False
    """With keys: /metrics and /api/stats answer without an operator key."""
    access_log: bool = False
    result_ttl_s: float = 300.0
    result_store: str = "memory"
    """memory, sqlite:///path/file.db or redis://host:port/db: see shared_records.py."""
    result_store_size: int = 100_000
    result_store_bytes: int = 256 << 20
    """What the status store's unfinished inputs and finished answers may take, in bytes."""
    batch_timeout_ms: float = 0.0
    bisect_failures: bool = True
    retry_budget: float = 0.25
    retry_reserve: float = 30.0
    poison_memory: int = 10_000
    sim_latency_ms: float = 100.0
    sim_cost: tuple[float, float] | None = None
    """(a, b): a simulated call takes a ms + b ms per padded token, instead of the latency."""
    sim_fail_rate: float = 0.0
    sim_hang_rate: float = 0.0
    sim_bad_output_rate: float = 0.0
    sim_hang_ms: float = 10_000.0
    sim_seed: int = 0
    sim_step_ms: tuple[float, float] = (10.0, 0.05)
    """(a, b): a simulated generation step takes a ms + b ms per token it processes."""
    sim_kv_budget: int = 16_384
    header_timeout_s: float = 10.0
    """A request's head must arrive whole within this (connections.py has every deadline)."""
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 15.0
    write_timeout_s: float = 30.0
    max_unfinished_body_bytes: int = 128 << 20

    def __post_init__(self) -> None:
        rules: list[tuple[bool, str]] = [
            (0 <= self.port <= 65535, "port must be between 0 and 65535"),
            (self.tcp or self.uds is not None, "--tcp off needs --uds: nowhere to listen"),
            (0 <= self.uds_mode <= 0o777, "uds_mode must be permission bits, 0 to 777 octal"),
            (
                1 <= self.max_batch_size <= BACKEND_BATCH_LIMIT,
                f"max_batch_size must be between 1 and {BACKEND_BATCH_LIMIT}",
            ),
            (self.max_linger_ms >= 0, "max_linger_ms must be 0 or more"),
            (
                0 < self.timeout_ms <= TIMEOUT_MS_MAX,
                f"timeout_ms must be more than 0 and at most {TIMEOUT_MS_MAX:.0f} (a day)",
            ),
            (self.max_queue >= 1, "max_queue must be 1 or more"),
            (self.max_input_bytes >= 1, "max_input_bytes must be 1 or more"),
            (self.drain_timeout_s >= 0, "drain_timeout_s must be 0 or more"),
            (self.slo_ms > 0, "slo_ms must be more than 0"),
            (
                self.anonymous_tier is None or self.keys_file is not None,
                "--anonymous-tier needs --keys-file",
            ),
            (
                0 <= self.result_ttl_s <= RESULT_TTL_S_MAX,
                f"result_ttl_s must be between 0 and {RESULT_TTL_S_MAX:.0f} (a year)",
            ),
            (self.result_store_size >= 1, "result_store_size must be 1 or more"),
            (self.result_store_bytes >= 1, "result_store_bytes must be 1 or more"),
            (self.batch_timeout_ms >= 0, "batch_timeout_ms must be 0 (derived) or more"),
            (self.retry_budget >= 0, "retry_budget must be 0 or more"),
            (self.retry_reserve >= 0, "retry_reserve must be 0 or more"),
            (self.poison_memory >= 0, "poison_memory must be 0 or more"),
            (self.sim_latency_ms >= 0, "sim_latency_ms must be 0 or more"),
            (
                self.sim_cost is None or min(self.sim_cost) >= 0,
                "sim_cost must be two numbers a,b of 0 or more",
            ),
            (self.sim_hang_ms >= 0, "sim_hang_ms must be 0 or more"),
            (
                all(0 <= rate <= 1 for rate in self.sim_fault_rates)
                and sum(self.sim_fault_rates) <= 1,
                "the sim fault rates must each be between 0 and 1, and add up to 1 at most",
            ),
            (
                min(self.max_tokens, self.max_tokens_cap) >= 1,
                "max_tokens and its cap must be 1 or more",
            ),
            (self.generate_mode in GENERATE_MODES, "generate_mode must be continuous or static"),
            (min(self.sim_step_ms) >= 0, "sim_step_ms must be two numbers a,b of 0 or more"),
            (self.sim_kv_budget >= 1, "sim_kv_budget must be 1 or more"),
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}"),
            (self.kv_cache_bytes >= 2**20, "kv_cache_bytes must be 1 MiB (1048576) or more"),
            (self.step_tokens >= 1, "step_tokens must be 1 or more"),
            (
                all(0 < timeout <= 86_400 for timeout in self.connection_timeouts),
                "header, body, keepalive and write timeouts must be more than 0 s, at most a day",
            ),
            (
                self.max_unfinished_body_bytes >= 1,
                "max_unfinished_body_bytes must be 1 or more",
            ),
            (
                self.generator is None or (self.fn is None and self.fn_per_device is None),
                "--generator makes the model a generation model: give it or --fn/--fn-per-device",
            ),
            (self.policy in POLICIES, f"policy must be one of {', '.join(POLICIES)}"),
            (
                self.fn is None or self.fn_per_device is None,
                "give --fn or --fn-per-device, not both",
            ),
            (
                self.models is None
                or (self.fn is None and self.fn_per_device is None and self.generator is None),
                "--models names each model's fn or generator itself: give it or"
                " --fn/--fn-per-device/--generator",
            ),
        ]
        infinite = [name for name in self._unbounded_numbers() if not _finite(getattr(self, name))]
        if infinite:
            rules.append((False, f"{', '.join(infinite)} must be finite, not inf or nan"))
        broken = [message for ok, message in rules if not ok]
        if broken:
            raise StartupError("; ".join(broken))

    def _unbounded_numbers(self) -> list[str]:
        """The fields of numbers whose rules above set no upper bound, which inf would pass."""
        bounded = {"timeout_ms", "result_ttl_s"}
        return [f.name for f in fields(self) if f.name not in bounded]

    @property
    def connection_timeouts(self) -> tuple[float, float, float, float]:
        return (
            self.header_timeout_s,
            self.body_timeout_s,
            self.keepalive_timeout_s,
            self.write_timeout_s,
        )

    @property
    def sim_fault_rates(self) -> tuple[float, float, float]:
        return (self.sim_hang_rate, self.sim_fail_rate, self.sim_bad_output_rate)

    @property
    def max_body_bytes(self) -> int:
        """JSON escaping can make one input byte six body bytes (\\u0000); leave room for it."""
        return self.max_input_bytes * 6 + 4096


def _finite(value: object) -> bool:
    """False for a float (or a tuple holding one) that is inf or nan; True for the rest."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, tuple):
        return all(_finite(part) for part in value)
    return True


def read_toml(path: str, flag: str) -> dict[str, Any]:
    """A settings file named by `flag` (--models, --config), or a StartupError that says
    why it cannot be read."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise StartupError(f"{flag} {path}: cannot read it: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise StartupError(f"{flag} {path}: not valid TOML: {exc}") from None
