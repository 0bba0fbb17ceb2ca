"""Devices: turning --devices into device names, the thread each device runs its model
calls on, and the device-health state machine (pure: the pool tells it what happened and
does what it answers). May import only the bottom modules (errors, clock, config, tasks)."""
