"""What is served: the contracts (specs, the batch-function backends, the generator
contract), the registry of versions and the --devices names they are placed on, plus
ready-made models. Each ready-made module's `load(device)` is a per-device factory
(`--fn-per-device batchserve.models.minilm:load`, or `fn_per_device` in a models file);
each needs its own optional extra and none is imported unless asked for. May import rules
and the bottom modules (errors, clock, config)."""
