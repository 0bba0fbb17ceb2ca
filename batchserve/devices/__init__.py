"""Devices: turning --devices into device names, and the thread each device runs
its model calls on. May import only the bottom modules (errors, clock, config, tasks)."""
