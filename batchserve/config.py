"""The server's settings: one frozen object, checked once, built by the CLI or by tests."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import StartupError

BACKEND_BATCH_LIMIT = 100
"""The batch-function contract: at most this many inputs per call."""

PolicyName = Literal["adaptive", "fixed"]
GenerateMode = Literal["continuous", "static"]
GENERATE_MODES: tuple[GenerateMode, ...] = ("continuous", "static")
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
            (self.timeout_ms > 0, "timeout_ms must be more than 0"),
            (self.max_queue >= 1, "max_queue must be 1 or more"),
            (self.max_input_bytes >= 1, "max_input_bytes must be 1 or more"),
            (self.drain_timeout_s >= 0, "drain_timeout_s must be 0 or more"),
            (self.slo_ms > 0, "slo_ms must be more than 0"),
            (
                self.anonymous_tier is None or self.keys_file is not None,
                "--anonymous-tier needs --keys-file",
            ),
            (self.result_ttl_s >= 0, "result_ttl_s must be 0 or more"),
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
        broken = [message for ok, message in rules if not ok]
        if broken:
            raise StartupError("; ".join(broken))

    @property
    def sim_fault_rates(self) -> tuple[float, float, float]:
        return (self.sim_hang_rate, self.sim_fail_rate, self.sim_bad_output_rate)

    @property
    def max_body_bytes(self) -> int:
        """JSON escaping can make one input byte six body bytes (\\u0000); leave room for it."""
        return self.max_input_bytes * 6 + 4096


def read_toml(path: str, flag: str) -> dict[str, Any]:
    """A settings file named by `flag` (--models, --config), or a StartupError that says
    why it cannot be read."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise StartupError(f"{flag} {path}: cannot read it: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise StartupError(f"{flag} {path}: not valid TOML: {exc}") from None
