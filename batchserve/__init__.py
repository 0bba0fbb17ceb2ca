"""batchserve: turns a batch function into an HTTP API that batches single requests.

Embedded in a Python program, the same engine serves without HTTP:

    async with batchserve.Engine(batchserve.Config(), fn=my_batch_fn) as engine:
        result = await engine.infer("some input")
"""

from .batching.request import Ask, Result, Ticket
from .config import Config
from .engine.core import Engine

__all__ = ["Ask", "Config", "Engine", "Result", "Ticket"]
__version__ = "0.1.0"
