"""Test-only: a stand-in for ``sparsecorr.decoding.Scheduler`` with its API and contract (one
token per running row per step, rows admitted into ``plan.rows`` slots at the start of a step,
finished rows retired at once), so the rollout server's engine thread is tested without a model.
It records which thread made each call and how many rows were ever resident."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from sparsecorr.decoding import RequestOutput


@dataclass
class _Row:
    rid: str
    prompt: tuple[int, ...]
    params: object
    tokens: list[int] = field(default_factory=list)


class FakeScheduler:
    """``rows`` slots; each ``step`` sleeps ``step_s`` then decodes one token (``100 + i``) per
    running row; a step with ``fail_on`` among its rows raises (as a failing forward would)."""

    def __init__(self, *, rows: int = 2, step_s: float = 0.0, fail_on: str | None = None) -> None:
        self.plan = SimpleNamespace(rows=rows, source="max_num_seqs", row_bytes=0)
        self.step_s, self.fail_on = step_s, fail_on
        self.waiting: deque[_Row] = deque()
        self.running: dict[str, _Row] = {}
        self.max_resident = self.released = self.steps = 0
        self.max_waiting = 0
        self.closed = False
        self.threads: set[int] = set()
        self.admitted_at: dict[str, int] = {}

    def _seen(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, request_id, prompt_ids, params) -> None:
        self._seen()
        if request_id in self.running or any(r.rid == request_id for r in self.waiting):
            raise ValueError(f"request_id: expected a new id, got {request_id!r}")
        if params.max_tokens > 1000:
            raise ValueError(f"max_tokens: expected at most 1000, got {params.max_tokens}")
        self.waiting.append(_Row(request_id, tuple(prompt_ids), params))
        self.max_waiting = max(self.max_waiting, len(self.waiting))

    def _out(self, row: _Row, reason: str, error: BaseException | None = None) -> RequestOutput:
        n = len(row.tokens)
        return RequestOutput(request_id=row.rid, prompt_ids=row.prompt, token_ids=tuple(row.tokens),
                             logprobs=-torch.arange(1, n + 1, dtype=torch.float32) / 10, topk_logp=None,
                             topk_ids=None, finish_reason=reason, error=error)

    def step(self) -> list[RequestOutput]:
        self._seen()
        assert not self.closed
        while self.waiting and len(self.running) < self.plan.rows:
            row = self.waiting.popleft()
            self.running[row.rid] = row
            self.admitted_at[row.rid] = self.steps
        self.max_resident = max(self.max_resident, len(self.running))
        self.steps += 1
        time.sleep(self.step_s)
        if self.fail_on is not None and self.fail_on in self.running:
            raise RuntimeError("forward failed")
        done = []
        for row in list(self.running.values()):
            row.tokens.append(100 + len(row.tokens))
            if len(row.tokens) >= row.params.max_tokens:
                done.append(self._out(self.running.pop(row.rid), "length"))
        return done

    def abort(self, request_id: str) -> RequestOutput | None:
        self._seen()
        row = self.running.pop(request_id, None)
        for r in list(self.waiting):
            if r.rid == request_id:
                self.waiting.remove(r)
                row = r
        return None if row is None else self._out(row, "aborted")

    def abort_all(self) -> list[RequestOutput]:
        self._seen()
        rows = [*self.waiting, *self.running.values()]
        self.waiting.clear()
        self.running.clear()
        return [self._out(r, "aborted") for r in rows]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def release(self) -> None:
        self._seen()
        assert not self.running, "release with rows running"
        self.released += 1

    def close(self) -> None:
        self._seen()
        self.closed = True
