"""Constrained decoding for the ready-made generators: a grammar compiled for the model's
tokenizer, and each constrained sequence's matcher, which masks the tokens its grammar does
not allow before the step samples (xgrammar, imported only when a grammar is asked for).

xgrammar rather than llguidance, by a measurement on SmolLM2's tokenizer (49,152 tokens;
benchmarks/LLM.md): xgrammar compiles a schema ahead in 1-20 ms and then fills a row's
mask in 2-16 µs at the median, at most 27 µs at the p99; llguidance starts at once but fills
a mask in 5 µs at the median and 90-270 µs at the p99, since it computes masks lazily. A
step waits for its slowest row, so the p99 is what counts, and a compile off the step loop
costs the step only CPU where the two share a core. A string with `maxLength` is written as
a chain of rules (`_chained`), which xgrammar fills in a few µs where its own bounded
repetition took up to ms a row; the chain compiles in ~150 ms, once a schema for strings of
the same characters (benchmarks/LLM.md, 12).

A `GrammarSpec` is what a request asks for, in canonical text (its cache key); a `Compiled`
is a spec compiled for one tokenizer (thread-safe, shared by every device); a `Matcher` is one
sequence's place in it, on its device's thread.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

GrammarKind = Literal[
    "json_schema", "json_object", "regex", "grammar", "tool_call", "tool_auto", "tool_auto_one"
]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint in canonical text: a JSON schema as compact JSON in the order given
    (its properties' order is the output's), a regular expression, an EBNF grammar
    (xgrammar's, as vLLM's `guided_grammar`), or tools (their `[{"name", "parameters"}]` as
    JSON): `tool_call`, exactly one call of one of them, written between the tool-call tags;
    `tool_auto`, free text in which each call the model starts with the opening tag must be
    whole and valid; `tool_auto_one`, the same with the answer ending after its first call
    (`parallel_tool_calls: false`). Two requests asking for the same thing share one
    compiled grammar."""

    kind: GrammarKind
    text: str = ""


class Constraint(NamedTuple):
    """What a request's output must keep to, and the field that asked (named in a refusal)."""

    spec: GrammarSpec
    field: str


class GrammarError(ValueError):
    """A grammar that does not compile; its message says why, without the engine's paths."""


TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
"""How a tool call is written (Hermes' and Qwen's format, and the fallback prompt's)."""
JSON_SEPARATORS = (", ", ": ")


class Compiled:
    """A grammar compiled for one tokenizer: what each constrained sequence matches."""

    def __init__(self, xgr: Any, compiled: Any, stop_ids: list[int]) -> None:
        self._xgr = xgr
        self._compiled = compiled
        self._stop_ids = stop_ids

    def matcher(self, made: Sequence[int] = ()) -> Matcher:
        """A matcher at the start, or after `made` (a preempted sequence recomputed)."""
        matcher = Matcher(
            self._xgr.GrammarMatcher(self._compiled, override_stop_tokens=self._stop_ids)
        )
        for token in made:
            matcher.accept(token)
        return matcher


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        self._matcher.accept_token(token)


class GrammarCompiler:
    """Compiles specs for one tokenizer (whose logits are `vocab_size` wide, ending the
    sequence at `stop_ids`). Thread-safe; a compile releases the GIL (it runs beside the
    event loop and the steps without holding them)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Collection[int]) -> None:
        self._xgr = xgr = _xgrammar()
        self._stop_ids = sorted(stop_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self._stop_ids
        )
        # One thread: each compile runs on a worker thread already. batchserve caches
        # compiled grammars itself (bounded, generation/grammars.py).
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> Compiled:
        xgr, compiler = self._xgr, self._compiler
        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
                compiled = compiler.compile_grammar(_json_grammar(xgr, schema))
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.text)
            elif spec.kind == "grammar":
                compiled = compiler.compile_grammar(spec.text)
            elif spec.kind == "tool_call":
                compiled = compiler.compile_grammar(xgr.Grammar.union(*_calls(xgr, spec.text)))
            else:
                one = spec.kind == "tool_auto_one"
                compiled = compiler.compile_structural_tag(_triggered_calls(xgr, spec.text, one))
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_engine_message(exc)) from None
        return Compiled(xgr, compiled, self._stop_ids)


def constrain(
    torch: Any,
    logits: Any,
    matchers: Sequence[Matcher | None],
    params: list[dict[str, Any]],
    stop_ids: Collection[int],
) -> list[dict[str, Any]]:
    """Masks, in place, each row of `logits` that has a matcher to the tokens its grammar
    allows next (the other rows are not touched), and answers the rows' params with the end
    freed where it is all a grammar allows (`free_end`)."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    xgr = _xgrammar()
    vocab_size = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab_size)
    for row in rows:
        matcher = matchers[row]
        assert matcher is not None
        matcher.fill(bitmask, row)
    if logits.device.type == "cpu" and sys.byteorder == "little":
        mask_on_cpu(torch, logits, bitmask, rows)
    else:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
    return free_end(torch, logits, rows, params, stop_ids)


