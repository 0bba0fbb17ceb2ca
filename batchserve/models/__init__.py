"""Ready-made models to serve: each module's `load(device)` is a per-device factory
(`--fn-per-device batchserve.models.minilm:load`, or `fn_per_device` in a models file).
Each needs its own optional extra; nothing here is imported unless asked for."""
