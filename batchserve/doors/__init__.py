"""The HTTP doors: the wire format, connections and Unix sockets, and the handlers for
status, admin, the dashboard (and its static/ files), OpenAI and generation.
May import the engine and everything below it; never the server or the CLI."""
