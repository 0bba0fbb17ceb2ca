"""Log probabilities and `n` choices inside the tiny Llama's batched step (`causal_lm.py`,
`models/logprobs.py`): the numbers equal transformers' own `log_softmax` of the same weights,
only the rows that ask get them, a prompt's come out of a chunked prefill, and a choice forked
from its sibling computes only its last prompt token.
"""

from __future__ import annotations

from typing import Any

import pytest

from batchserve.models.generators import Made, Seq

from . import tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from batchserve.models.causal_lm import CausalLM  # noqa: E402
from batchserve.models.token_bytes import byte_decoder  # noqa: E402

PROMPT = " ".join(tiny_llama.CORPUS)
KV_BYTES = 2 * 2**20


def reference_logprobs(model: Any, ids: list[int]) -> Any:
    """transformers' log-probabilities at every position of `ids` ([len, vocab])."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def run(generator: CausalLM, seqs: list[Seq], chunk: int | None = None) -> list[Made]:
    """Steps until every sequence has made its first token (or ended); their last answers."""
    last: dict[str, Made] = {}
    prompt_lps: dict[str, list[Any]] = {seq.id: [] for seq in seqs}
    pending = list(seqs)
    while pending:
        for seq in pending:
            seq.chunk = chunk
        answers = generator.step(pending)
        for seq, made in zip(pending, answers, strict=True):
            prompt_lps[seq.id] += made.prompt_logprobs
            last[seq.id] = made
        pending = [s for s, m in zip(pending, answers, strict=True) if m == Made() or (
            m.token_id is None and not m.end)]  # fmt: skip
    for seq in seqs:
        object.__setattr__(last[seq.id], "prompt_logprobs", tuple(prompt_lps[seq.id]))
    return [last[seq.id] for seq in seqs]


def test_the_chosen_tokens_logprob_and_its_top_alternatives_are_transformers_own(tok, tiny):
    generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=KV_BYTES)
    asking = Seq("a", PROMPT, params={"logprobs": 3}, max_tokens=4)
    plain = Seq("b", "the dog", max_tokens=4)
    made_a, made_b = generator.step([asking, plain])
    reference = reference_logprobs(tiny, tok.encode(PROMPT))[-1]
    assert made_b.logprob is None  # a row that does not ask gets nothing
    assert made_a.logprob is not None
    assert made_a.token_id == int(reference.argmax())
    assert made_a.logprob.logprob == pytest.approx(float(reference.max()), abs=1e-5)
    best = torch.topk(reference, 3)
    assert [c.token_id for c in made_a.logprob.top] == best.indices.tolist()
    for candidate, value in zip(made_a.logprob.top, best.values.tolist(), strict=True):
        assert candidate.logprob == pytest.approx(value, abs=1e-5)
        assert candidate.token == byte_decoder(tok)(candidate.token_id)


def test_logprobs_are_the_raw_ones_before_temperature(tok, tiny):
    """vLLM's default: what the model thought, whatever the sampling made of it."""
    generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=KV_BYTES)
    params = {"logprobs": 0, "temperature": 5.0, "seed": 3}
    (made,) = generator.step([Seq("a", PROMPT, params=params, max_tokens=2)])
    reference = reference_logprobs(tiny, tok.encode(PROMPT))[-1]
    assert made.logprob is not None
    assert made.logprob.top == ()
    assert made.logprob.logprob == pytest.approx(float(reference[made.token_id]), abs=1e-5)


def test_a_prompts_logprobs_come_from_every_position_of_a_chunked_prefill(tok, tiny):
    ids = tok.encode(PROMPT)
    generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=KV_BYTES)
    echo = Seq("e", "", prompt_ids=ids, params={"prompt_logprobs": 2}, max_tokens=0)
    (made,) = run(generator, [echo], chunk=7)
    assert made.end
    assert made.token_id is None
    reference = reference_logprobs(tiny, ids)
    assert [lp.token_id for lp in made.prompt_logprobs] == ids
    assert made.prompt_logprobs[0].logprob is None  # nothing precedes the first token
    for position, lp in enumerate(made.prompt_logprobs[1:]):
        assert lp.logprob == pytest.approx(float(reference[position, ids[position + 1]]), abs=1e-4)
        assert [c.token_id for c in lp.top] == torch.topk(reference[position], 2).indices.tolist()


def test_a_choice_forked_from_its_sibling_computes_only_its_last_prompt_token(tok, tiny):
    """n choices: the sibling's prompt rows are copied (the whole blocks shared), so the
    fork's first step takes one token, and its greedy text is the sibling's."""
    generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=KV_BYTES)
    first = Seq("c0", PROMPT, params={"ignore_eos": True}, max_tokens=6)
    fork = Seq("c1", PROMPT, params={"ignore_eos": True}, max_tokens=6, fork_of="c0")
    assert generator.cached_prefix(fork).expected is False  # c0 does not run yet
    assert generator.attach(first) == 0
    assert generator.cached_prefix(fork).expected  # c0 computes the prompt: wait for it
    (made,) = run(generator, [first], chunk=9)
    first.token_ids.append(made.token_id)
    prompt = len(tok.encode(PROMPT))
    assert generator.cached_prefix(fork).tokens == prompt - 1
    assert generator.attach(fork) == prompt - 1
    texts = {"c0": [made.token_id], "c1": []}
    for _ in range(5):
        for seq in (first, fork):
            seq.chunk = None
        for seq, made in zip((first, fork), generator.step([first, fork]), strict=True):
            texts[seq.id].append(made.token_id)
            seq.token_ids.append(made.token_id)
    assert texts["c0"][:5] == texts["c1"]  # c0 is one token ahead: the same text
