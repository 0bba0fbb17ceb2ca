"""Generation models: the backend contract, the simulated generator, and how one loads.

A generator is loaded once per device by a factory (`--generator pkg.mod:attr`, or a models
file entry's `generator`), called on that device's thread with its name (and, if the factory
takes a keyword `settings`, the server's `GeneratorSettings`: a model path, dtype, KV cache
bytes). What it returns has `kv_budget_tokens`, `step(seqs)` (one decoding step; a sequence's
first step includes its prompt's prefill) and `release(seq_ids)`, and may have
`count_tokens(text)` (without it a prompt's UTF-8 bytes count) and `max_token_bytes`, the most
prompt bytes one token stands for, so that a prompt too long by its bytes alone is refused
before it is tokenized. It may keep `progress`, an int
it bumps as a step advances (once a layer): a step past its hang budget that still advances
is then given another budget rather than taken for a hang. A sequence in a step holds
`count_tokens(prompt) + len(tokens) + 1` tokens of the budget. The scheduler
(`generation/step_loop.py`) keeps to the contract; this module checks what a generator gives back.

A step answers each sequence with a `str` (one token's text), None (the end of sequence), or
a `Made`: the id of the token made and the whole characters it completed (a tokenizer's
token may end inside a character), the end with the text held back until then, or nothing
yet. A generator that sets `chunked_prefill = True` is handed at most `Seq.chunk` of a
sequence's uncomputed tokens a step, and answers `Made()` (nothing yet) until its prompt is
all in: the scheduler then spreads a long prefill over several steps beside the decoding
sequences.

A chunked generator may also cache prefixes (`PrefixCache`): before admitting a sequence the
scheduler asks how many of its leading tokens the device's cache holds (`cached_prefix`), and
admitting it, `attach`es it, so that its prefill starts after them; its budget then counts
only the rows the device really holds (`kv_rows_held`, a shared row once), and
`kv_budget_tokens` is the whole cache, while `max_seq_tokens` (the context length) bounds one
sequence. Two sequences share cached rows only where their `Seq.cache_key` is the same.
"""

from __future__ import annotations

import functools
import inspect
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..errors import StartupError
from .backends import POISON_MARKER, Hangs, SimulatedFault, import_attr
from .chat_tools import fallback_messages, plain_chat_prompt
from .grammar import Compiled
from .logprobs import TokenLogprob

SIM = "sim"
"""`--generator sim`: the simulated generator."""


@dataclass(slots=True, eq=False)
class Seq:
    """One sequence as the model sees it; the server appends each token after the step."""

    id: str
    prompt: str
    tokens: list[str] = field(default_factory=list)
    """The text of each token made (a `Made` token that completed no character: "")."""
    params: dict[str, Any] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    """The ids of the tokens made, for generators that answer `Made` (kept across a release,
    so a preempted sequence is recomputed from the same ids, not from re-tokenized text)."""
    max_tokens: int | None = None
    """The most tokens it may make: a generator flushes held-back text with the last one."""
    chunk: int | None = None
    """For a `chunked_prefill` generator: how many of its uncomputed tokens this step takes
    (None: all of them)."""
    cache_key: str = ""
    """For a `PrefixCache`: sequences share cached rows only with this the same (the tenant
    and a request's `cache_salt`, set by the engine)."""
    prompt_ids: list[int] | None = None
    """The prompt as token ids (a generator with `vocab_size` takes them), else None."""
    fork_of: str = ""
    """One of the `n` choices of a request: the id of the sibling whose prompt's rows it
    copies once they are computed, rather than computing them again."""
    grammar: Compiled | None = None
    """What its output must keep to (structured output, a forced tool call): compiled by
    the generator's `compile_grammar` before the sequence is queued."""


@dataclass(slots=True, frozen=True)
class Made:
    """What one step made for one sequence: a token (`token_id`, and `text`, the whole
    characters it completed), the end (`end`, with any text held back until then), or
    nothing yet (a prefill chunk short of the prompt's end)."""

    text: str = ""
    token_id: int | None = None
    end: bool = False
    logprob: TokenLogprob | None = None
    """The token's log-probability, where its params ask (`logprobs`)."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """Where its params ask (`prompt_logprobs`): those of the prompt's tokens from index
    `prompt_start` on, computed by this step's chunk."""
    prompt_start: int = 0


StepAnswer = str | Made | None


@runtime_checkable
class Generator(Protocol):
    kv_budget_tokens: int

    def step(self, seqs: list[Seq]) -> Sequence[StepAnswer]: ...

    def release(self, seq_ids: list[str]) -> None: ...


GeneratorFactory = Callable[[str], Generator]


