"""The engine thread: one `sparsecorr.decoding.Scheduler`, stepped while it has work.

The rollout servers of the trainer glues (verl's ``SparseCorrServer``, OpenRLHF's
``SparseRolloutActor``) receive one ``generate`` per rollout, concurrently, on an actor's event
loop. The scheduler is not thread-safe and its ``step`` blocks for one forward, so `EngineDriver` gives it
a thread of its own and talks to it through a command queue (vLLM's engine-core loop, one
process smaller):

- every scheduler call (``add_request``, ``step``, ``abort``, ``release``, ``close``) and every
  model change the server makes (``copy_weights``, ``model.to``) runs on that thread, between
  two steps, never on the event loop and never during a step;
- the thread runs every queued command, hands the scheduler the queued requests that fit its
  free row slots (``plan.rows - num_running - num_waiting``), runs one ``step``, and resolves
  each finished request's asyncio future with ``loop.call_soon_threadsafe``; a request sent
  while others decode joins the running batch at the next step;
- `pause` stops handing requests to the scheduler (they stay queued here) and resolves once the
  scheduler holds no request (the running rows finish); `resume` hands them over again;
- `abort_all` resolves every queued request as aborted (no tokens) and aborts the scheduler's
  rows (their partial tokens, ``finish_reason="aborted"``);
- `drain` resolves once every submitted request is resolved;
- an error inside ``step`` (the scheduler fails that step's rows itself; an exception out of
  ``step`` aborts its rows and fails their callers with it) never stops the thread.

Futures are resolved on the loop that created them, so one driver serves any event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .requests import RequestOutput, RequestParams

__all__ = ["DriverRequest", "EngineDriver", "aborted_output", "copy_weights", "load_inference_copy"]

logger = logging.getLogger("sparsecorr.decoding")


class DriverRequest(Protocol):
    """What `EngineDriver.submit` takes: a glue's validated request (verl's ``EngineRequest``,
    OpenRLHF's ``ActorRequest``): its id, prompt token ids and per-request sampling."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt(self) -> tuple[int, ...]: ...

    @property
    def params(self) -> RequestParams: ...


@dataclass(frozen=True, slots=True)
class _Queued:
    request: DriverRequest
    future: asyncio.Future


def aborted_output(request: DriverRequest) -> RequestOutput:
    """The output of a request aborted before it reached the scheduler: no tokens."""
    return RequestOutput(request_id=request.request_id, prompt_ids=request.prompt, token_ids=(),
                         logprobs=torch.empty(0), topk_logp=None, topk_ids=None, finish_reason="aborted")


