r"""A continuous-batching scheduler over one `Engine`: requests join and leave a running batch.

The scheduler drives one [`Engine`][sparsecorr.decoding.engine.Engine] whose pool is allocated
once for ``plan.rows`` rows plus one never-fed *pristine* row, but whose batch is only as large
as the requests need: the running rows, then the pristine row (the last engine row). Each `step`:

1. **admit** waiting requests (first come, first served): a free row left by a finished request
   is refilled in place (`Engine.reset_rows`: its pool row by an indexed copy of the pristine
   row, the policy's state by its own row selection with an index such as ``[0, 1, P, 3, P]``,
   so no policy needs a reset hook); requests still waiting grow the batch (up to ``plan.rows``)
   by one `Engine.take_rows` that appends pristine copies, in the storage allocated once; with
   nobody waiting, the free rows leave the batch the same way (the running rows, in order, then
   the pristine one). So the long tail of a rollout runs at the batch of the rows still decoding,
   not at ``plan.rows``. With CUDA graphs the batch is rounded up to a power of two (free rows
   fed as padding), so a run captures one graph per power of two met;
2. **one forward**: while some row still reads its prompt, a prefill chunk (up to
   ``prefill_chunk`` tokens of each such row, ``real = 0`` for the others, whose padding goes to
   the scratch page: decoding rows wait one forward, so a forward is never mixed and each row's
   tokens see the forward kinds they see alone, which matters to a selection policy that attends
   differently in prefill and decode); else one token for every decoding row. ``compress_due``
   runs after it, as in ``generate`` (after a prefill chunk not for a policy that keeps the
   prompt whole: ``compress_in_prefill``);
3. **sample** each row whose logits are ready with its own request's parameters
   (`sparsecorr.decoding.sampling.sample_rows`);
4. **retire** at once the rows that sampled a stop token or reached ``max_tokens``: the row is
   free for the next step's admission.

A row's arithmetic reads nothing of its neighbours (its own slots, its own policy state), and a
seeded request owns a ``torch.Generator`` seeded with its seed, so a request's tokens do not
depend on who shares its steps or when it arrived (log-probs: up to float rounding of different
batch shapes). The memory plan (`sparsecorr.decoding.memory`) sizes ``plan.rows``. It is made
before any prompt is seen, so a policy that keeps the prompt whole through the prefill
(``RKV(variant="sparse_rl")``, ``compress_in_prefill`` False) is planned for the longest prompt
``max_model_len`` allows (``max_model_len - 1`` tokens, one left to generate): a row of
``max_model_len`` slots, the whole context, not ``budget + buffer + prefill_chunk``.

Cost: every forward runs over the running rows and the pristine row (and, with CUDA graphs, the
free rows up to the power of two), so a prefill chunk for one new row costs ``(rows + 1) · chunk``
tokens of MLP; a refill copies the admitted pool rows and every row of the policy's state (rings,
norms, page sums); a resize moves every layer's kept rows once (`sparsecorr.decoding.pool.take_rows`).
"""

from __future__ import annotations

import traceback
from collections import deque
from typing import TYPE_CHECKING

import torch

from .._checks import check_int, is_int
from .backends import select_backend
from .cache import ATTN_NAME, active_cache
from .engine import Engine, backend_features, layer_groups
from .hf import check_transformers, eval_modules, model_spec, sparse_attention
from .memory import MemoryPlan, plan_for
from .policies import KVPolicy
from .requests import Request, RequestOutput, RequestParams, check_prompt
from .runner import ModelRunner, bucket
from .sampling import RowSampling, device_generator, sample_rows
from .validate import vocab_size

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MemoryPlan", "RequestOutput", "RequestParams", "Scheduler"]


