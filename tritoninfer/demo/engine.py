"""The serving loop: prefill and decode steps over the paged KV cache.

- Prefill step (newly admitted requests, ragged prompts): one ``BatchPrefillWithPagedKVCacheWrapper``
  plan (causal) per step; in each layer K/V are written first with ``append_paged_kv_cache``, then
  attention runs over the paged cache. Logits are computed for each prompt's last token only.
- Decode step (every running request, one token each): one ``BatchDecodeWithPagedKVCacheWrapper``
  plan per step, shared by all layers. On a GPU the whole step (embedding, layers, LM head, and
  with sampling the sampling kernels) is a CUDA graph, captured once per batch-size bucket (1, 2,
  4, ... up to ``max_batch``) with the wrapper's fixed page-table buffers; the batch is padded to
  its bucket (padding rows have no KV pages, batch index -1 so the append skips them, and
  attention gives them 0) and the wrapper is re-planned before every replay.
- Greedy (argmax) by default; with ``EngineConfig.sampling`` tritoninfer's sampling kernels pick each
  step's tokens (``sampler.py``): eagerly after a prefill, inside the graph in a decode step.
- Token ids stay on the device: each running request owns a row (``Request.slot``) of a device
  token table; a prefill writes its first token there, and a decode step reads its input ids from
  the table and writes its tokens back into it (inside the graph), so no token has to come back
  to the host before the next step can be launched.
- Overlap (``EngineConfig.overlap``; decode on the CUDA-graph path without a reference or
  ``record_logits``): step n+1 is scheduled, its page table built, its wrapper planned and its
  graph launched before step n's tokens are read, so the host work of step n+1 runs while the GPU
  runs step n. Tokens come back one step late through pinned buffers (non-blocking copy + event).
  Everything runs on one stream, which orders what the host prepares early after the graph that
  still reads the same memory: ``plan()``'s copies into the wrapper's fixed buffers, the inputs'
  copy into the runner's, and the reuse of freed pages and token-table rows (see
  :meth:`_DecodeRunner.prepare`). A stop token is read one step late: the finished request has
  already been launched in the next step, whose token for it is discarded; its pages are freed
  then. Prefill steps, ``--check`` and ``record_logits`` read their tokens at once (the
  synchronous path). The device work is the same in both paths, so are the tokens (with stop
  tokens the late step shifts the later batches, which changes sampled tokens: ``docs/demo.md``).

Architectures: the cache, the wrappers and each layer's append + attention come from
``attention.py`` (GQA for Llama-style models; for ``--arch deepseek`` a paged latent cache and
``BatchMLAPagedAttentionWrapper`` for prefill and decode); everything above is shared.

fp8 KV: K/V are divided by the layer's static scale and rounded to e4m3 in torch, then appended
(``append_paged_kv_cache`` can convert fp16/bf16 to fp8 itself, but under the Triton interpreter
fp32->fp8 casts are wrong, so the demo converts before the append everywhere).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from tritoninfer.page import get_batch_indices_positions

from tritoninfer import _device

from .attention import attention_for
from .reference import DenseReference
from .sampler import Sampler, SamplingConfig, allowed_rows
from .scheduler import Request, Scheduler

__all__ = ["EngineConfig", "Engine", "Stats", "StepInfo", "batch_buckets"]


@dataclasses.dataclass
class EngineConfig:
    page_size: int = 16
    max_batch: int = 64
    max_prefill_tokens: int = 16384
    num_pages: Optional[int] = None  # default: enough for max_batch of the longest requests
    use_tensor_cores: bool = False
    cuda_graph: bool = True  # on a GPU: capture the decode step; on the CPU: padded fixed buffers, eager
    workspace_bytes: int = 256 * 1024 * 1024
    attn_sample_every: int = 8  # CUDA-graph decode: time attention alone on every n-th decode step
    # CUDA-graph decode: launch step n+1 before reading step n's tokens (off with a reference or record_logits)
    overlap: bool = True
    record_logits: bool = False  # keep every step's logits per request (tests)
    check_tolerance: Optional[float] = None  # relative max |dlogit| allowed by --check
    sampling: Optional[SamplingConfig] = None  # None: greedy (argmax)


@dataclasses.dataclass
class Stats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    prefill_time: float = 0.0
    prefill_attn_time: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_time: float = 0.0
    decode_attn_time: float = 0.0  # eager: measured; CUDA graph: on sampled steps
    decode_attn_base: float = 0.0  # the step time those attention times are a share of
    decode_device_time: float = 0.0  # CUDA-graph path: time the device ran the decode steps (see decode_host_share)
    decode_discarded: int = 0  # tokens launched for a request that had already stopped (read one step late)
    decode_batch_sizes: List[int] = dataclasses.field(default_factory=list)
    graphs_captured: int = 0
    capture_time: float = 0.0
    peak_pages: int = 0
    num_pages: int = 0
    max_abs_diff: float = 0.0  # --check: largest |logit - reference|
    max_rel_diff: float = 0.0  # ... divided by the row's largest |reference logit|
    checked_rows: int = 0
    argmax_mismatches: int = 0
    sampled_outside: int = 0  # --check with sampling: tokens outside the allowed set (see sampler.allowed_rows)
    sampled_exact: int = 0  # ... tokens inside the reference's own kept set
    sampled_not_argmax: int = 0  # ... tokens other than the reference's argmax
    wall_time: float = 0.0
    warmup_time: float = 0.0
    warmup_variants: int = 0  # kernel variants first launched by the warm-up (compiled there, on a GPU)
    timed_variants: Optional[int] = None  # kernel variants first launched by the timed run: 0 after a warm-up

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0

    @property
    def prefill_attn_share(self) -> float:
        return self.prefill_attn_time / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_attn_share(self) -> float:
        return self.decode_attn_time / self.decode_attn_base if self.decode_attn_base else 0.0

    @property
    def decode_host_share(self) -> float:
        """The share of the decode steps' wall time in which the device does not run a decode step:
        ``1 - decode_device_time / decode_time``, i.e. host time not overlapped with device work.
        ``decode_time`` is the serving loop's wall time over decode steps (scheduling, page tables,
        plan, launches, waiting for and reading tokens, bookkeeping; not --check's reference, not
        ``record_logits``); ``decode_device_time`` sums each graph replay's device time (CUDA events
        around every replay, read with its tokens, so without a synchronisation of its own; on the
        CPU the padded forward's time). 0 on the eager decode path, which times no device work."""
        if not (self.decode_device_time and self.decode_time):
            return 0.0
        return max(0.0, 1.0 - self.decode_device_time / self.decode_time)

    @property
    def attn_share(self) -> float:
        total = self.prefill_time + self.decode_time
        attn = self.prefill_attn_time + self.decode_attn_share * self.decode_time
        return attn / total if total else 0.0