def mask_on_cpu(torch: Any, logits: Any, bitmask: Any, rows: list[int]) -> None:
    """What xgrammar's `apply_token_bitmask_inplace` does (-inf at each token whose bit is
    0, bit j of word i being token 32 i + j), on a little-endian CPU: each byte of the mask
    looked up as its 8 tokens' booleans packed in one int64 (one gather), where xgrammar's
    CPU kernel tests bit by bit; 0.7 ms for 16 rows of SmolLM2's 49,152 tokens, where a
    table of 8 booleans a byte took 1.6 and xgrammar's kernel 1.8 (benchmarks/LLM.md, 12)."""
    index = torch.tensor(rows)
    as_bytes = bitmask.index_select(0, index).view(torch.uint8).int()
    packed = torch.nn.functional.embedding(as_bytes, _blocked_bits(torch))
    blocked = packed.view(torch.bool).view(len(rows), -1)[:, : logits.shape[-1]]
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(blocked, float("-inf"))
    else:
        masked = logits.index_select(0, index).masked_fill_(blocked, float("-inf"))
        logits.index_copy_(0, index, masked)


@functools.cache
def _blocked_bits(torch: Any) -> Any:
    """[256, 1] int64: for each byte value, its 8 bits (low first) as 8 booleans, true
    where the bit is 0, packed in one little-endian int64."""
    blocked = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0
    return blocked.to(torch.uint8).view(torch.int64)


def free_end(
    torch: Any,
    logits: Any,
    rows: list[int],
    params: list[dict[str, Any]],
    stop_ids: Collection[int],
) -> list[dict[str, Any]]:
    """`params`, with `ignore_eos` and `min_tokens` dropped for each of the masked `rows`
    whose grammar allows nothing but the end: holding the end back there would leave no token
    to choose, and the grammar's output is complete."""
    held_back = [r for r in rows if params[r].get("ignore_eos") or params[r].get("min_tokens")]
    if not held_back:
        return params
    index = torch.tensor(held_back, device=logits.device)
    allowed = torch.isfinite(logits.index_select(0, index))
    allowed[:, sorted(stop_ids)] = False
    free = list(params)
    for row, any_other in zip(held_back, allowed.any(dim=-1).tolist(), strict=True):
        if not any_other:
            free[row] = {**params[row], "ignore_eos": False, "min_tokens": 0}
    return free


def _calls(xgr: Any, tools_text: str) -> list[Any]:
    """One grammar a tool: its call, written between the tags; GrammarError naming a tool
    whose parameters do not compile."""
    calls = []
    for name, parameters in _tools(xgr, tools_text):
        head = f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": '
        calls.append(
            xgr.Grammar.concat(
                _literal(xgr, head), parameters, _literal(xgr, "}" + TOOL_CALL_CLOSE)
            )
        )
    return calls


def _triggered_calls(xgr: Any, tools_text: str, only_one: bool) -> str:
    """A structural tag: free text, and each call begun with the opening tag a whole call;
    `only_one`: the answer ends after the first."""
    tags = [
        {
            "begin": f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": ',
            "content": {"type": "grammar", "grammar": str(parameters)},
            "end": "}" + TOOL_CALL_CLOSE,
        }
        for name, parameters in _tools(xgr, tools_text)
    ]
    triggered = {"type": "triggered_tags", "triggers": [TOOL_CALL_OPEN.strip()], "tags": tags,
                 "stop_after_first": only_one}  # fmt: skip
    return json.dumps({"type": "structural_tag", "format": triggered})


