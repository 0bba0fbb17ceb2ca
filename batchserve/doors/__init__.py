"""The HTTP doors: the wire format, connections and Unix sockets, and the handlers for
status, admin, the dashboard (and its static/ files), OpenAI, OIP and generation, each
declaring its routes with their OpenAPI operations (openapi.py builds /openapi.json).
May import the engine and everything below it; never the server or the CLI."""
