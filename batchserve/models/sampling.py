"""The next token from a step's logits, for the ready-made generators (torch passed in, as
they import it lazily)."""

from __future__ import annotations

from typing import Any


def choose_token(torch: Any, logits: Any, params: dict[str, Any], made: int) -> int:
    """Greedy, or sampled at `params["temperature"]` when above 0, seeded by
    `params["seed"]` and the tokens `made` so far, so a sequence repeats itself."""
    temperature = float(params.get("temperature", 0) or 0)
    if temperature <= 0:
        return int(logits.argmax())
    draw = torch.Generator().manual_seed(int(params.get("seed", 0)) + made)
    probabilities = torch.softmax(logits / temperature, dim=-1).cpu()
    return int(torch.multinomial(probabilities, 1, generator=draw))
