"""The HTTP doors onto the engine: each parses its protocol, calls the engine, answers."""
