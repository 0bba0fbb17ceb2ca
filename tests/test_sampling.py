"""The sampler computes every value the params' rules accept (issue #39, item 3): a tiny
`temperature` (1e-300, below float32's range) or `top_p` (below 1e-45) made the shared step
raise, failing every stream in it. Now each accepted value samples a valid token id, and a
step with one such row and a normal row completes both."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchserve.engine.requests import Prompt
from batchserve.models.sampling import choose_tokens
from batchserve.rules.sampling_params import MAX_TEMPERATURE, MAX_TOP_K, checked_params

from . import tiny_llama

torch = pytest.importorskip("torch")

VOCAB = 40
EXTREME = [5e-324, 1e-320, 1e-300, 1e-46, 1e-45, 1e-38, 1e-30, 1e-8]
"""Subnormal and tiny floats: float32 makes them 0 or overflows dividing by them."""

temperatures = st.one_of(
    st.sampled_from([*EXTREME, MAX_TEMPERATURE]),
    st.floats(min_value=0, max_value=MAX_TEMPERATURE, allow_subnormal=True),
)
top_ps = st.one_of(
    st.none(),
    st.sampled_from([*EXTREME, 1.0]),
    st.floats(min_value=0, max_value=1, exclude_min=True, allow_subnormal=True),
)
logit_rows = st.lists(
    st.floats(min_value=-(2.0**100), max_value=2.0**100, width=32), min_size=VOCAB, max_size=VOCAB
)


@settings(max_examples=300)
@given(
    temperature=temperatures,
    top_p=top_ps,
    top_k=st.sampled_from([None, -1, 0, 1, 2, VOCAB - 1, VOCAB, MAX_TOP_K]),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    rows=st.lists(logit_rows, min_size=1, max_size=3),
    banned=st.booleans(),
)
def test_every_accepted_value_samples_a_valid_token(
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    rows: list[list[float]],
    banned: bool,
):
    asked = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    params = checked_params({**asked, "ignore_eos": banned}, max_tokens=8)  # as admitted
    logits = torch.tensor(rows, dtype=torch.float32)
    chosen = choose_tokens(torch, logits, [params] * len(rows), [0] * len(rows), {0})
    assert len(chosen) == len(rows)
    assert all(0 <= token < VOCAB for token in chosen)
    if banned:
        assert 0 not in chosen


@pytest.mark.parametrize("params", [{"temperature": 1e-300}, {"temperature": 0.7, "top_p": 1e-46}])
def test_a_tiny_value_is_greedy(params: dict[str, Any]):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    assert choose_tokens(torch, logits, [params], [0], ()) == [1]


async def test_a_step_with_an_extreme_row_and_a_normal_row_completes_both():
    from batchserve.models.causal_lm import CausalLM

    from .test_causal_lm import KV_BYTES, engine_for
    from .test_sampling_params import step_failures

    tok = tiny_llama.tokenizer()
    tiny = tiny_llama.model(len(tok), tok.eos_token_id)
    engine = engine_for(lambda device: CausalLM(tiny, tok, device, kv_cache_bytes=KV_BYTES))
    extreme = {"temperature": 1e-300, "top_p": 1e-46, "ignore_eos": True}
    normal = {"temperature": 0.8, "seed": 3, "ignore_eos": True}
    async with engine:
        async with (
            engine.generate(Prompt("the cat", max_tokens=6, params=extreme)) as a,
            engine.generate(Prompt("a bird", max_tokens=6, params=normal)) as b,
        ):
            await a.result()
            await b.result()
        assert a.summary()["tokens"] == b.summary()["tokens"] == 6
        assert step_failures(engine) == 0


def test_a_banned_end_is_skipped_in_its_row_alone_and_the_logits_stay_as_they_were():
    """ignore_eos and min_tokens keep the end from being chosen in their rows only; the
    step's logits are left untouched (its log-probabilities are read from them after)."""
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0]] * 4)
    before = logits.clone()
    params = [{"ignore_eos": True}, {}, {"min_tokens": 2}, {"min_tokens": 2}]
    assert choose_tokens(torch, logits, params, [0, 0, 1, 2], {0}) == [2, 0, 2, 0]
    assert torch.equal(logits, before)
    sampled = {"temperature": 1e-300, "ignore_eos": True}  # greedy by value, sampled by path
    assert choose_tokens(torch, logits[:1], [sampled], [0], {0}) == [2]
    assert torch.equal(logits, before)
