"""Request batching: concurrent requests of one task become one pipeline call.

Each task has one :class:`Batcher`: an asyncio queue that request handlers put jobs on, one
coroutine that gathers them, and one worker thread that runs the pipeline (so the event loop keeps
answering while a batch decodes). A batch is the oldest waiting job plus every job with the same
*key* (the settings a pipeline call shares: prompt, sampling, seed, ...) that arrives within
``wait_s`` of it, up to ``max_batch_size``; jobs of other keys wait for the next batch, in order.

The pipelines decode a list with ``batch_size=`` so that every row is its batch-size-1 output, so a
greedy request answers the same alone or batched. A job whose client went away (its future was
cancelled, or ``is_disconnected()`` says so) is dropped before its batch runs. More than
``max_queue`` waiting jobs: :meth:`Batcher.submit` raises a 429 :class:`~mmspec.serve.errors.APIError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Hashable, Sequence

from .errors import APIError

log = logging.getLogger("mmspec.serve")

#: run_batch(key, items) -> one result per item (same order), or raises for the whole batch
RunBatch = Callable[[Hashable, Sequence[Any]], Sequence[Any]]


@dataclass
class Job:
    """One request's row: its batch key, its input, and where its result goes."""

    key: Hashable
    item: Any
    future: asyncio.Future
    is_disconnected: Callable[[], Awaitable[bool]] | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)


@dataclass
class BatchInfo:
    """What a result's request went through: the batch size it ran in and its wait in the queue."""

    batch_size: int
    queue_wait_s: float


class Batcher:
    """Gathers jobs of one task into batches and runs them on one worker thread.

    Args:
        name: the task (thread name, logs).
        run_batch: ``(key, items) -> results``, called on the worker thread.
        max_batch_size: jobs per call at most.
        max_queue: waiting jobs at most; more are refused with 429.
        wait_s: how long a batch's first job waits for company.
        executor: the worker (one thread); made here when None.
    """

    def __init__(self, name: str, run_batch: RunBatch, max_batch_size: int = 8, max_queue: int = 64,
                 wait_s: float = 0.01, executor: ThreadPoolExecutor | None = None) -> None:
        self.name = name
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.wait_s = wait_s
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix=f"mmspec-serve-{name}")
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.pending: deque[Job] = deque()  # taken off the queue, not yet run
        self.waiting = 0  # submitted and not yet started
        self.dropped = 0  # jobs whose client left before their batch ran
        self.batches: list[int] = []  # sizes of the batches run (most recent last, capped)
        self.task = self.loop.create_task(self._gather_forever(), name=f"mmspec-serve-{name}")

    async def submit(self, key: Hashable, item: Any,
                     is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> tuple[Any, BatchInfo]:
        """Queue one row and wait for its result: ``(result, BatchInfo)``.

        Raises:
            APIError: 429 when ``max_queue`` jobs wait already; 503 when the server shuts down.
            Exception: what ``run_batch`` raised for this row.
        """
        self.check_room()
        job = Job(key, item, self.loop.create_future(), is_disconnected)
        self.waiting += 1
        self.queue.put_nowait(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            job.future.cancel()  # the handler was cancelled (client gone): the gatherer skips it
            raise
        # (waiting is decremented by the gatherer when the job starts or is dropped)

    def check_room(self) -> None:
        """Raise APIError 429 when ``max_queue`` jobs wait, 503 when the batcher has stopped (a
        streaming handler calls it before it answers 200)."""
        if self.task.done():
            raise APIError(503, f"the {self.name} worker has stopped; the server is shutting down", code="shutting_down")
        if self.waiting >= self.max_queue:
            raise APIError(429, f"the {self.name} queue is full ({self.max_queue} requests wait); retry later",
                           code="queue_full")

    async def _gather_forever(self) -> None:
        while True:
            try:
                batch = await self._next_batch()
                if batch:
                    await self._run(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one batch stop the task's worker
                log.exception("mmspec serve: the %s batcher failed", self.name)

    async def _next_batch(self) -> list[Job]:
        """The oldest pending job and its key's company (see the module doc), clients gone dropped."""
        if not self.pending:
            self.pending.append(await self.queue.get())
        key = self.pending[0].key
        deadline = self.loop.time() + self.wait_s
        while sum(job.key == key for job in self.pending) < self.max_batch_size:
            timeout = deadline - self.loop.time()
            if timeout <= 0 and self.queue.empty():
                break
            try:
                self.pending.append(self.queue.get_nowait() if timeout <= 0 else await asyncio.wait_for(self.queue.get(), timeout))
            except (asyncio.TimeoutError, asyncio.QueueEmpty):
                break
        chosen, rest = [], deque()
        for job in self.pending:
            (chosen if job.key == key and len(chosen) < self.max_batch_size else rest).append(job)
        self.pending = rest
        batch = []
        for job in chosen:
            self.waiting -= 1
            if job.future.done() or (job.is_disconnected is not None and await _safe(job.is_disconnected)):
                self.dropped += 1
                if not job.future.done():  # its handler answers no one; it ends without a traceback
                    job.future.set_exception(APIError(499, "the client closed the request before it ran", code="client_closed"))
                continue
            batch.append(job)
        return batch

    async def _run(self, batch: list[Job]) -> None:
        started = time.perf_counter()
        infos = [BatchInfo(len(batch), started - job.enqueued_at) for job in batch]
        self.batches = (self.batches + [len(batch)])[-1000:]
        try:
            results = await self.loop.run_in_executor(self.executor, self._call, batch[0].key, [job.item for job in batch])
        except Exception as error:
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(error)
            return
        for job, result, info in zip(batch, results, infos):
            if job.future.done():
                continue
            if isinstance(result, Exception):
                job.future.set_exception(result)
            else:
                job.future.set_result((result, info))

    def _call(self, key: Hashable, items: list[Any]) -> list[Any]:
        """On the worker thread: the batch, and when it fails with more than one row, each row
        alone, so one bad row fails only its own request."""
        try:
            results = list(self.run_batch(key, items))
        except Exception as error:
            if len(items) == 1:
                raise
            log.info("mmspec serve: a %s batch of %d failed (%s); running its rows one at a time", self.name, len(items), error)
            results = []
            for item in items:
                try:
                    results.append(self.run_batch(key, [item])[0])
                except Exception as row_error:
                    results.append(row_error)
        if len(results) != len(items):
            raise RuntimeError(f"the {self.name} pipeline returned {len(results)} results for {len(items)} requests")
        return results

    async def close(self) -> None:
        """Stop gathering; jobs still waiting get a 503 (the batch now running finishes)."""
        self.task.cancel()
        try:
            await self.task
        except (asyncio.CancelledError, Exception):
            pass
        leftovers = list(self.pending)
        while not self.queue.empty():
            leftovers.append(self.queue.get_nowait())
        for job in leftovers:
            if not job.future.done():
                job.future.set_exception(APIError(503, "the server is shutting down; retry later", code="shutting_down"))
        self.pending.clear()


async def _safe(check: Callable[[], Awaitable[bool]]) -> bool:
    try:
        return bool(await check())
    except Exception:
        return False
