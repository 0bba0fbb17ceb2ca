"""Observability: the Prometheus metrics and the event loop's own metrics.
Reads the batcher, the pool and the generation models; imported by the engine and the doors."""