def _settle(future: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` on its own loop (no-op once done or when its loop is closed)."""
    def done() -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    try:
        future.get_loop().call_soon_threadsafe(done)
    except RuntimeError:  # the loop that waited is closed: nobody reads the result
        pass


class EngineDriver:
    """Runs ``make_scheduler()`` on a dedicated thread and serves requests through it.

    Args:
        make_scheduler: builds the `Scheduler` (called once, on the engine thread).
        name: the thread's name.
    """

    def __init__(self, make_scheduler: Callable[[], Any], *, name: str = "sparsecorr-engine") -> None:
        self._make = make_scheduler
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started: Future = Future()
        # engine-thread state only:
        self._sched: Any = None
        self._queued: deque[_Queued] = deque()
        self._live: dict[str, asyncio.Future] = {}
        self._admitting = True
        self._idle_waiters: list[Future] = []
        self._drain_waiters: list[Future] = []
        self._closed = False
        self.steps = 0
        self.plan: Any = None  # the scheduler's MemoryPlan, once built

    # -- loop side -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread and wait (blocking) until the scheduler is built; its error is raised."""
        self._thread.start()
        self._started.result()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(scheduler)`` on the engine thread, between two steps."""
        return await asyncio.wrap_future(self._post(fn))

    async def submit(self, request: DriverRequest) -> RequestOutput:
        """The request's `RequestOutput` once it finishes (``eos``, ``length``, ``aborted`` or
        ``error``). A ValueError of ``add_request`` (a duplicate id, a bad parameter) is raised
        here, to this caller only."""
        future = asyncio.get_running_loop().create_future()
        self._post(lambda _s: self._enqueue(_Queued(request, future)))
        try:
            return await future
        except asyncio.CancelledError:  # the caller went away: free its row
            self._post(lambda _s: self._abort_one(request.request_id))
            raise

    async def abort_all(self) -> list[str]:
        """Abort every queued and running request; returns their ids."""
        return await self.call(lambda _s: self._abort_all())

    async def abort(self, request_id: str) -> bool:
        """Abort one request (queued or in the scheduler); False when it is unknown."""
        return await self.call(lambda _s: self._abort_one(request_id))

    async def pause(self) -> None:
        """Hand the scheduler no new request; returns once it holds none (its rows finished)."""
        waiter: Future = Future()

        def pause(_s) -> None:
            self._admitting = False
            self._idle_waiters.append(waiter)

        self._post(pause)
        await asyncio.wrap_future(waiter)

    async def resume(self) -> None:
        """Hand queued requests to the scheduler again (after `pause`)."""
        await self.call(lambda _s: setattr(self, "_admitting", True))

    async def drain(self) -> None:
        """Returns once every request submitted before it is resolved."""
        waiter: Future = Future()
        self._post(lambda _s: self._drain_waiters.append(waiter))
        await asyncio.wrap_future(waiter)

    async def stats(self) -> dict[str, int]:
        """Requests waiting (here and in the scheduler), rows running, steps run, the most rows
        ever resident and the planned rows."""
        return await self.call(lambda s: {
            "waiting": len(self._queued) + s.num_waiting, "running": s.num_running, "steps": self.steps,
            "max_resident": s.max_resident, "rows": s.plan.rows})

    async def close(self) -> None:
        """Abort everything, ``Scheduler.close()``, and stop the thread."""
        if self._thread.is_alive():
            await self.call(lambda _s: self._close())
            await asyncio.to_thread(self._thread.join)

    def _post(self, fn: Callable[[Any], Any]) -> Future:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("the sparsecorr engine thread is not running (closed, or never started)")
        done: Future = Future()
        self._commands.put((fn, done))
        return done

    # -- engine thread -------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._sched = self._make()
            self.plan = self._sched.plan
        except BaseException as exc:
            self._started.set_exception(exc)
            return
        self._started.set_result(None)
        while not self._closed:
            try:
                self._run_commands(block=not self._has_work())
                if self._closed:
                    break
                self._feed()
                if self._sched.has_unfinished():
                    self._step()
                self._notify()
            except Exception:  # a bug here must not leave every caller waiting on a dead thread
                logger.exception("sparsecorr engine thread: unexpected error; serving on")
        while True:  # commands posted after close: their callers get an error, not a hang
            try:
                _fn, done = self._commands.get_nowait()
            except queue.Empty:
                return
            done.set_exception(RuntimeError("the sparsecorr engine thread is closed"))

    def _has_work(self) -> bool:
        return self._sched.has_unfinished() or (self._admitting and bool(self._queued))

    def _run_commands(self, *, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            fn, done = command
            try:
                done.set_result(fn(self._sched))
            except BaseException as exc:  # the caller gets it; the thread goes on
                done.set_exception(exc)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _enqueue(self, item: _Queued) -> None:
        rid = item.request.request_id
        if rid in self._live or any(q.request.request_id == rid for q in self._queued):
            _settle(item.future, error=ValueError(f"request_id: expected an id not in flight, got {rid!r}"))
        else:
            self._queued.append(item)

    def _feed(self) -> None:
        """Queued requests into the scheduler's free row slots (in arrival order)."""
        s = self._sched
        while self._admitting and self._queued and s.plan.rows - s.num_running - s.num_waiting > 0:
            item = self._queued.popleft()
            rid = item.request.request_id
            if item.future.done():  # its caller went away
                continue
            try:
                s.add_request(rid, item.request.prompt, item.request.params)
            except Exception as exc:  # refused (a ValueError naming the field): this caller only
                _settle(item.future, error=exc)
                continue
            self._live[rid] = item.future

    def _step(self) -> None:
        try:
            outputs = self._sched.step()
        except Exception as exc:  # the scheduler should catch it itself; never stop serving
            logger.exception("sparsecorr engine step failed")
            try:
                failed = [o.request_id for o in self._sched.abort_all()]
            except Exception:
                failed = list(self._live)
            for rid in failed:
                future = self._live.pop(rid, None)
                if future is not None:
                    _settle(future, error=exc)
            return
        finally:
            self.steps += 1
        for out in outputs:
            self._resolve(out)

    def _resolve(self, out: RequestOutput) -> None:
        future = self._live.pop(out.request_id, None)
        if future is not None:
            _settle(future, out)

    def _abort_all(self) -> list[str]:
        ids = []
        while self._queued:
            item = self._queued.popleft()
            ids.append(item.request.request_id)
            _settle(item.future, aborted_output(item.request))
        for out in self._sched.abort_all():
            ids.append(out.request_id)
            self._resolve(out)
        return ids

    def _abort_one(self, request_id: str) -> bool:
        for item in list(self._queued):
            if item.request.request_id == request_id:
                self._queued.remove(item)
                _settle(item.future, aborted_output(item.request))
                return True
        out = self._sched.abort(request_id) if request_id in self._live else None
        if out is not None:
            self._resolve(out)
        return out is not None

    def _notify(self) -> None:
        """Resolve the `pause` and `drain` waiters whose condition holds."""
        idle = not self._sched.has_unfinished()
        if idle and self._idle_waiters:
            for w in self._idle_waiters:
                w.set_result(None)
            self._idle_waiters.clear()
        if idle and not self._queued and not self._live and self._drain_waiters:
            for w in self._drain_waiters:
                w.set_result(None)
            self._drain_waiters.clear()

    def _close(self) -> None:
        self._abort_all()
        for w in (*self._idle_waiters, *self._drain_waiters):
            w.set_result(None)
        self._idle_waiters.clear()
        self._drain_waiters.clear()
        self._sched.close()
        self._sched = None
        self._closed = True


def copy_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy full tensors into ``model``'s parameters and buffers by name, in place (cast to each
    target's dtype and device). A DTensor is gathered first."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    copied = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise ValueError(f"named_tensors: {name!r} is not a parameter or buffer of the inference "
                                 f"copy ({type(model).__name__})")
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"named_tensors[{name!r}]: expected shape {tuple(target.shape)}, "
                                 f"got {tuple(tensor.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            copied += 1
    return copied


def load_inference_copy(path: str, *, device: torch.device, dtype: str = "bfloat16",
                        where: str = "dtype") -> torch.nn.Module:
    """A server's inference copy: ``path``'s causal LM on ``device`` (``dtype`` on CUDA, the
    checkpoint's own dtype elsewhere), in eval mode with every parameter frozen.

    The attention implementation is transformers' default for the model (SDPA where the model
    supports it, eager otherwise: GPT-OSS refuses SDPA); the engine swaps in its own attention
    for its forwards either way. ``where`` names the setting in the error for a bad ``dtype``.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype, None) if device.type == "cuda" else "auto"
    if device.type == "cuda" and not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"{where}: expected a torch dtype name such as 'bfloat16', got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    model.to(device).eval()
    model.requires_grad_(False)
    return model
