"""Request batching: concurrent requests of one task decode together, joining and leaving a
running batch between its steps.

Each task has one :class:`Batcher`: an asyncio queue that request handlers put jobs on, one
coroutine that gathers them, and one worker thread that runs the pipeline (so the event loop keeps
answering while a batch decodes). A batch starts with the oldest waiting job plus every job with
the same *key* (the settings a pipeline call shares: sampling, seed, ...) that arrives within
``wait_s`` of it, up to ``max_batch_size``. While it decodes, the pipeline asks between steps for
more (:meth:`Rows.more`): jobs of the same key that arrived since
join the running batch as rows finish or while there is room (continuous batching), unless an
older job of another key waits (that one goes next, in order).

Each job has a :class:`Row`: the worker thread streams the row's text to it as each verification
step accepts tokens, finishes it as soon as the row ends (its response goes out then, not when the
batch ends), and reads its cancel flag between steps. A job whose client goes away -- before its
batch starts or while it decodes -- is dropped / cancelled: its row leaves the batch before the
next step, the others decode on unchanged. More than ``max_queue`` waiting jobs:
:meth:`Batcher.submit` raises a 429 :class:`~mmspec.serve.errors.APIError`.

The pipelines decode a batch so that every row is its batch-size-1 output, so a greedy request
answers the same alone or batched, whoever joins or leaves.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Hashable, Sequence

from .errors import APIError

log = logging.getLogger("mmspec.serve")

#: run_batch(key, items, rows) -> one result per row of ``rows`` (joined rows included, same order),
#: or raises for the whole batch; ``rows`` is the run's :class:`Rows`
RunBatch = Callable[[Hashable, Sequence[Any], "Rows"], Sequence[Any]]
#: how often a request whose batch runs checks whether its client is still there (seconds)
DISCONNECT_POLL_S = 0.25


@dataclass
class BatchInfo:
    """What a result's request went through: the rows decoding together when it started, and its
    wait in the queue."""

    batch_size: int
    queue_wait_s: float


@dataclass
class Job:
    """One request's row: its batch key, its input, and where its result and text go."""

    key: Hashable
    item: Any
    future: asyncio.Future
    is_disconnected: Callable[[], Awaitable[bool]] | None = None
    events: asyncio.Queue | None = None  # streamed text pieces (a streaming request), then None at the end
    enqueued_at: float = field(default_factory=time.perf_counter)
    cancel: threading.Event = field(default_factory=threading.Event)
    info: BatchInfo | None = None
    emitted: bool = False  # text went out already (a failed batch cannot rerun this row alone)
    last_read: float = field(default_factory=time.monotonic)  # when the stream last took an event


class Row:
    """One job as the worker thread sees it while its batch decodes (thread-safe)."""

    def __init__(self, batcher: "Batcher", job: Job) -> None:
        self.batcher, self.job = batcher, job

    def text(self, piece: str) -> None:
        """The row's next piece of text, to its stream (if it streams)."""
        job = self.job
        if job.events is not None:
            job.emitted = True
            self.batcher.loop.call_soon_threadsafe(job.events.put_nowait, piece)

    def finish(self, result: Any) -> None:
        """The row's result, now (its response goes out before the batch ends)."""
        self.batcher.loop.call_soon_threadsafe(self.batcher._resolve, self.job, result)

    def cancelled(self) -> bool:
        """Whether the row should leave the batch: its client went away, or (streaming) the client
        has not taken an event for ``stall_s`` while events wait."""
        job = self.job
        if job.cancel.is_set():
            return True
        stalled = (job.events is not None and job.events.qsize() > 0
                   and time.monotonic() - job.last_read > self.batcher.stall_s)
        if stalled:
            log.info("mmspec serve: a %s stream stalled for %.0f s; its row leaves the batch", self.batcher.name,
                     self.batcher.stall_s)
            job.cancel.set()
        return stalled


