"""verl's admission gate for ``rollout.name=sparsecorr``: ``abort_all_requests`` closes it and
``resume_generation`` reopens it (verl 0.9.1's vLLM server, ``vllm_async_server.py``, pauses new
requests the same way); requests that arrive while it is closed wait, or return at once when it
rejects (``reject_request=True``)."""

from __future__ import annotations

import asyncio

__all__ = ["Gate"]


class Gate:
    """verl's admission gate: closed by `abort_all_requests`, opened by `resume_generation`.
    Waiters park on a future of their own loop; a rejecting gate returns them at once."""

    def __init__(self) -> None:
        self.open, self.rejecting = True, False
        self._waiters: list[asyncio.Future] = []

    async def admitted(self) -> bool:
        """True once the gate is open; False when it rejects (now, or while this call waited)."""
        while not self.open:
            if self.rejecting:
                return False
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        return True

    def close(self, *, reject: bool) -> None:
        self.open, self.rejecting = False, reject
        self._wake()

    def reopen(self) -> None:
        self.open, self.rejecting = True, False
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            try:
                w.get_loop().call_soon_threadsafe(lambda w=w: w.done() or w.set_result(None))
            except RuntimeError:  # its loop is closed
                pass
