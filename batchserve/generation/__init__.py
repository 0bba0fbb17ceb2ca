"""Token generation: a generation request, the per-version generation model that
routes it, and the per-device step loop that runs continuous batches.
May import models, devices, rules and the bottom modules; not the engine or the doors."""
