"""A tiny Llama and its tokenizer, built from fixed seeds with no files: the real code path of
`batchserve.models.causal_lm` (transformers' LlamaForCausalLM, a byte-level BPE tokenizer)
in a second.

`taught_model` also learns one sentence by heart, so its greedy output is known text whose
multi-byte characters span several tokens: what incremental detokenization must get right.
"""

from __future__ import annotations

from typing import Any

SENTENCE = "Le café coûte 3€ 😀 日本語 — ünïcödé ok."
"""What `taught_model` writes after `TEACHER_PROMPT`: several characters of 2, 3 and 4 bytes."""
TEACHER_PROMPT = "Say:"
CORPUS = [
    "the cat sat on the mat and the dog ran to the park",
    "a bird in the hand is worth two in the bush",
    "Say: hello there, and then say it again",
]
EOS = "<eos>"


def tokenizer() -> Any:
    """Byte-level BPE with few merges: a multi-byte character is two to four tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)


def model(vocab_size: int, eos_id: int, *, seed: int = 0) -> Any:
    """Random weights from `seed`, float32, on the CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def taught_model(tok: Any, *, steps: int = 300, seed: int = 1) -> Any:
    """A tiny model that has learned to write SENTENCE, then the end, after TEACHER_PROMPT."""
    import torch

    taught = model(len(tok), tok.eos_token_id, seed=seed)
    ids = torch.tensor([[*tok.encode(TEACHER_PROMPT + SENTENCE), tok.eos_token_id]])
    taught.train()
    optimiser = torch.optim.Adam(taught.parameters(), lr=1e-2)
    for _ in range(steps):
        optimiser.zero_grad()
        taught(input_ids=ids, labels=ids).loss.backward()
        optimiser.step()
    return taught.eval()
