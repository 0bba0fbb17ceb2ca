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


def write_gguf(path: Any, tok: Any, taught: Any) -> None:
    """`taught` and `tok` as a float32 GGUF file, laid out as llama.cpp's converter writes a
    Llama (its q and k rows permuted, which transformers' reader undoes), so that reading it
    back gives the same tensors and token ids."""
    import json

    import gguf
    import numpy

    config = taught.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tok))
    bpe = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token == EOS else 1 for token in tokens])  # 3: control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.eos_token_id)
    weights = {name: tensor.numpy() for name, tensor in taught.state_dict().items()}

    def permuted(rows: Any, heads: int) -> Any:
        return (
            rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
            .swapaxes(1, 2)
            .reshape(rows.shape)
        )

    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    names = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }  # fmt: skip
    for layer in range(config.num_hidden_layers):
        for ours, theirs in names.items():
            tensor = weights[f"model.layers.{layer}.{theirs}.weight"]
            if ours == "attn_q":
                tensor = permuted(tensor, config.num_attention_heads)
            elif ours == "attn_k":
                tensor = permuted(tensor, config.num_key_value_heads)
            writer.add_tensor(f"blk.{layer}.{ours}.weight", numpy.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
