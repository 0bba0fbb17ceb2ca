"""The pool's wings: a device as the pool holds it, the thread it runs its model calls on,
the loading of model versions onto it, and the device-health state machine (pure: the pool
tells it what happened and does what it answers). May import batching, models, rules and
the bottom modules; not the pool, batcher or engine."""