def _tools(xgr: Any, tools_text: str) -> list[tuple[str, Any]]:
    """Each tool's name and the grammar of its parameters; GrammarError naming a tool whose
    parameters do not compile."""
    grammars = []
    for tool in json.loads(tools_text):
        try:
            grammars.append((tool["name"], _json_grammar(xgr, json.dumps(tool["parameters"]))))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"tool {tool['name']}: {_engine_message(exc)}") from None
    return grammars


_LOOSE_CHARACTER = r"[^\"\\\r\n]"
_JSON_CHARACTER = r"[^\0-\x1f\"\\]"


def _json_grammar(xgr: Any, schema_text: str) -> Any:
    """The schema's grammar, its JSON written compactly. xgrammar 0.2 lets a string with a
    length bound hold control characters, which JSON forbids and parsers refuse (pydantic
    among them): its rule for such a string's characters is rewritten to JSON's. And its
    bounded repetition of those characters is rewritten as a chain of rules (`_chained`)."""
    grammar = xgr.Grammar.from_json_schema(
        schema_text, any_whitespace=False, separators=JSON_SEPARATORS
    )
    text = str(grammar)
    chained = _chained(text.replace(_LOOSE_CHARACTER, _JSON_CHARACTER))
    return grammar if chained == text else xgr.Grammar.from_ebnf(chained)


MAX_CHAINED = 256
"""The longest length bound `_chained` writes out (a rule per character); past it, xgrammar's
own repetition (its compile costs about as much per character either way)."""
_CHARACTER_RULE = re.compile(r"^(\w+) ::= \(\((\[(?:[^\]\\]|\\.)*\])\)\)$", re.MULTILINE)
_BOUNDED_STRING = re.compile(r'^(\w+) ::= \(\("\\"" (\w+)\{(\d+), (\d+)\} "\\""\)\)$', re.MULTILINE)


def _chained(text: str) -> str:
    """`text` (EBNF), each string rule `s ::= "\"" c{m, n} "\""` (c one character) written
    as `"\"" c ... c c_end{n - m}`, m times c, where `c_end{k} ::= "\"" | c c_end{k - 1}`:
    the same strings, but xgrammar fills a row's mask in such a chain in a few µs, where its
    repetition takes 40-490 µs on average and ms near the bound, on SmolLM2's tokenizer
    (benchmarks/LLM.md, section 12). The closing quote ends each link: a link that could
    be empty (`"" | c ...`) fills as slowly as the repetition. A compile costs a few ms a
    link, so strings of the same characters share one chain (through the first such c)."""
    owners: dict[str, str] = {}
    for rule, characters in _CHARACTER_RULE.findall(text):
        owners.setdefault(characters, rule)
    sharing = {rule: owners[characters] for rule, characters in _CHARACTER_RULE.findall(text)}
    rules: dict[str, str] = {}

    def chain(found: re.Match[str]) -> str:
        string, rule = found.group(1), sharing.get(found.group(2))
        least, most = int(found.group(3)), int(found.group(4))
        if rule is None or not least <= most <= MAX_CHAINED:
            return found.group(0)
        for k in range(most - least + 1):
            link = f'(("\\"") | ({rule} {rule}_end{k - 1}))' if k else '(("\\""))'
            rules[f"{rule}_end{k}"] = link
        links = " ".join(['"\\""', *[rule] * least, f"{rule}_end{most - least}"])
        return f"{string} ::= (({links}))"

    chained = _BOUNDED_STRING.sub(chain, text)
    if any(re.search(rf"^{name} ::=", text, re.MULTILINE) for name in rules):
        return text  # a name already taken (xgrammar never writes one): left as it was
    return chained + "".join(f"{name} ::= {body}\n" for name, body in rules.items())


def _xgrammar() -> Any:
    try:
        return importlib.import_module("xgrammar")
    except ImportError:
        raise GrammarError("this server has no grammar engine: pip install xgrammar") from None


def _literal(xgr: Any, text: str) -> Any:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return xgr.Grammar.from_ebnf(f'root ::= "{escaped}"')


_ENGINE_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


def _engine_message(exc: Exception) -> str:
    """The engine's reason, without its timestamp and source path, on one line."""
    text = str(exc).strip().splitlines()
    first = _ENGINE_PREFIX.sub("", text[0]) if text else type(exc).__name__
    return first[:300]
