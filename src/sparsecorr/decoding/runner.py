r"""The model runner: one decode step over the rows it is given, with its graphs, padding and sampling.

`ModelRunner` owns an [`Engine`][sparsecorr.decoding.engine.Engine] (the KV pool, the host
bookkeeping, the plan, the compression), the engine's backend, the
[`DecodeGraphs`][sparsecorr.decoding.graphs.DecodeGraphs], the padding of the batch to graph
buckets, the EOS read (and its one-step lag on the graph path) and the sampling. The decode loop
(`sparsecorr.decoding.loops.decode_loop`) sees only what a step returns, a frozen `StepOutput`:
the new tokens, their log-probs and top-k, which rows they belong to and which rows finished.
This is the split of vLLM's scheduler and model runner (vllm-project/vllm,
``vllm/v1/worker/gpu_model_runner.py``: the runner owns the CUDA graphs and their batch sizes)
and gpt-fast's captured decode step (pytorch-labs/gpt-fast, ``generate.py``: ``decode_one_token``
is the forward and ``sample`` compiled as one function).

**One step** (`ModelRunner.step`): the rows that finished are dropped (`rows_to_keep`); the tokens
sampled last are fed, one per row; the forward and the sampling run as one function (a graph
replay on the graph path: `sparsecorr.decoding.graphs._graph_step`, or eagerly: `Engine.feed`
then `sparsecorr.decoding.sampling.sample`), giving the next token of every row; the host
records what each fed row attended (`Engine.attended`) and the rows due compress
(`Engine.compress_due`); then the EOS flags are read.

**Padding.** Graph replays need fixed shapes, so on the graph path rows that finished stay in the
batch as masked dummies (fed, never advanced: ``real = 0``, never recorded) until the live rows
fit the next smaller power of two (`bucket`), where the batch shrinks and the next step captures
a graph of that size. Eager steps drop finished rows at once.

**EOS lag.** On the graph path the EOS flags of a step's tokens are copied to the host without
waiting (a pinned copy and an event) and read after the next forward is launched, so the host
runs a forward ahead of the GPU instead of waiting for it every token. A row that sampled EOS is
fed once more (its next token is dropped, and the attended-KV record of that forward is the
caller's to clear: `StepOutput.late_eos`) and leaves at the step after. Eager steps read the
flags at once. Without an EOS token, no read.

**Random stream.** Each sampling step draws its noise for the whole batch the runner started with
(``[B, V]``) and row ``b`` reads row ``b`` of it (`sparsecorr.decoding.sampling.sample` with
``rows``), so padding rows, dropped rows and late-read rows change no row's draw: the graph path
and the eager path give the same tokens from the same generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import Engine
from .fused import fused_status
from .graphs import DecodeGraphs
from .sampling import Sampling, device_generator, sample

__all__ = ["ModelRunner", "StepOutput", "bucket", "rows_to_keep"]

_EMPTY = torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class StepOutput:
    """What one runner step gives the decode loop.

    Attributes:
        rows: ``[n]`` CPU long, the batch rows of the new tokens (rows still decoding).
        tokens: ``[n]`` long on the model's device, each row's next token.
        logp: ``[n]`` float32 on the device, its log-prob under the processed distribution.
        topk: ``(values [n, k], indices [n, k])`` on the device, or None (``k = 0``).
        eos: ``[e]`` CPU long, the rows among ``rows`` whose new token is EOS (read at once: the
            eager path); they decode no further.
        late_eos: ``[l]`` CPU long, rows whose previous token was EOS, read one step late (the
            graph path): this step fed them that token, dropped their new one, and they decode no
            further.
        fed: ``[m]`` CPU long, the batch rows this step's forward fed a token (empty for the first
            tokens, sampled from the prefill's logits).
        kept: ``[m]`` CPU float, the mean KV slots each fed row's query attended
            (`Engine.attended`).
        hidden: ``[m, H]`` on the device, the fed rows' hidden states at the requested layer, or
            None.
        running: rows that may still decode after this step.
    """

    rows: torch.Tensor
    tokens: torch.Tensor
    logp: torch.Tensor
    topk: tuple[torch.Tensor, torch.Tensor] | None
    eos: torch.Tensor
    late_eos: torch.Tensor
    fed: torch.Tensor
    kept: torch.Tensor
    hidden: torch.Tensor | None
    running: int


def bucket(n: int) -> int:
    """The graph batch bucket of ``n`` live rows: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def rows_to_keep(live: torch.Tensor, *, padded: bool) -> torch.Tensor:
    """Engine rows to keep (CPU bool ``[B]``) once some rows finished (``live`` False).

    Eager steps keep the live rows. Graph steps (``padded``) keep finished rows as masked
    dummies while the live count stays in the batch's bucket, and otherwise shrink the batch to
    the live count's bucket (the live rows plus the first finished ones), so a run captures one
    graph per power of two met, not one per batch size.
    """
    if not padded:
        return live
    target = bucket(int(live.sum()))
    if target >= live.numel():
        return torch.ones_like(live)
    fill = (~live).nonzero().squeeze(1)[: target - int(live.sum())]
    return live.clone().index_fill_(0, fill, True)