@dataclasses.dataclass
class StepInfo:
    kind: str  # "prefill" or "decode"
    batch: int
    tokens: int
    seconds: float


def batch_buckets(max_batch: int) -> List[int]:
    """CUDA-graph batch sizes: powers of two below ``max_batch``, and ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class _Timer:
    """Sums the time of code sections: CUDA events on a GPU (resolved by ``flush``), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.total = 0.0
        self._pending: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._t0 = 0.0
        self._ev = None

    def start(self) -> None:
        if self.cuda:
            self._ev = torch.cuda.Event(enable_timing=True)
            self._ev.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._ev, end))
        else:
            self.total += time.perf_counter() - self._t0

    def flush(self) -> float:
        """Total so far (seconds); synchronises on pending events."""
        for a, b in self._pending:
            b.synchronize()
            self.total += a.elapsed_time(b) / 1e3
        self._pending.clear()
        return self.total


class _DecodeRunner:
    """One batch-size bucket of the decode step: fixed input buffers, a ``use_cuda_graph=True``
    decode wrapper with its fixed page-table buffers, and (on a GPU) the captured graph.

    The step reads its input ids from the engine's token table at the rows in ``slots`` and writes
    the tokens it picks back there (argmax or the sampler, inside the graph), so consecutive steps
    pass tokens on the device."""

    def __init__(self, engine: "Engine", bucket: int) -> None:
        e = engine
        dev = e.device
        self.e, self.bucket = engine, bucket
        # positions, batch indices, token-table rows and page ids in one buffer: one copy per step;
        # each part starts 64-byte aligned, as separate tensors would (Triton specialises on it)
        self.stride = s = _aligned(bucket)
        self.inputs = torch.zeros(3 * s + _page_capacity(e, bucket), dtype=torch.int32, device=dev)
        self.pos = self.inputs[:bucket]
        self.bidx = self.inputs[s:s + bucket]
        self.slots = self.inputs[2 * s:2 * s + bucket]
        self.indices = self.inputs[3 * s:]
        self.indptr = torch.zeros(bucket + 1, dtype=torch.int32, device=dev)
        self.lpl = torch.zeros(bucket, dtype=torch.int32, device=dev)
        self.wrapper = e.attn.graph_wrapper(e.workspace, bucket, self.indptr, self.indices, self.lpl)
        self.sbufs = e.sampler.buffers(bucket) if e.sampler is not None else None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None
        self.tokens: Optional[torch.Tensor] = None
        self.attn_graph: Optional[torch.cuda.CUDAGraph] = None

    def _forward(self, timer: Optional[_Timer]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(logits, tokens) of the whole bucket; the tokens are also written to the token table."""
        e = self.e
        attention = e.attn.layer_fn(self.wrapper, e.cache, self.bidx, self.pos, self.indices, self.indptr, self.lpl,
                                    timer)
        slots = self.slots.long()
        logits = e.model.forward(e.tok_table.index_select(0, slots), self.pos, attention)
        tokens = e.sampler.sample(logits, self.sbufs) if e.sampler is not None else logits.argmax(-1)
        e.tok_table.index_copy_(0, slots, tokens)
        return logits, tokens

    def prepare(self, reqs: Sequence[Request], slots: Optional[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
        """Inputs and plan of a step over ``reqs`` (token-table rows ``slots``; None: scratch rows).
        Returns the plan's host (indptr, last_page_len).

        Nothing here waits for the device, so with overlap this runs while the previous step's graph
        runs, possibly this runner's own. That is safe because everything is stream-ordered: the
        inputs' copy into this runner's fixed buffers and ``plan()``'s copies into the wrapper's
        fixed buffers (work list, indptr, last page lengths) execute after that graph has read
        them. Their host sides are pinned buffers that are not rewritten before their copy has run:
        ours come from ``Engine.stage`` (a ring of two, each guarded by the event of its last
        copy); ``plan()``'s staging buffer is guarded by its ``PlanUploader`` (it waits for the
        previous plan's copy out of it, enqueued before the previous graph, so long finished). The
        page ids are passed as this runner's device buffer itself, which ``plan()`` then does not
        copy. (Two sets of wrappers used in turn would also avoid the race, at twice the graphs.)"""
        e, n, b = self.e, len(reqs), self.bucket
        ps = e.cache.page_size
        npages = np.zeros(b, dtype=np.int64)
        npages[:n] = [len(r.pages) for r in reqs]
        indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(npages, out=indptr[1:])
        kv = np.array([r.kv_len for r in reqs], dtype=np.int32)
        lpl = np.zeros(b, dtype=np.int32)
        lpl[:n] = kv % ps + 1  # after this token
        s = self.stride
        size = 3 * s + int(indptr[-1])
        i, host = e.stage.take()
        buf = host.numpy()
        buf[:n] = kv
        buf[n:b] = 0
        buf[s:s + n] = np.arange(n)
        buf[s + n:s + b] = -1  # padding rows: the append skips them
        if slots is None:
            buf[2 * s:2 * s + b] = e.scratch_slots[:b]
        else:
            buf[2 * s:2 * s + n] = slots
            buf[2 * s + n:2 * s + b] = e.scratch_slots[n:b]
        if n:
            np.concatenate([r.page_array() for r in reqs], out=buf[3 * s:size])
        self.inputs[:size].copy_(host[:size], non_blocking=True)
        e.stage.record(i)
        e.attn.plan_decode(self.wrapper, e.cache, indptr, self.indices, lpl)
        if self.sbufs is not None:
            e.sampler.fill(self.sbufs, reqs)
        return indptr, lpl

    def launch(self, timer: Optional[_Timer], events: Optional["_Slot"]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Runs the prepared step: (logits, tokens) of the whole bucket, valid until this runner's
        next launch. With a captured graph, ``events`` bracket the replay (its device time)."""
        e = self.e
        if e.device.type != "cuda" or not e.cfg.cuda_graph:
            return self._forward(timer)
        if self.graph is None:
            # this step, eagerly (it compiles every kernel before the capture), on a side stream
            # as PyTorch advises for the warm-up before a capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self._forward(None)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.graph = torch.cuda.CUDAGraph()
            if e.sampler is not None:
                # a generator of our own: each replay must advance it and draw new numbers, which
                # only a generator registered with the graph does (the default one is implicitly)
                register = getattr(self.graph, "register_generator_state", None)
                if register is None:
                    raise RuntimeError("sampling in a CUDA graph needs torch.cuda.CUDAGraph.register_generator_state "
                                       f"(torch {torch.__version__} has none); run with --no-cuda-graph")
                register(e.sampler.generator)
            with torch.cuda.graph(self.graph, pool=e.graph_pool):
                self.logits, self.tokens = self._forward(None)
            torch.cuda.synchronize()
            e.stats.graphs_captured += 1
            e.stats.capture_time += time.perf_counter() - t0
            return out
        if events is not None:
            events.start.record()
        self.graph.replay()
        if events is not None:
            events.end.record()
        return self.logits, self.tokens

    def time_attention(self) -> float:
        """Seconds the current plan's attention takes over all layers (a graph of the wrapper's
        runs alone, on dummy queries; the cache is only read)."""
        e = self.e
        if self.attn_graph is None:
            # kept on the runner: its dummy queries and output must outlive the graph that reads them
            self._attn_body = body = e.attn.timing_body(self.wrapper, e.cache, self.bucket, e.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            self.attn_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.attn_graph, pool=e.graph_pool):
                body()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.attn_graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _aligned(n: int) -> int:
    return -(-n // 16) * 16


def _page_capacity(e: "Engine", bucket: int) -> int:
    # room for every page of the cache, and for the warm-up's bucket of dummy rows sharing one page
    return max(e.cache.num_pages, bucket)


class _Slot:
    """One buffer of a :class:`_Ring` and its events."""

    def __init__(self, size: int, dtype: torch.dtype, cuda: bool) -> None:
        self.host = torch.zeros(size, dtype=dtype, pin_memory=cuda and _device.can_pin_memory())
        self.done = torch.cuda.Event() if cuda else None  # recorded after the last copy into or out of ``host``
        self.start = torch.cuda.Event(enable_timing=True) if cuda else None  # around a graph replay
        self.end = torch.cuda.Event(enable_timing=True) if cuda else None


class _Ring:
    """Host buffers used in turn (pinned on a GPU) for the steps' non-blocking copies. Two are
    enough: at most one step is in flight while the next is prepared, and a buffer comes round
    again only after the step that used it was read (``take`` still waits for its event, which
    costs nothing then)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, count: int = 2) -> None:
        cuda = device.type == "cuda"
        self.slots = [_Slot(size, dtype, cuda) for _ in range(count)]
        self.next = 0

    def take(self) -> Tuple[int, torch.Tensor]:
        i = self.next
        self.next = (i + 1) % len(self.slots)
        slot = self.slots[i]
        if slot.done is not None:
            slot.done.synchronize()
        return i, slot.host

    def record(self, i: int) -> None:
        """After the copy into or out of buffer ``i`` was enqueued."""
        if self.slots[i].done is not None:
            self.slots[i].done.record()


@dataclasses.dataclass
class _Launched:
    """A step launched on the device whose tokens may not have been read yet."""

    kind: str
    reqs: List[Request]
    t0: float  # when its iteration of the loop started (perf_counter)
    slot: int = -1  # its buffer in Engine.readback
    logits: Optional[torch.Tensor] = None  # valid until the next launch of the same bucket
    timer: Optional[_Timer] = None  # attention time (eager steps, CPU padded path)
    events: Optional[_Slot] = None  # bracket its graph replay
    device_time: float = 0.0  # CPU padded path: the forward's time
    attn_sample: Optional[Tuple] = None  # (runner, indptr, last_page_len, page ids): attention timed later


class Engine:
    """Continuous batching over a paged KV cache. ``run(requests)`` serves them all and returns
    :class:`Stats`; with a ``reference`` (``DenseReference``, or ``MLADenseReference`` for an MLA model),
    every step's logits are compared with it."""

    def __init__(self, model, kv_dtype: torch.dtype, cfg: EngineConfig,
                 reference: Optional[DenseReference] = None, num_pages: Optional[int] = None) -> None:
        self.model, self.cfg, self.reference = model, cfg, reference
        self.cfg_model = model.cfg
        self.device = model.device
        # the architecture's cache, wrappers and per-layer append + attention (GQA or MLA)
        self.attn = attention_for(model, cfg.use_tensor_cores)
        self.cache = self.attn.make_cache(num_pages or cfg.num_pages, cfg.page_size, kv_dtype, self.device)
        self.workspace = torch.zeros(cfg.workspace_bytes, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = self.attn.prefill_wrapper(self.workspace)
        self.decode_wrapper = self.attn.decode_wrapper(self.workspace)
        self.buckets = batch_buckets(cfg.max_batch)
        self._runners: Dict[int, _DecodeRunner] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" and cfg.cuda_graph else None
        self.sampler = Sampler(cfg.sampling, self.device) if cfg.sampling is not None else None
        self.stats = Stats(num_pages=self.cache.num_pages)
        self.logits: Dict[int, List[torch.Tensor]] = {}  # rid -> per-step logits (record_logits)
        # a graph's logits buffer is rewritten by its next replay: --check and record_logits read
        # every step's logits, so they keep the synchronous path
        self.overlap = cfg.overlap and cfg.cuda_graph and reference is None and not cfg.record_logits
        # rows 0..max_batch-1: one per running request (Request.slot); then one per padding row of a
        # bucket, so that no two rows of a step write the same entry
        self.tok_table = torch.zeros(2 * cfg.max_batch, dtype=torch.long, device=self.device)
        self.scratch_slots = np.arange(cfg.max_batch, 2 * cfg.max_batch, dtype=np.int32)
        self.stage = _Ring(3 * _aligned(cfg.max_batch) + _page_capacity(self, cfg.max_batch), torch.int32, self.device)
        self.readback = _Ring(cfg.max_batch, torch.long, self.device)
        self._free_slots: List[int] = []
        self._attn_samples: List[Tuple] = []
        self._launches = 0  # decode steps launched: picks the steps whose attention is timed

    # ------------------------------------------------------------------ helpers
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _to_device(self, arrays: List[np.ndarray]) -> List[torch.Tensor]:
        """int32 host arrays to the device in one copy."""
        sizes = [a.size for a in arrays]
        flat = torch.from_numpy(np.concatenate([a.astype(np.int32).reshape(-1) for a in arrays]))
        dev = flat.to(self.device, non_blocking=False)
        return list(torch.split(dev, sizes))

    def _check(self, segments, logits: torch.Tensor, reqs: Sequence[Request], tokens: List[int]) -> None:
        ref = self.reference.forward(segments).to(logits.device)
        diff = (logits - ref).abs()
        row_max = diff.amax(-1)
        scale = ref.abs().amax(-1).clamp_min(1e-6)
        st = self.stats
        st.max_abs_diff = max(st.max_abs_diff, float(row_max.max()))
        st.max_rel_diff = max(st.max_rel_diff, float((row_max / scale).max()))
        st.checked_rows += ref.shape[0]
        ref_argmax = ref.argmax(-1)
        st.argmax_mismatches += int((logits.argmax(-1) != ref_argmax).sum())
        if self.sampler is not None:
            tok = torch.tensor(tokens, device=ref.device)
            within, exact = allowed_rows(ref, row_max, tok, self.sampler.params_of(reqs), self.sampler.cfg.min_p_chain)
            st.sampled_outside += int((~within).sum())
            st.sampled_exact += int(exact.sum())
            st.sampled_not_argmax += int((tok != ref_argmax).sum())

    def _sample_eager(self, reqs: Sequence[Request], logits: torch.Tensor) -> Optional[torch.Tensor]:
        if self.sampler is None:
            return None
        bufs = self.sampler.buffers(len(reqs))
        self.sampler.fill(bufs, reqs)
        return self.sampler.sample(logits, bufs)

    # ------------------------------------------------------------------ steps
    def _prefill(self, reqs: List[Request], timer: _Timer) -> torch.Tensor:
        ps, cache = self.cache.page_size, self.cache
        lens = np.array([len(r.prompt) for r in reqs], dtype=np.int64)
        n = int(lens.sum())
        qo_indptr = np.zeros(len(reqs) + 1, dtype=np.int32)
        np.cumsum(lens, out=qo_indptr[1:])
        kv_indptr = np.zeros(len(reqs) + 1, dtype=np.int32)
        np.cumsum([len(r.pages) for r in reqs], out=kv_indptr[1:])
        kv_indices = _page_ids(reqs)
        lpl = ((lens - 1) % ps + 1).astype(np.int32)
        ids = torch.tensor([t for r in reqs for t in r.prompt], dtype=torch.long).to(self.device)
        qo_d, kvi_d, kvx_d, lpl_d, seq_d = self._to_device([qo_indptr, kv_indptr, kv_indices, lpl, lens])
        batch_indices, positions = get_batch_indices_positions(qo_d, seq_d, n)
        self.attn.plan_prefill(self.prefill_wrapper, cache, qo_indptr, kv_indptr, kvx_d, lpl)
        calibrate = cache.is_fp8 and cache.k_scale is None
        attention = self.attn.layer_fn(self.prefill_wrapper, cache, batch_indices, positions, kvx_d, kvi_d, lpl_d,
                                       timer, calibrate=calibrate)
        last_rows = (qo_d[1:] - 1).long()
        logits = self.model.forward(ids, positions, attention, logits_rows=last_rows)
        if calibrate and self.reference is not None:
            self.reference.set_kv_quant((cache.dtype, cache.k_scale, cache.v_scale))
        for r in reqs:
            r.kv_len = len(r.prompt)
        return logits

    def _runner(self, n: int) -> _DecodeRunner:
        bucket = next(b for b in self.buckets if b >= n)
        runner = self._runners.get(bucket)
        if runner is None:
            runner = self._runners[bucket] = _DecodeRunner(self, bucket)
        return runner

    def _launch_prefill(self, reqs: List[Request], t0: float) -> _Launched:
        timer = _Timer(self.device)
        logits = self._prefill(reqs, timer)
        sampled = self._sample_eager(reqs, logits)
        tokens = logits.argmax(-1) if sampled is None else sampled
        if self.cfg.cuda_graph:  # the first token is the next decode step's input, on the device
            rows = torch.tensor([r.slot for r in reqs], dtype=torch.long).to(self.device)
            self.tok_table.index_copy_(0, rows, tokens)
        for r in reqs:
            r.launched += 1
        return self._read_later(_Launched("prefill", reqs, t0, logits=logits, timer=timer), tokens)

    def _launch_decode(self, reqs: List[Request], t0: float) -> _Launched:
        if not self.cfg.cuda_graph:
            timer = _Timer(self.device)
            logits = self._decode_eager(reqs, timer)
            sampled = self._sample_eager(reqs, logits)
            rec = _Launched("decode", reqs, t0, logits=logits, timer=timer)
            tokens = logits.argmax(-1) if sampled is None else sampled
        else:
            runner = self._runner(len(reqs))
            indptr, lpl = runner.prepare(reqs, [r.slot for r in reqs])
            on_gpu = self.device.type == "cuda"
            rec = _Launched("decode", reqs, t0, timer=None if on_gpu else _Timer(self.device))
            if on_gpu and runner.graph is not None:
                rec.events = self.readback.slots[self.readback.next]  # the buffer _read_later takes
                if self._launches % max(1, self.cfg.attn_sample_every) == 0:
                    rec.attn_sample = (runner, indptr, lpl, _page_ids(reqs))
            t = time.perf_counter()
            logits, tokens = runner.launch(rec.timer, rec.events)
            if not on_gpu:
                rec.device_time = time.perf_counter() - t
            n = len(reqs)
            rec.logits, tokens = logits[:n], tokens[:n]
        self._launches += 1
        for r in reqs:
            r.kv_len += 1
            r.launched += 1
        return self._read_later(rec, tokens)

    def _read_later(self, rec: _Launched, tokens: torch.Tensor) -> _Launched:
        """Starts the copy of the step's tokens into a pinned buffer (non-blocking; an event after it)."""
        i, host = self.readback.take()
        host[:tokens.shape[0]].copy_(tokens, non_blocking=True)
        self.readback.record(i)
        rec.slot = i
        return rec

    def _finish(self, rec: _Launched, on_step) -> float:
        """Reads the step's tokens (waits for its event), checks and records its logits, appends the
        tokens to the outputs (a request already stopped gets none: its token is discarded), and
        accounts the step. Returns the seconds spent in --check and record_logits, which the step
        times leave out."""
        st = self.stats
        slot = self.readback.slots[rec.slot]
        if slot.done is not None:
            slot.done.synchronize()
        reqs = rec.reqs
        tokens = slot.host[:len(reqs)].tolist()
        attn = rec.timer.flush() if rec.timer is not None else 0.0
        if rec.kind == "prefill":
            st.prefill_steps += 1
            st.prefill_attn_time += attn
        else:
            device = rec.device_time
            if rec.events is not None:  # complete: the readback's event comes after them
                device = rec.events.start.elapsed_time(rec.events.end) / 1e3
            st.decode_device_time += device
            if rec.attn_sample is not None:  # its attention is timed at the next drain
                self._attn_samples.append(rec.attn_sample)
                st.decode_attn_base += device
            elif rec.timer is not None:  # CPU padded path and eager decode: attention timed within the step
                st.decode_attn_time += attn
                st.decode_attn_base += device if device else time.perf_counter() - rec.t0
            st.decode_steps += 1
            st.decode_batch_sizes.append(len(reqs))
        t_paused = time.perf_counter()
        if self.reference is not None:
            if rec.kind == "prefill":
                for r in reqs:
                    self.reference.reserve(r.rid, r.max_kv_len)
            segments = [(r.rid, r.prompt if rec.kind == "prefill" else [r.last_token]) for r in reqs]
            self._check(segments, rec.logits, reqs, tokens)
        if self.cfg.record_logits:
            rows = rec.logits.float().cpu()
            for i, r in enumerate(reqs):
                self.logits.setdefault(r.rid, []).append(rows[i])
        paused = time.perf_counter() - t_paused
        emitted = 0
        for r, t in zip(reqs, tokens):
            if r.done:  # stopped at the previous step, whose tokens were read after this one was launched
                st.decode_discarded += 1
                continue
            r.output.append(t)
            emitted += 1
            if t in r.stop_token_ids:
                r.stopped = True
        st.generated_tokens += emitted
        if rec.kind == "decode":
            st.decode_tokens += emitted
        if on_step is not None:
            on_step(self, StepInfo(rec.kind, len(reqs), n_tokens(rec.kind, reqs),
                                   time.perf_counter() - rec.t0 - paused))
        return paused

    def _retire(self) -> None:
        for r in self.scheduler.retire():
            self._free_slots.append(r.slot)
            r.slot = -1
            if self.reference is not None:
                self.reference.release(r.rid)
        self.stats.peak_pages = self.cache.allocator.peak_used

    def _time_attention_samples(self) -> None:
        """Times the attention of the sampled decode steps (Stats.decode_attn_share) where no step is
        in flight, so that the measurement neither stalls nor lengthens the overlapped steps: each
        runner is re-planned with the sampled step's page table and its attention graph replayed
        (the pages may hold other tokens by now, which does not change the time; only read)."""
        for runner, indptr, lpl, ids in self._attn_samples:
            self.attn.plan_decode(runner.wrapper, self.cache, indptr, torch.from_numpy(ids), lpl)
            self.stats.decode_attn_time += runner.time_attention()
        self._attn_samples.clear()

    def _decode_eager(self, reqs: List[Request], timer: _Timer) -> torch.Tensor:
        ps, cache = self.cache.page_size, self.cache
        b = len(reqs)
        indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum([len(r.pages) for r in reqs], out=indptr[1:])
        indices = _page_ids(reqs)
        lpl = np.array([r.kv_len % ps + 1 for r in reqs], dtype=np.int32)
        pos = np.array([r.kv_len for r in reqs], dtype=np.int32)
        ind_d, idx_d, lpl_d, pos_d, bidx_d = self._to_device([indptr, indices, lpl, pos, np.arange(b)])
        ids = torch.tensor([r.last_token for r in reqs], dtype=torch.long).to(self.device)
        self.attn.plan_decode(self.decode_wrapper, cache, indptr, idx_d, lpl)
        attention = self.attn.layer_fn(self.decode_wrapper, cache, bidx_d, pos_d, idx_d, ind_d, lpl_d, timer)
        return self.model.forward(ids, pos_d, attention)

    def warmup(self, workload: Sequence[Tuple[Sequence[int], int]]) -> float:
        """Launch every kernel variant that serving ``workload`` (prompt, tokens to generate per
        request) will launch, and capture every decode bucket's graph, so that neither compilation
        nor capture counts in the timed run. Returns seconds.

        Triton compiles a variant per specialisation: token counts and batch sizes pick tile sizes
        and are specialised on (1, multiples of 16), the page-table views on their alignment. So a
        short synthetic warm-up misses variants that the run then compiles while timed. Instead the
        warm-up serves the same requests through a one-layer copy of the model, with its own cache
        and wrappers: every layer launches the same variants (same shapes, dtypes, alignments), so
        this launches each variant of the run at about 1/num_layers of its cost. With an fp8 cache
        the prefill of the first prompt's start then sets the static scales (captured graphs hold
        them as constants)."""
        t0 = time.perf_counter()
        self._rehearse(workload)
        alloc, ps = self.cache.allocator, self.cache.page_size
        if self.cache.is_fp8 and workload:
            calib = list(workload[0][0])[: min(64, max(1, alloc.num_free - 1)) * ps]
            req = Request(-1, calib, 1)
            req.pages = alloc.alloc(-(-len(req.prompt) // ps))
            self._prefill([req], _Timer(self.device))
            alloc.free(req.pages)
            if self.reference is not None:
                self.reference.set_kv_quant((self.cache.dtype, self.cache.k_scale, self.cache.v_scale))
        if self.cfg.cuda_graph and self.device.type == "cuda":
            page = alloc.alloc(1)
            for bucket in self.buckets:
                dummies = [Request(-1, [0], 1, output=[0], pages=page, kv_len=0) for _ in range(bucket)]
                runner = self._runners[bucket] = _DecodeRunner(self, bucket)
                runner.prepare(dummies, None)  # the token table's scratch rows
                runner.launch(None, None)
            alloc.free(page)
        self._sync()
        alloc.peak_used = 0
        if self.sampler is not None:
            self.sampler.reset()  # the graphs' first runs drew from it: the timed run starts at the seed
        dt = time.perf_counter() - t0
        self.stats = Stats(num_pages=self.cache.num_pages, graphs_captured=self.stats.graphs_captured,
                           capture_time=self.stats.capture_time)
        self.stats.warmup_time = dt
        return dt

    def _rehearse(self, workload: Sequence[Tuple[Sequence[int], int]]) -> None:
        """Serve ``workload`` through a one-layer copy of the model (see :meth:`warmup`)."""
        engine = Engine(self.model.one_layer(), self.cache.dtype, dataclasses.replace(self.cfg, record_logits=False),
                        num_pages=self.cache.num_pages)
        engine.run([Request(i, list(prompt), n) for i, (prompt, n) in enumerate(workload)])
        self._sync()

    # ------------------------------------------------------------------ the loop
    def run(self, requests: Sequence[Request], on_step: Optional[Callable[["Engine", StepInfo], None]] = None) -> Stats:
        """Serves ``requests`` to the end.

        Each iteration schedules a step, launches it and reads a step's tokens: its own (the
        synchronous path), or with ``overlap`` the decode step launched by the previous iteration,
        so that the host schedules, plans and launches step n+1 while the device runs step n. A
        step's time is its iteration's wall time (a drain of the pending decode step before a
        prefill counts as decode), less the work that only measures: --check, record_logits and
        the attention timing."""
        sched = Scheduler(self.cache.allocator, self.cache.page_size, self.cfg.max_batch, self.cfg.max_prefill_tokens)
        self.scheduler = sched
        st = self.stats
        for r in requests:
            if r.sampling is not None:
                if self.sampler is None:
                    raise ValueError(f"request {r.rid}: sampling parameters given to a greedy engine "
                                     "(EngineConfig.sampling is None)")
                self.sampler.check_request(r.sampling)
            sched.add(r)
            st.requests += 1
            st.prompt_tokens += len(r.prompt)
        self._free_slots = list(range(self.cfg.max_batch - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        pending: Optional[_Launched] = None  # overlap: the decode step launched, not read yet
        t_start = t = time.perf_counter()
        while True:
            plan = sched.schedule()
            if plan is None:
                break
            kind, reqs = plan
            if kind == "prefill":
                if pending is not None:  # prefill steps are synchronous: the pipeline drains first
                    paused = self._finish(pending, on_step)
                    pending = None
                    self._retire()
                    now = time.perf_counter()
                    st.decode_time += now - t - paused
                    t = now
                if self._attn_samples:  # measurement only: left out of the step times
                    self._time_attention_samples()
                    t = time.perf_counter()
                for r in reqs:
                    r.slot = self._free_slots.pop()
                paused = self._finish(self._launch_prefill(reqs, t), on_step)
                self._retire()
                now = time.perf_counter()
                st.prefill_time += now - t - paused
                t = now
                continue
            rec = self._launch_decode(reqs, t)
            if self.overlap:
                # the requests whose last token was just launched leave now (pages, token-table row):
                # as in the synchronous path, before the next step is scheduled
                self._retire()
                paused = self._finish(pending, on_step) if pending is not None else 0.0
                pending = rec
            else:
                paused = self._finish(rec, on_step)
            self._retire()
            now = time.perf_counter()
            st.decode_time += now - t - paused
            t = now
        if pending is not None:
            paused = self._finish(pending, on_step)
            self._retire()
            st.decode_time += time.perf_counter() - t - paused
        self._time_attention_samples()
        st.wall_time = time.perf_counter() - t_start
        return st


def _page_ids(reqs: Sequence[Request]) -> np.ndarray:
    """The concatenated page ids of ``reqs`` (int32), from each request's cached array."""
    if not reqs:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate([r.page_array() for r in reqs])


def n_tokens(kind: str, reqs: Sequence[Request]) -> int:
    return sum(len(r.prompt) for r in reqs) if kind == "prefill" else len(reqs)