@dataclass(slots=True, frozen=True)
class CachedPrefix:
    """What a device's cache holds of a sequence: its first `tokens` (whole blocks, never
    its last token, which must be fed to make logits), of which `idle` are in blocks no
    running sequence holds (they leave the free rows when taken), and whether the block
    after them is `expected` from a running sequence now computing it."""

    tokens: int = 0
    idle: int = 0
    expected: bool = False


@runtime_checkable
class PrefixCache(Protocol):
    """A generator that shares its KV cache by prefix. The scheduler calls these between
    steps (on the loop, the device idle): `cached_prefix` may be asked of a sequence many
    times while it waits; `attach` takes the cached rows for it and says how many tokens
    they hold, so that its first step starts after them; `own_rows` are the rows its release
    would give back (blocks shared with others stay held)."""

    max_seq_tokens: int

    @property
    def kv_rows_held(self) -> int: ...

    def cached_prefix(self, seq: Seq) -> CachedPrefix: ...

    def attach(self, seq: Seq) -> int: ...

    def own_rows(self, seq_id: str) -> int: ...


@dataclass(slots=True, frozen=True, kw_only=True)
class GeneratorSettings:
    """What the server's flags (or a models file entry) say about a real model, handed to a
    factory that takes a keyword `settings`: the generators that load weights read them."""

    model_path: str | None = None
    """A local model folder or GGUF file; None: the factory's own default."""
    dtype: str = "auto"
    """float32, bfloat16 or float16; auto: bfloat16 on a CPU or GPU that has it natively,
    else float32 on a CPU and float16 on a GPU."""
    kv_cache_bytes: int = 256 * 2**20
    """The KV cache preallocated on each device, from which its token budget follows."""
    weights_cache: str | None = None
    """Where a GGUF file's converted copy is kept ("off": nowhere); None: the XDG cache."""
    prefix_caching: bool = True
    """Share cached blocks of KV between sequences with the same prefix."""
    cpu_threads: int = 0
    """A CPU device's compute threads, each pinned to a core; 0: every core but the event
    loop's (all of them on two cores or fewer)."""
    compile_layers: bool = True
    """On a CPU device, the pass through the layers compiled by inductor (`layer_loop.py`)."""


class BadStep(RuntimeError):
    """A step answered with something other than one str, Made or None per sequence."""


def check_step(tokens: object, count: int) -> list[StepAnswer]:
    """A step's answer, if it keeps the contract."""
    if not isinstance(tokens, list) or len(tokens) != count:
        size = len(tokens) if isinstance(tokens, list) else type(tokens).__name__
        raise BadStep(f"step answered {size} for {count} sequences")
    if not all(token is None or isinstance(token, str | Made) for token in tokens):
        raise BadStep("step answered something other than str, Made or None")
    return tokens


def token_counter(generator: Generator) -> Callable[[str], int]:
    """The generator's own count of a text's tokens, else its UTF-8 bytes."""
    counter = getattr(generator, "count_tokens", None)
    if callable(counter):
        return lambda text: int(counter(text))
    return lambda text: len(text.encode())


def max_token_bytes(generator: Generator) -> int | None:
    """The most UTF-8 bytes of a prompt one of the generator's tokens stands for: its own
    `max_token_bytes`, 1 where its tokens are the bytes, else None (no bound known)."""
    bound = getattr(generator, "max_token_bytes", None)
    if isinstance(bound, int) and not isinstance(bound, bool) and bound >= 1:
        return bound
    return None if callable(getattr(generator, "count_tokens", None)) else 1


ChatFormatter = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]
"""A chat's messages (OpenAI's shape) and its tools (or None) as one prompt."""


def chat_formatter(generator: Generator) -> ChatFormatter:
    """The generator's own `chat_prompt(messages, tools)`; one that takes no `tools` gets
    the chat with the tools written in (`chat_tools.fallback_messages`); else the plain
    template."""
    formatter = getattr(generator, "chat_prompt", None)
    if not callable(formatter):
        return plain_chat_prompt
    if "tools" in inspect.signature(formatter).parameters:
        return lambda messages, tools: str(formatter(messages, tools=tools))
    return lambda messages, tools: str(formatter(fallback_messages(messages, tools)))


