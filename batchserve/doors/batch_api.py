"""The Batch API's parts, put together for one engine: its store (`--batch-db`, or the Redis
of `--result-store`), the runner that holds and runs batches, and the files and batches
doors, each handed only the engine's methods it calls."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from ..config import Config
from .batch_lines import LineEngine, LineRunner
from .batch_runner import BatchRunner
from .batch_store import BatchStore, SqliteBatches
from .batches_api import BatchesApi
from .face import BatchFace, Generating
from .files_api import FilesApi
from .openapi import Operation
from .wire import caller_tenant


def open_store(config: Config) -> BatchStore:
    if config.result_store.startswith("redis://"):
        from .batch_store_redis import RedisBatches

        return RedisBatches(config.result_store)
    return SqliteBatches(config.batch_db)


def mount_batches(
    engine: BatchFace,
    generation: Generating,
    add: Callable[[str, str, Any, Operation], None],
    on_start: Callable[[Callable[[web.Application], AsyncIterator[None]]], None],
) -> BatchRunner:
    """Mounts the files and batches routes, and the runner's lifespan (after the engine's,
    so that it starts with the engine up and stops before it)."""
    config = engine.config
    store = open_store(config)
    lines = LineRunner(
        LineEngine(
            infer=engine.infer,
            infer_all=engine.infer_all,
            generate=generation.generate,
            chat_prompt=generation.chat_prompt,
            embedding_dim=engine.view.embedding_dim,
            dimensions=engine.view.dimensions,
            count_tokens=engine.view.count_tokens,
        )
    )
    runner = BatchRunner(
        store,
        lines,
        clock=engine.clock,
        lease_s=config.batch_lease_s,
        in_flight=config.batch_lines_in_flight,
    )
    on_start(runner.lifespan)
    tenant_of = functools.partial(caller_tenant, reception=engine)
    FilesApi(store, tenant_of, config).mount(add)

    def served() -> list[str]:
        return [model["name"] for model in engine.view.models()]

    BatchesApi(store, runner, tenant_of, config, served).mount(add)
    return runner