class Rows(list):
    """The rows of one run (a list of :class:`Row`, joined ones appended), and :meth:`more`: jobs
    of the run's key that join it now."""

    def __init__(self, batcher: "Batcher", key: Hashable, jobs: Sequence[Job]) -> None:
        super().__init__(Row(batcher, job) for job in jobs)
        self.batcher, self.key = batcher, key
        self.active = len(jobs)

    def more(self) -> list[tuple[Any, Row]]:
        """(item, row) of the waiting jobs of this key that join now (worker thread; none while an
        older job of another key waits, or the batch is full)."""
        batcher = self.batcher
        room = batcher.max_batch_size - self.active
        if room <= 0 or batcher.waiting == 0 or batcher.task.done():
            return []
        # _take has no await: on the loop it runs whole or not at all, so a take that is given up
        # (the loop closing) never loses jobs
        taking = asyncio.run_coroutine_threadsafe(batcher._take(self.key, room, self.active), batcher.loop)
        while True:
            try:
                jobs = taking.result(timeout=1.0)
                break
            except TimeoutError:
                if batcher.task.done() or batcher.loop.is_closed():
                    taking.cancel()
                    return []
            except Exception:  # the loop is shutting down: no more joins
                return []
        rows = [Row(batcher, job) for job in jobs]
        self.extend(rows)
        self.active += len(rows)
        return [(row.job.item, row) for row in rows]

    def finish(self, index: int, result: Any) -> None:
        """Row ``index`` ended (its result, or an exception for it): answered now, room for another."""
        self[index].finish(result)
        self.active -= 1