def _eos_flags(tok: torch.Tensor, eos_t: torch.Tensor):
    """Which sampled tokens are EOS, copied to the host without waiting: ``(host bool [N], event)``
    (read it with `_read_eos` once the event has passed)."""
    flags = torch.isin(tok, eos_t)
    host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=flags.is_cuda)
    host.copy_(flags, non_blocking=True)
    event = None
    if flags.is_cuda:
        event = torch.cuda.Event()
        event.record()
    return host, event


def _read_eos(pending) -> torch.Tensor:
    """The batch rows of ``pending = (rows, host flags, event)`` whose token was EOS (CPU long)."""
    rows, host, event = pending
    if event is not None:
        event.synchronize()  # the sampling of that step, long done: the GPU is a forward ahead
    return rows[host.clone()]


class ModelRunner:
    """One decode step at a time over an `Engine`'s rows: graphs, padding, EOS lag and sampling.

    Args:
        engine: the engine after its prefill (the runner owns it from here: `close` closes it).
        cuda_graph: replay the single-token steps as CUDA graphs (one per batch bucket), the
            sampling inside the captured step.
        fused: the captured step's model forward compiled (`sparsecorr.decoding.fused`; a
            failure for this model state before is not attempted again).
        graph_runner: the graph runner class (default `sparsecorr.decoding.graphs.CudaGraphRunner`;
            the CPU tests pass `EagerRunner`, which runs the same static-buffer step eagerly).

    Use: `start` with the prefill's logits (the first tokens), then `step` until no row runs or
    the caller has its tokens, `drop` for rows the caller stops (a pruner's cut), `finish` for the
    EOS flags still pending, and `close`. The prefill and teacher forcing feed the engine
    directly (`Engine.feed`). Nothing captured refers to the runner or the engine: dropping the
    runner frees the pool and the graphs at once.
    """

    def __init__(self, engine: Engine, *, cuda_graph: bool = False, fused: bool = False,
                 graph_runner: type | None = None) -> None:
        self.engine = engine
        self.graphs: DecodeGraphs | None = None
        if cuda_graph or graph_runner is not None:
            # a fused step that failed for this model state before is not attempted again
            self.graphs = DecodeGraphs(runner=graph_runner, fused=fused_status(engine.model) if fused else "off")
        self.samp: Sampling | None = None

    # -- state of one decode ---------------------------------------------------------------------
    def start(self, logits: torch.Tensor, *, sampling: Sampling, eos) -> StepOutput:
        """Sample every row's first token from the prefill's ``logits [B, V]`` (eagerly) and read
        or launch its EOS check; ``eos``: an id, ids, or None."""
        engine, b = self.engine, logits.shape[0]
        dev = engine.device
        self.samp = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.k,
                             device_generator(sampling.generator, logits.device))
        self.batch = b
        self.eos_t = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), device=dev)
        if self.graphs is not None:  # the captured step samples with this setting
            self.graphs.sampling, self.graphs.batch = self.samp, b
        self.lagged = self.eos_t is not None and self._graph_on()
        self.active, self.live = torch.arange(b), torch.ones(b, dtype=torch.bool)
        self.running = b  # live rows (host int, kept with `live`: no device op per step to count them)
        self.pending = None
        tok, lp, top = sample(logits, self.samp)
        self.tok = tok
        return self._output(tok, lp, top, fed=_EMPTY, kept=torch.zeros(0), hidden=None, at=None)

    def _graph_on(self) -> bool:
        return self.graphs is not None and self.graphs.status == "on"

    def budget_at(self, ctx: torch.Tensor) -> torch.Tensor:
        """The policy's budget at context lengths ``ctx`` (`Engine.budget_at`)."""
        return self.engine.budget_at(ctx)

    def drop(self, rows: torch.Tensor) -> None:
        """Stop the batch rows ``rows`` (CPU long): they decode no further and leave the engine's
        batch at the next step (as a finished row does)."""
        if rows.numel():
            self.live &= ~torch.isin(self.active, rows)
            self.running = int(self.live.sum())

    @property
    def _all_live(self) -> bool:
        """No finished row in the engine's batch (host ints only)."""
        return self.running == len(self.live)

    def finish(self) -> torch.Tensor:
        """The batch rows whose last token was EOS, where that read was still pending (the graph
        path); CPU long, empty otherwise. Call once the loop is done."""
        if self.pending is None:
            return _EMPTY
        done, self.pending = _read_eos(self.pending), None
        return done

    # -- one step ----------------------------------------------------------------------------------
    def _shrink(self) -> None:
        """Drop the finished rows from the engine's batch, as `rows_to_keep` says for this path."""
        if self._all_live:
            return
        keep = rows_to_keep(self.live, padded=self._graph_on())
        if bool(keep.all()):
            return
        kept = self.engine.select_rows(keep)
        self.active, self.live, self.tok = self.active[kept], self.live[kept], self.tok[kept.to(self.engine.device)]

    def step(self, *, hidden_layer: int | None = None) -> StepOutput:
        """Feed every running row its last token, run the forward and the sampling, compress the
        rows due, and read the EOS flags (at once, or those of the previous step on the graph
        path). ``hidden_layer``: also return the fed rows' hidden states at that layer (an eager
        step)."""
        engine = self.engine
        self._shrink()
        dev = engine.device
        real = self.live.long()
        rows_dev = self.active.to(dev, non_blocking=True)
        res = hidden = None
        if self._graph_on() and hidden_layer is None:
            # (token, log-prob[, top-k values, indices]) from a replay; None if the capture failed: eager below
            res = self.graphs.run(engine.plan(1, real, decode=True, static=True), self.tok[:, None],
                                  engine.capture, rows=rows_dev)
        if res is not None:
            engine.advance(len(real), real)
            tok, lp, *topk = res
            top = tuple(topk) or None
        else:
            out = engine.feed(self.tok[:, None], real, decode=True, logits_to_keep=1,
                              hidden=hidden_layer is not None)
            tok, lp, top = sample(out.logits[:, -1], self.samp, rows=rows_dev, batch=self.batch)
            if hidden_layer is not None:
                hidden = out.hidden_states[hidden_layer][:, -1]
        padded = not self._all_live
        fed, kept = self.active, engine.attended(1)[:, 0]
        if padded:
            fed, kept = fed[self.live], kept[self.live]
        if hidden is not None and padded:
            hidden = hidden[self.live.nonzero().squeeze(1).to(dev)]
        engine.compress_due()
        late = _EMPTY
        if self.pending is not None:  # the EOS flags of the tokens just fed
            late, self.pending = _read_eos(self.pending), None
            self.drop(late)
        self.tok = tok
        at = None if self._all_live else self.live.nonzero().squeeze(1).to(dev, non_blocking=True)
        return self._output(tok, lp, top, fed=fed, kept=kept, hidden=hidden, at=at, late=late)

    def forward_logits(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """One single-token decode forward over the engine's rows, without sampling: the logits
        ``[B, V]`` of the tokens ``ids`` ``[B, 1]`` (device; row ``b`` fed when ``real_b`` is 1,
        CPU long ``[B]``), from a forward-only graph replay where graphs are on (the runner not
        `start`-ed: a caller that samples per row itself, as the scheduler does with
        `sparsecorr.decoding.sampling.sample_rows`), else eagerly (`Engine.feed`). The caller
        pads the batch to `bucket` sizes and compresses (`Engine.compress_due`)."""
        engine = self.engine
        if self._graph_on() and self.samp is None:
            # None if the capture failed: eager below
            out = self.graphs.run(engine.plan(1, real, decode=True, static=True), ids, engine.capture)
            if out is not None:
                engine.advance(len(real), real)
                return out.logits[:, -1]
        return engine.feed(ids, real, decode=True, logits_to_keep=1).logits[:, -1]

    def _output(self, tok, lp, top, *, fed, kept, hidden, at, late=_EMPTY) -> StepOutput:
        """The `StepOutput` of the running rows (engine rows ``at``, None: all of them) and the
        EOS check of their new tokens (read now, or launched for the next step)."""
        rows = self.active if at is None else self.active[self.live]
        if at is not None:
            tok, lp = tok[at], lp[at]
            top = None if top is None else (top[0][at], top[1][at])
        eos = _EMPTY
        if self.lagged:
            self.pending = (rows, *_eos_flags(tok, self.eos_t))
        elif self.eos_t is not None:
            eos = _read_eos((rows, *_eos_flags(tok, self.eos_t)))
            self.drop(eos)
        return StepOutput(rows=rows, tokens=tok, logp=lp, topk=top, eos=eos, late_eos=late, fed=fed, kept=kept,
                          hidden=hidden, running=self.running)

    def close(self) -> None:
        """Drop the graphs, then close the engine (its pool, cache and the backend's plans)."""
        if self.graphs is not None:
            self.graphs.close()
        if self.engine is not None:
            self.engine.close()
        self.graphs = self.engine = self.tok = self.pending = None
