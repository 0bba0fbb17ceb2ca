"""The engine: the owner of a running server's parts (registry, batcher, pool,
generation models, metrics) and the request path, plus the access recorder.
May import everything below it; never the HTTP doors, the server or the CLI."""