class Batcher:
    """Gathers jobs of one task into batches and runs them on one worker thread.

    Args:
        name: the task (thread name, logs).
        run_batch: ``(key, items, rows) -> results``, called on the worker thread.
        max_batch_size: rows decoding together at most.
        max_queue: waiting jobs at most; more are refused with 429.
        wait_s: how long a batch's first job waits for company.
        executor: the worker (one thread); made here when None.
        stall_s: a streaming client that takes no event for this long while events wait is
            treated as gone.
    """

    def __init__(self, name: str, run_batch: RunBatch, max_batch_size: int = 8, max_queue: int = 64,
                 wait_s: float = 0.01, executor: ThreadPoolExecutor | None = None, stall_s: float = 30.0) -> None:
        self.name = name
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.wait_s = wait_s
        self.stall_s = stall_s
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix=f"mmspec-serve-{name}")
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.pending: deque[Job] = deque()  # taken off the queue, not yet run
        self.waiting = 0  # submitted and not yet started
        self.dropped = 0  # jobs whose client left before their batch ran
        self.cancelled = 0  # jobs whose client left while their row decoded
        self.joined = 0  # jobs that joined a running batch
        self.batches: list[int] = []  # sizes of the batches started (most recent last, capped)
        self.running = 0  # batches decoding now (on the worker thread)
        self.task = self.loop.create_task(self._gather_forever(), name=f"mmspec-serve-{name}")

    async def submit(self, key: Hashable, item: Any,
                     is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> tuple[Any, BatchInfo]:
        """Queue one row and wait for its result: ``(result, BatchInfo)``. While it waits, its client
        is checked every :data:`DISCONNECT_POLL_S`; gone, its row is cancelled (499).

        Raises:
            APIError: 429 when ``max_queue`` jobs wait already; 503 when the server shuts down;
                499 when the client went away.
            Exception: what ``run_batch`` raised for this row.
        """
        job = self.enqueue(key, item, is_disconnected)
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(job.future), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if is_disconnected is not None and await _safe(is_disconnected):
                        self.cancel(job)
                        raise APIError(499, "the client closed the request", code="client_closed") from None
        except asyncio.CancelledError:
            self.cancel(job)  # the handler was cancelled (client gone)
            raise

    def enqueue(self, key: Hashable, item: Any, is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                stream: bool = False) -> Job:
        """Queue one row (``stream``: its text comes as events, :meth:`events`). Raises APIError 429 / 503."""
        self.check_room()
        job = Job(key, item, self.loop.create_future(), is_disconnected, asyncio.Queue() if stream else None)
        self.waiting += 1
        self.queue.put_nowait(job)
        return job

    async def events(self, job: Job) -> AsyncIterator[str]:
        """A streaming job's text pieces as they come; ends when its row ends (then await
        ``job.future``). Leaving the iteration early (the client went away) cancels the row."""
        finished = False
        try:
            while True:
                job.last_read = time.monotonic()
                piece = await job.events.get()
                if piece is None:
                    finished = True
                    return
                yield piece
        finally:
            if not finished:
                self.cancel(job)

    def cancel(self, job: Job) -> None:
        """The job's client is gone: a waiting job is dropped when its batch forms, a running row
        leaves its batch before the next step."""
        if not job.cancel.is_set():
            job.cancel.set()
            if job.info is not None and not job.future.done():
                self.cancelled += 1
            # no one awaits the job's result now: take it when it comes (no "never retrieved" warning)
            job.future.add_done_callback(lambda f: f.cancelled() or f.exception())

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
        return await self._choose(key, self.max_batch_size, 0, stop_at_other_key=False)

    async def _take(self, key: Hashable, room: int, active: int) -> list[Job]:
        """On the loop, for a running batch of ``key``: up to ``room`` waiting jobs of that key,
        none behind an older job of another key (so every key gets its turn, in order). No await
        (see :meth:`Rows.more`): a client gone is seen by its cancel flag (its handler's check)."""
        while not self.queue.empty():
            self.pending.append(self.queue.get_nowait())
        jobs = self._choose_now(key, room, active, stop_at_other_key=True)
        self.joined += len(jobs)
        return jobs

    async def _choose(self, key: Hashable, room: int, active: int, stop_at_other_key: bool) -> list[Job]:
        """Take up to ``room`` pending jobs of ``key`` off ``pending`` (in order; with
        ``stop_at_other_key``, only those before the first job of another key), dropping those
        whose client is gone (asking each client); each gets its BatchInfo."""
        for job in list(self.pending):
            if job.key == key and job.is_disconnected is not None and not job.cancel.is_set() \
                    and await _safe(job.is_disconnected):
                job.cancel.set()
        return self._choose_now(key, room, active, stop_at_other_key)

    def _choose_now(self, key: Hashable, room: int, active: int, stop_at_other_key: bool) -> list[Job]:
        """:meth:`_choose` without asking the clients (their cancel flags only)."""
        chosen, rest, blocked = [], deque(), False
        for job in self.pending:
            blocked = blocked or (stop_at_other_key and job.key != key)
            (chosen if not blocked and job.key == key and len(chosen) < room else rest).append(job)
        self.pending = rest
        batch = []
        for job in chosen:
            self.waiting -= 1
            if job.future.done() or job.cancel.is_set():
                self.dropped += 1
                if not job.future.done():  # its handler answers no one; it ends without a traceback
                    job.future.set_exception(APIError(499, "the client closed the request before it ran", code="client_closed"))
                self._end_events(job)
                continue
            batch.append(job)
        started = time.perf_counter()
        for job in batch:
            job.info = BatchInfo(active + len(batch), started - job.enqueued_at)
        return batch

    def _resolve(self, job: Job, result: Any) -> None:
        """On the loop: a job's result (or exception) and the end of its events."""
        if not job.future.done():
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result((result, job.info))
        self._end_events(job)

    @staticmethod
    def _end_events(job: Job) -> None:
        if job.events is not None:
            job.events.put_nowait(None)

    async def _run(self, batch: list[Job]) -> None:
        self.batches = (self.batches + [len(batch)])[-1000:]
        rows = Rows(self, batch[0].key, batch)
        self.running += 1
        try:
            results = await self.loop.run_in_executor(self.executor, self._call, batch[0].key, rows)
        except Exception as error:
            for row in rows:
                self._resolve(row.job, error)
            return
        finally:
            self.running -= 1
        for row, result in zip(rows, results):
            self._resolve(row.job, result)

    def _call(self, key: Hashable, rows: Rows) -> list[Any]:
        """On the worker thread: the batch, and when it fails with more than one row, each row
        that has streamed nothing yet alone, so one bad row fails only its own request."""
        try:
            results = list(self.run_batch(key, [row.job.item for row in rows], rows))
        except Exception as error:
            if len(rows) == 1:
                raise
            log.info("mmspec serve: a %s batch of %d failed (%s); running its rows one at a time", self.name, len(rows), error)
            results = []
            for row in list(rows):
                if row.job.future.done() or row.job.emitted:
                    results.append(error)
                    continue
                alone = Rows(self, key, [row.job])
                try:
                    results.append(self.run_batch(key, [row.job.item], _NoJoins(alone))[0])
                except Exception as row_error:
                    results.append(row_error)
        if len(results) != len(rows):
            raise RuntimeError(f"the {self.name} pipeline returned {len(results)} results for {len(rows)} requests")
        return results

    async def close(self) -> None:
        """Stop gathering; jobs still waiting get a 503 (the batch now running finishes, without
        taking new rows)."""
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
            self._end_events(job)
        self.pending.clear()


class _NoJoins(Rows):
    """A row run again alone after its batch failed: it takes no company."""

    def __init__(self, rows: Rows) -> None:
        list.__init__(self, rows)
        self.batcher, self.key, self.active = rows.batcher, rows.key, len(rows)

    def more(self) -> list[tuple[Any, Row]]:
        return []


async def _safe(check: Callable[[], Awaitable[bool]]) -> bool:
    try:
        return bool(await check())
    except Exception:
        return False
