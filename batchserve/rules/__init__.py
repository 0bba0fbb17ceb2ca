"""Pure rules: decisions about policy, fair queueing, capacity estimates, tenants,
admission and sampling params, with `now` passed in; no I/O, no tasks, no clocks of their own.
May import only batchserve.errors, batchserve.clock and batchserve.config."""
