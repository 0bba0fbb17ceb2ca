"""What travels from a handler through the batcher to a device: the request and its
ticket, the deadline timer, the answers to a failed batch (faults) and their rescue, the
poison memory, and shedding.
May import models, devices, rules and the bottom modules; not the batcher, pool or engine."""
