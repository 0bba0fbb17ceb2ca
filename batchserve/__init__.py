"""batchserve: turns a batch function into an HTTP API that batches single requests.

Embedded in a Python program, the same engine serves without HTTP:

    async with batchserve.Engine(batchserve.Config(), fn=my_batch_fn) as engine:
        result = await engine.infer("some input")
        tagged = await engine.infer(Ask("more", model="a"), Caller(request_id="r-1"))

A generator for `--generator` implements `Generator` over `Seq`s, answering `str`, `Made` or
None per sequence, and may take a keyword `settings` (`GeneratorSettings`).
"""

from .batching.request import Ask, Result, Ticket
from .config import Config
from .engine.core import Engine
from .engine.requests import Caller, Prompt
from .models.generators import Generator, GeneratorSettings, Made, Seq

__all__ = [
    "Ask",
    "Caller",
    "Config",
    "Engine",
    "Generator",
    "GeneratorSettings",
    "Made",
    "Prompt",
    "Result",
    "Seq",
    "Ticket",
]
__version__ = "0.1.0"
