"""batchserve: turns a batch function into an HTTP API that batches single requests."""

__version__ = "0.1.0"
