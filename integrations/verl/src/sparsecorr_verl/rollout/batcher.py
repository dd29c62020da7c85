"""Concurrent requests gathered into batch engine calls, on the server's event loop.

verl sends one ``generate`` call per rollout, concurrently; the engine decodes a ``[B, T]``
batch. `RequestBatcher` queues the requests and runs one engine call at a time:

- a batch is the oldest waiting request plus every waiting request with the same
  `SamplingKey`, up to ``max_batch`` rows; it starts when ``max_batch`` such requests wait or
  ``window_s`` after the oldest arrived, whichever comes first (requests arriving while a batch
  runs wait for the next one);
- inside a batch the rows are ordered by ``request_id``, so a batch's result does not depend on
  the order the requests arrived in (with a seeded `SamplingKey` a batch equals one direct
  ``generate`` call on its prompts in that order with ``torch.Generator().manual_seed(seed)``);
- the engine call runs in a worker thread, so the loop keeps answering control calls while it
  decodes; `engine_lock` is held during the call (weight updates and memory release take it, so
  they wait for the running batch and never change the model under it);
- `abort` resolves every waiting request as aborted (``None``) and waits for the running batch,
  whose requests get their results; after it, new requests wait until `resume` (or, with
  ``reject=True``, are resolved as aborted at once);
- `pause_engine` / `resume_engine` stop and restart taking batches (memory released).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .requests import Completion, EngineRequest

__all__ = ["RequestBatcher"]

RunBatch = Callable[[Sequence[EngineRequest]], list[Completion]]


@dataclass
class _Waiting:
    request: EngineRequest
    future: asyncio.Future
    arrived: float


class RequestBatcher:
    """Gathers `EngineRequest` objects into engine calls of ``run(requests) -> completions``.

    Args:
        run: the blocking engine call (one `SamplingKey` per call, rows in the given order).
        max_batch: most requests per call.
        window_s: how long the oldest waiting request waits for others (seconds).
    """

    def __init__(self, run: RunBatch, *, max_batch: int, window_s: float) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch: expected an int >= 1, got {max_batch!r}")
        if not isinstance(window_s, (int, float)) or window_s < 0:
            raise ValueError(f"window_s: expected a number >= 0, got {window_s!r}")
        self._run, self.max_batch, self.window_s = run, max_batch, float(window_s)
        self._queue: list[_Waiting] = []
        self._loop_task: asyncio.Task | None = None
        self._arrived: asyncio.Event | None = None
        self._admit: asyncio.Event | None = None
        self._engine_ok: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._rejecting = False
        self.batches_run = 0

    def _start(self) -> None:
        if self._loop_task is None:
            self._arrived, self._admit, self._engine_ok = asyncio.Event(), asyncio.Event(), asyncio.Event()
            self._admit.set()
            self._engine_ok.set()
            self._lock = asyncio.Lock()
            self._loop_task = asyncio.get_running_loop().create_task(self._serve())

    @property
    def engine_lock(self) -> asyncio.Lock:
        """Held while an engine call runs."""
        self._start()
        return self._lock

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def submit(self, request: EngineRequest) -> Completion | None:
        """The request's `Completion`, or None when it was aborted."""
        self._start()
        while not self._admit.is_set():
            if self._rejecting:
                return None
            await self._admit.wait()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append(_Waiting(request, future, loop.time()))
        self._arrived.set()
        return await future

    async def abort(self, *, reject: bool = False) -> list[str]:
        """Resolve every waiting request as aborted and wait for the running batch; requests that
        arrive afterwards wait for `resume` (``reject``: are aborted at once). Returns the ids of
        the aborted requests."""
        self._start()
        self._admit.clear()
        self._rejecting = reject
        aborted = [w for w in self._queue if not w.future.done()]
        self._queue.clear()
        for w in aborted:
            w.future.set_result(None)
        async with self._lock:  # the running batch, if any, finishes first
            pass
        return [w.request.request_id for w in aborted]

    def resume(self) -> None:
        """Admit requests again after `abort`."""
        self._start()
        self._rejecting = False
        self._admit.set()

    async def pause_engine(self) -> None:
        """Take no new batch (waiting requests stay queued) and wait for the running one."""
        self._start()
        self._engine_ok.clear()
        async with self._lock:
            pass

    def resume_engine(self) -> None:
        self._start()
        self._engine_ok.set()

    def _same_key(self) -> list[_Waiting]:
        key = self._queue[0].request.key
        return [w for w in self._queue if w.request.key == key][: self.max_batch]

    async def _gather(self) -> list[_Waiting]:
        """Wait for a batch: the window after the oldest waiting request, or a full batch."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            deadline = self._queue[0].arrived + self.window_s
            while self._queue and len(self._same_key()) < self.max_batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            await self._engine_ok.wait()
            if self._queue:
                batch = self._same_key()
                taken = {id(w) for w in batch}
                self._queue = [w for w in self._queue if id(w) not in taken]
                return sorted(batch, key=lambda w: w.request.request_id)

    async def _serve(self) -> None:
        try:
            await self._batches()
        except BaseException as exc:  # never leave a caller waiting on a dead loop
            for w in self._queue:
                if not w.future.done():
                    w.future.set_exception(RuntimeError(f"the request batcher stopped: {exc!r}"))
            self._queue.clear()
            raise

    async def _batches(self) -> None:
        while True:
            batch = await self._gather()
            async with self._lock:
                live = [w for w in batch if not w.future.done()]
                if not live:
                    continue
                try:
                    results = await asyncio.to_thread(self._run, [w.request for w in live])
                except Exception as exc:  # every request of the call gets the engine's error
                    for w in live:
                        if not w.future.done():
                            w.future.set_exception(exc)
                    continue
                finally:
                    self.batches_run += 1
            for w, result in zip(live, results):
                if not w.future.done():
                    w.future.set_result(result)

    async def close(self) -> None:
        """Abort what waits and stop the loop."""
        if self._loop_task is not None:
            await self.abort()
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
