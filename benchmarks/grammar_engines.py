"""Compile time and per-step mask cost of xgrammar and llguidance on one tokenizer: what
chose batchserve's grammar engine (batchserve/models/grammar.py).

    python benchmarks/grammar_engines.py MODEL_FOLDER   # a folder with a tokenizer.json

For each schema: the engine's compile (xgrammar, ahead) or matcher creation (llguidance,
lazy), then a walk of 60 tokens chosen at random among those the mask allows, timing each
mask fill (p50 and p99 over the walk). Then one mask applied to 16 rows of logits.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from typing import Any

SCHEMAS: dict[str, Any] = {
    "person": {"type": "object", "properties": {"name": {"type": "string"},
               "age": {"type": "integer"}}, "required": ["name", "age"],
               "additionalProperties": False},
    "enum+array": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
                   "required": ["color", "tags"]},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
               "id": {"type": "integer"}, "email": {"type": "string", "format": "email"}},
               "required": ["id", "email"]}, "items": {"type": "array", "items": {
               "type": "object", "properties": {"sku": {"type": "string",
               "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1}},
               "required": ["sku", "qty"]}}}, "required": ["user", "items"]},
    "anyOf": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "number"}},
         "required": ["kind", "x"]},
        {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}},
         "required": ["kind", "y"]}]},
    "object": {"type": "object"},
}  # fmt: skip
STEPS = 60


def walk(fill: Any, allowed: Any, accept: Any, seed: int = 0) -> list[float]:
    """Seconds of each mask fill along a random walk the mask allows."""
    chooser, times = random.Random(seed), []
    for _ in range(STEPS):
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        tokens = allowed()
        if not tokens or not accept(chooser.choice(tokens)):
            break
    return times


def quantiles(times: list[float]) -> str:
    ordered = sorted(times)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    return f"{1e6 * statistics.median(ordered):.0f} / {1e6 * p99:.0f}"


def main(folder: str) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    vocab = len(tok)
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), max_threads=1,
        cache_enabled=False,
    )  # fmt: skip
    ll_tok = llguidance.hf.from_tokenizer(tok)
    print("| schema | xgrammar compile ms | xgrammar mask p50 / p99 µs |"
          " llguidance matcher ms | llguidance mask p50 / p99 µs |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        xgr_compile = time.perf_counter() - start
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def xgr_allowed(mask: Any = bitmask) -> list[int]:
            logits = torch.zeros(1, vocab)
            xgr.apply_token_bitmask_inplace(logits, mask)
            return torch.nonzero(logits[0] == 0).flatten().tolist()  # type: ignore[no-any-return]

        xgr_times = walk(
            lambda m=matcher, b=bitmask: m.fill_next_token_bitmask(b, 0),
            xgr_allowed,
            lambda token, m=matcher: m.accept_token(token) and not m.is_terminated(),
        )
        start = time.perf_counter()
        ll = llguidance.LLMatcher(
            ll_tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        )
        ll_create = time.perf_counter() - start
        ll_mask = llguidance.torch.allocate_token_bitmask(1, ll_tok.vocab_size)

        def ll_allowed(mask: Any = ll_mask) -> list[int]:
            logits = torch.zeros(1, ll_tok.vocab_size)
            llguidance.torch.apply_token_bitmask_inplace(logits, mask)
            return [t for t in torch.nonzero(logits[0] == 0).flatten().tolist() if t < vocab]

        ll_times = walk(
            lambda m=ll, b=ll_mask: llguidance.torch.fill_next_token_bitmask(m, b, 0),
            ll_allowed,
            lambda token, m=ll: m.consume_token(token) is not False and not m.is_stopped(),
        )
        print(f"| {name} | {1e3 * xgr_compile:.1f} | {quantiles(xgr_times)} |"
              f" {1e3 * ll_create:.1f} | {quantiles(ll_times)} |")  # fmt: skip
    logits = torch.randn(16, vocab)
    mask16 = xgr.allocate_token_bitmask(16, vocab)
    start = time.perf_counter()
    for _ in range(100):
        xgr.apply_token_bitmask_inplace(logits, mask16)
    print(f"xgrammar: one mask applied to 16 rows, {1e4 * (time.perf_counter() - start):.0f} µs")


if __name__ == "__main__":
    main(sys.argv[1])