class SimulatedGenerator:
    """Stands in for a decoder the way `SimulatedDevice` stands in for a batch model.

    Its answer to a prompt is the prompt reversed, one character a token, then the end of
    sequence, so a test can check every stream against its own prompt; with `ignore_eos`, or
    before `min_tokens`, it goes on reversing from the top (other params change nothing). A
    step sleeps `fixed_s` plus `per_token_s` for each token it processes: a new sequence's
    prompt and what it has generated (prefill, also after a release), one for each sequence
    already decoding. A concurrent step, or one over the budget, raises; a prompt carrying
    the poison marker makes every step that carries it raise, `fail_rate` makes a share of
    steps raise, and the first step that carries a prompt with the hang marker sleeps
    `hang_s` (once, on whichever device runs it first).
    """

    def __init__(
        self,
        device: str,
        *,
        fixed_s: float,
        per_token_s: float,
        kv_budget_tokens: int,
        fail_rate: float = 0.0,
        hang_s: float = 10.0,
        hangs: Hangs | None = None,
        seed: int = 0,
    ) -> None:
        self.device = device
        self.kv_budget_tokens = kv_budget_tokens
        self._fixed_s = fixed_s
        self._per_token_s = per_token_s
        self._fail_rate = fail_rate
        self._hang_s = hang_s
        self._hangs = hangs or Hangs()
        self._random = random.Random(f"{seed}:{device}")
        self._prefilled: set[str] = set()
        self._busy = threading.Lock()
        self.steps = 0

    def __repr__(self) -> str:
        return f"<SimulatedGenerator {self.device} steps={self.steps}>"

    max_token_bytes = 4
    """A token is a character: at most 4 UTF-8 bytes."""

    def count_tokens(self, text: str) -> int:
        return len(text)

    def step(self, seqs: list[Seq]) -> list[str | None]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{self.device} was entered by two steps at once")
        try:
            held = sum(len(s.prompt) + len(s.tokens) + 1 for s in seqs)
            if not seqs or held > self.kv_budget_tokens:
                raise ValueError(f"a step of {len(seqs)} sequences holding {held} tokens")
            self.steps += 1
            new = [s for s in seqs if s.id not in self._prefilled]
            processed = sum(len(s.prompt) + len(s.tokens) for s in new) + len(seqs) - len(new)
            if self._hangs.claim([s.prompt for s in seqs]):
                self._hangs.hold(self._hang_s)
            time.sleep(self._fixed_s + self._per_token_s * processed)
            if any(POISON_MARKER in s.prompt for s in seqs):
                raise SimulatedFault("a sequence of the step carries the poison marker")
            if self._random.random() < self._fail_rate:
                raise SimulatedFault("injected step failure")
            self._prefilled.update(s.id for s in new)
            return [sim_token(s.prompt, len(s.tokens), _ends_held(s)) for s in seqs]
        finally:
            self._busy.release()

    def release(self, seq_ids: list[str]) -> None:
        self._prefilled.difference_update(seq_ids)


def sim_token(prompt: str, index: int, held: bool = False) -> str | None:
    """The simulated generator's token `index` for `prompt`: None once it has said it all,
    unless the end is `held`; then it says it again (a space for an empty prompt)."""
    if index < len(prompt):
        return prompt[-1 - index]
    if held:
        return prompt[-1 - index % len(prompt)] if prompt else " "
    return None


def _ends_held(seq: Seq) -> bool:
    """Whether the sequence's params hold its end of sequence back at this token (vLLM's
    `ignore_eos` and `min_tokens`, checked at admission by `rules/sampling_params.py`)."""
    return bool(seq.params.get("ignore_eos")) or len(seq.tokens) < seq.params.get("min_tokens", 0)


def simulated_generator_factory(
    *,
    fixed_s: float,
    per_token_s: float,
    kv_budget_tokens: int,
    fail_rate: float,
    hang_s: float,
    seed: int,
) -> GeneratorFactory:
    hangs = Hangs()

    def load(device: str) -> Generator:
        return SimulatedGenerator(
            device,
            fixed_s=fixed_s,
            per_token_s=per_token_s,
            kv_budget_tokens=kv_budget_tokens,
            fail_rate=fail_rate,
            hang_s=hang_s,
            hangs=hangs,
            seed=seed,
        )

    return load


def generator_factory(
    path_or_factory: str | Callable[[str], object],
    flag: str,
    simulated: GeneratorFactory,
    settings: GeneratorSettings | None = None,
) -> GeneratorFactory:
    """The factory `path_or_factory` names ("sim": `simulated`), wrapped to hand it the
    settings if it takes them and to check what it loads on each device."""
    if path_or_factory == SIM:
        factory: Callable[..., object] = simulated
    elif isinstance(path_or_factory, str):
        factory = import_attr(path_or_factory, flag)
    else:
        factory = path_or_factory
    name = path_or_factory if isinstance(path_or_factory, str) else "the generator factory"

    if settings is not None and _takes_settings(factory):
        factory = functools.partial(factory, settings=settings)

    def load(device: str) -> Generator:
        generator = factory(device)
        budget = getattr(generator, "kv_budget_tokens", None)
        if not isinstance(generator, Generator) or not callable(generator.step):
            raise StartupError(
                f"{flag} {name} returned {type(generator).__name__} for {device}, not a"
                " generator (kv_budget_tokens, step, release)"
            )
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise StartupError(f"{flag} {name}: kv_budget_tokens must be an int of 1 or more")
        return generator

    return load


def _takes_settings(factory: Callable[..., object]) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: it takes the device only
        return False
    return "settings" in parameters