class Scheduler:
    """Continuous batching over one engine (NOT thread-safe: one thread calls it).

    Args:
        model: the Hugging Face causal LM (kept in eval mode during each step).
        policy: the KV policy.
        budget: as ``generate``'s (an int, None = dense, or an object with ``budget_at``).
        max_model_len: most tokens (prompt + response) of one request; sizes each row.
        backend: as ``generate``'s.
        cuda_graph: as ``generate``'s (the model runner's forward-only graph step, one capture
            per power of two of the batch met).
        fused: as ``generate``'s (None: on with ``cuda_graph``).
        prefill_chunk: prompt tokens per row and prefill forward.
        max_num_seqs: most rows resident at once (None = the memory plan decides).
        max_kv_bytes: bytes the pool and the policy's state may take (None = free device memory
            on CUDA; on another device, without either cap, 64 rows: `sparsecorr.decoding.memory`).
        eos_token_id: default stop tokens (a request's ``stop_token_ids`` overrides).
        generator: the RNG of sampling requests without a seed.
    """

    def __init__(self, model: PreTrainedModel, *, policy: KVPolicy, budget: int | object | None, max_model_len: int,
                 backend: str = "auto", cuda_graph: bool = False, fused: bool | None = None,
                 prefill_chunk: int = 512, max_num_seqs: int | None = None, max_kv_bytes: int | None = None,
                 eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None) -> None:
        check_transformers()
        if not isinstance(policy, KVPolicy):
            raise ValueError(f"policy: expected a KVPolicy (Dense(), RKV(), ...), got {type(policy).__name__}")
        check_int("max_model_len", max_model_len, low=2)
        check_int("prefill_chunk", prefill_chunk, low=1)
        if cuda_graph not in (True, False):
            raise ValueError(f"cuda_graph: expected a bool, got {cuda_graph!r}")
        if (fused is not None and not isinstance(fused, bool)) or (fused and not cuda_graph):
            raise ValueError(f"fused: expected None, or a bool with cuda_graph=True, got {fused!r}")
        eos = [] if eos_token_id is None else [eos_token_id] if is_int(eos_token_id) else eos_token_id
        if not isinstance(eos, (list, tuple, set)) or not all(is_int(t) for t in eos):
            raise ValueError(f"eos_token_id: expected None, an int or a list of ints, got {eos_token_id!r}")
        self.spec = model_spec(model)
        param = next(model.parameters())
        self.device, self.dtype, self.vocab = param.device, param.dtype, vocab_size(model)
        if cuda_graph:
            from . import graphs
            graphs.check_graph_device(self.device)
        self.model, self.policy, self.backend_name = model, policy, backend
        self.max_model_len, self.chunk, self.cuda_graph = max_model_len, prefill_chunk, cuda_graph
        self.fused = cuda_graph if fused is None else fused
        # prompts are not known yet: the longest one a request may bring (max_tokens >= 1)
        self.table, self.plan = plan_for(model, policy, budget, longest=max_model_len, chunk=prefill_chunk,
                                         prompt=max_model_len - 1, max_num_seqs=max_num_seqs, max_kv_bytes=max_kv_bytes)
        self.eos = frozenset(int(t) for t in eos)
        self.generator = device_generator(generator, self.device)
        #: the model runner (the engine, its graphs, the decode forward): None while released
        self.runner: ModelRunner | None = None
        self.backend_label = None
        self.graph_status = "off"
        self._slots: list[Request | None] = []  # engine row -> request (None: a free row)
        self._waiting: deque[Request] = deque()
        self._known: dict[str, Request] = {}
        self.max_resident = 0
        self.peak_kv_bytes = 0
        #: ``generate``'s ``meta["kv_layers"]`` / ``meta["peak_kv"]`` of a model with sliding-window
        #: layers (the full / sliding split of ``peak_kv_bytes``; `layer_groups`), else empty
        self.kv_groups: dict = {}

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids, params: RequestParams) -> None:
        """Queue a request. Validated at once: an empty or over-long prompt (prompt +
        ``max_tokens`` > ``max_model_len``), a duplicate id or bad params raise a ValueError
        naming the field; nothing else is affected."""
        if self.model is None:
            raise RuntimeError("add_request: the scheduler is closed")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: expected a str, got {type(request_id).__name__}")
        if request_id in self._known:
            raise ValueError(f"request_id: {request_id!r} is already waiting or running")
        if not isinstance(params, RequestParams):
            raise ValueError(f"params: expected a RequestParams, got {type(params).__name__}")
        prompt = check_prompt(prompt_ids, self.vocab)
        if prompt.numel() + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt_ids: a prompt of {prompt.numel()} tokens plus params.max_tokens="
                             f"{params.max_tokens} exceeds max_model_len={self.max_model_len}")
        stops = frozenset() if params.ignore_eos else (
            self.eos if params.stop_token_ids is None else frozenset(params.stop_token_ids))
        gen = None
        if params.seed is not None and params.temperature > 0:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        samp = RowSampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           logprobs=min(params.logprobs, self.vocab), generator=gen)
        req = Request(id=request_id, prompt=prompt, params=params, stops=stops, samp=samp)
        self._waiting.append(req)
        self._known[request_id] = req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request: its partial tokens, ``"aborted"`` (None if unknown)."""
        req = self._known.pop(request_id, None)
        if req is None:
            return None
        if req.slot is None:
            self._waiting.remove(req)
        else:
            self._free(req)
        return req.output("aborted")

    def abort_all(self) -> list[RequestOutput]:
        """Abort every waiting and running request (running first, by slot)."""
        ids = [r.id for r in self._slots if r is not None] + [r.id for r in self._waiting]
        return [self.abort(i) for i in ids]

    def has_unfinished(self) -> bool:
        return bool(self._known)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def pool_bytes(self) -> int:
        """Bytes the pool and the policy's state hold now (0 while released)."""
        return 0 if self.engine is None else self.engine.cache.allocated_bytes()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: admit, one forward, sample per row, retire. Returns the requests that
        finished in it. An exception inside the forward (or the sampling) fails only that
        forward's rows (``finish_reason="error"``, ``error=exc``); the scheduler stays usable."""
        if self.model is None:
            raise RuntimeError("step: the scheduler is closed")
        if not self._known:
            return []
        self._admit()
        running = [r for r in self._slots if r is not None]
        prefill = [r for r in running if r.fed < r.prompt.numel()]
        rows = prefill or running
        try:
            with eval_modules(self.model), sparse_attention(self.model, ATTN_NAME), \
                    active_cache(self.engine.cache), torch.no_grad():
                ready, logits = self._prefill(prefill) if prefill else self._decode(running)
                tok, lp, top = sample_rows(logits, [r.samp for r in ready], self.generator) if ready else (None,) * 3
                self.engine.compress_due(prefill=bool(prefill))
        except Exception as exc:  # this forward's rows fail; the others go on
            traceback.clear_frames(exc.__traceback__)  # its frames hold pool tensors: not kept alive
            outs = []
            for r in rows:
                self._known.pop(r.id, None)
                self._free(r)
                outs.append(r.output("error", exc))
            return outs
        if self.engine.peak_kv_bytes >= self.peak_kv_bytes:
            self.peak_kv_bytes = self.engine.peak_kv_bytes
            self.kv_groups = layer_groups(self.engine)
        return self._record(ready, tok, lp, top) if ready else []

    @property
    def engine(self) -> Engine | None:
        """The runner's engine (the pool, the host bookkeeping): None while released."""
        return None if self.runner is None else self.runner.engine

    @property
    def pristine(self) -> int:
        """The engine row of the never-fed row (the last): every admitted row starts as its copy."""
        return len(self._slots)

    def _admit(self) -> None:
        """Lay out the engine's rows for the next forward: refill free rows from the waiting queue
        (`Engine.reset_rows` from the pristine row), then grow the batch for the requests still
        waiting (up to ``plan.rows``) or, with none waiting, drop the free rows (`_resize`)."""
        if self.engine is None:
            self._allocate()
        free = [i for i, r in enumerate(self._slots) if r is None]
        fill = free[:len(self._waiting)]
        for i in fill:
            self._place(self._waiting.popleft(), i)
        if fill:
            self.engine.reset_rows(torch.tensor(fill), source=self.pristine)
        self._resize(self._rows_for(self.num_running + len(self._waiting)))
        while self._waiting and None in self._slots:
            self._place(self._waiting.popleft(), self._slots.index(None))
        self.max_resident = max(self.max_resident, self.num_running)

    def _rows_for(self, wanted: int) -> int:
        """Rows the batch should have for ``wanted`` requests: as many (at most ``plan.rows``),
        rounded up to the graph's batch bucket when CUDA graphs replay the steps (one capture
        per power of two met, as `generate` does: `sparsecorr.decoding.runner.bucket`)."""
        n = min(wanted, self.plan.rows)
        return min(bucket(n), self.plan.rows) if self.cuda_graph and n else n

    def _resize(self, rows: int) -> None:
        """Make the batch ``rows`` rows plus the pristine one, in one `Engine.take_rows` (in the
        pool's own storage, allocated once for ``plan.rows + 1``): growing appends copies of the
        pristine row (free rows); shrinking keeps the running rows, in order, then free ones."""
        n = len(self._slots)  # `_rows_for` never asks for fewer rows than are running
        if rows == n:
            return
        if rows > n:
            index = list(range(n)) + [n] * (rows - n + 1)
            self._slots += [None] * (rows - n)
        else:
            running = [i for i, r in enumerate(self._slots) if r is not None]
            spare = [i for i, r in enumerate(self._slots) if r is None][:rows - len(running)]
            index = running + spare + [n]
            self._slots = [self._slots[i] for i in running + spare]
            for j, r in enumerate(self._slots):
                if r is not None:
                    r.slot = j
        self.engine.take_rows(torch.tensor(index))

    def _place(self, req: Request, slot: int) -> None:
        req.slot, self._slots[slot] = slot, req

    def _prefill(self, rows: list[Request]):
        """One prefill chunk of ``rows``; the rows whose prompt ended in it and their logits."""
        n = {r.slot: min(self.chunk, r.prompt.numel() - r.fed) for r in rows}
        q = max(n.values())
        ids = torch.zeros(self.pristine + 1, q, dtype=torch.long)
        real = torch.zeros(self.pristine + 1, dtype=torch.long)
        for r in rows:
            ids[r.slot, :n[r.slot]] = r.prompt[r.fed:r.fed + n[r.slot]]
            real[r.slot] = n[r.slot]
        ending = [r for r in rows if r.fed + n[r.slot] == r.prompt.numel()]
        ends = torch.tensor([n[r.slot] - 1 for r in ending], dtype=torch.long)
        cols = torch.unique(ends) if ending else torch.tensor([q - 1])
        out = self.engine.feed(ids.to(self.device), real, decode=False, logits_to_keep=cols.to(self.device))
        for r in rows:
            r.fed += n[r.slot]
        if not ending:
            return [], None
        at = torch.tensor([r.slot for r in ending])
        return ending, out.logits[at.to(self.device), torch.searchsorted(cols, ends).to(self.device)]

    def _decode(self, rows: list[Request]):
        """One token for every decoding row (its last sampled token); the rows and their logits."""
        ids = torch.zeros(self.pristine + 1, 1, dtype=torch.long)
        real = torch.zeros(self.pristine + 1, dtype=torch.long)
        at = torch.tensor([r.slot for r in rows])
        ids[at, 0] = torch.tensor([r.tokens[-1] for r in rows])
        real[at] = 1
        logits = self.runner.forward_logits(ids.to(self.device), real)
        kept = self.engine.attended(1)[at, 0].tolist()
        for r, k in zip(rows, kept):
            r.kept.append(k)
        return rows, logits[at.to(self.device)]

    def _record(self, rows: list[Request], tok, lp, top) -> list[RequestOutput]:
        """Append each row's sampled token (one host copy of the step's samples, packed in one
        float64 tensor); retire the rows that stop."""
        parts = [tok.double()[:, None], lp.double()[:, None]]
        if top is not None:  # float64 holds every token id and float32 log-prob exactly
            parts += [top.values.double(), top.indices.double()]
        host = torch.cat(parts, 1).cpu()
        tok, lp = host[:, 0].long().tolist(), host[:, 1].float().tolist()
        k = (host.shape[1] - 2) // 2
        tv, ti = (None, None) if top is None else (host[:, 2:2 + k].float(), host[:, 2 + k:].long())
        outs = []
        for j, r in enumerate(rows):
            r.tokens.append(tok[j])
            r.logps.append(lp[j])
            if r.samp.logprobs:
                r.top.append((tv[j, :r.samp.logprobs], ti[j, :r.samp.logprobs]))
            reason = "eos" if tok[j] in r.stops else "length" if len(r.tokens) >= r.params.max_tokens else None
            if reason is not None:
                self._known.pop(r.id, None)
                self._free(r)
                outs.append(r.output(reason))
        return outs

    def _free(self, req: Request) -> None:
        """Free a running request's slot: its host counts go to 0 (nothing of it is read again;
        admission resets its device state from the pristine row)."""
        if req.slot is None:
            return
        self._slots[req.slot] = None
        if self.engine is not None:
            self.engine.count[req.slot] = 0
            self.engine.ctx[req.slot] = 0
        req.slot = None

    # -- memory -------------------------------------------------------------------------------
    def _allocate(self) -> None:
        back, self.backend_label = select_backend(self.backend_name, device=self.device, dtype=self.dtype,
                                                  head_dim=self.spec.head_dim,
                                                  group_size=self.spec.heads_q // self.spec.heads_kv,
                                                  **backend_features(self.spec))
        engine = Engine(self.model, policy=self.policy, backend=back, table=self.table, batch=self.plan.rows + 1,
                        capacity=self.plan.capacity, grad=False, chunk=self.chunk)
        self.runner = ModelRunner(engine, cuda_graph=self.cuda_graph, fused=self.fused)
        self._slots = []
        self.engine.take_rows(torch.tensor([self.plan.rows]))  # the pristine row alone, in the same storage

    def release(self) -> None:
        """Free the pool, graphs and backend buffers (no request may be running; waiting ones are
        kept); the next `step` allocates again."""
        if self.num_running:
            raise RuntimeError(f"release: {self.num_running} requests are running; abort or finish them first")
        if self.runner is not None:
            g = self.runner.graphs
            self.graph_status = "off" if g is None else g.status
            self.runner.close()  # and the engine
        self.runner = None

    def close(self) -> None:
        """Abort every request, `release`, and drop the model: nothing of the engine stays alive."""
        self.abort_all()
        self.release()
        self.model = self.policy = self.generator = None
