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

from tritoninfer.decode import BatchDecodeWithPagedKVCacheWrapper
from tritoninfer.page import append_paged_kv_cache, get_batch_indices_positions
from tritoninfer.prefill import BatchPrefillWithPagedKVCacheWrapper

from .kv_cache import PagedKVCache
from .model import LlamaModel
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
    decode_sampled_tokens: int = 0  # CUDA graph: tokens of the steps whose replay was timed
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
        """The share of a decode step's wall time in which the GPU does not run the step's graph:
        1 - (GPU time per token of the sampled replays) / (wall time per decode token). 0 when no
        replay was sampled (eager decode, or no GPU)."""
        if not (self.decode_sampled_tokens and self.decode_attn_base and self.decode_tokens and self.decode_time):
            return 0.0
        gpu = self.decode_attn_base / self.decode_sampled_tokens
        return max(0.0, 1.0 - gpu / (self.decode_time / self.decode_tokens))

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
    decode wrapper with its fixed page-table buffers, and (on a GPU) the captured graph."""

    def __init__(self, engine: "Engine", bucket: int) -> None:
        e = engine
        dev = e.device
        self.e, self.bucket = engine, bucket
        self.ids = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.pos = torch.zeros(bucket, dtype=torch.int32, device=dev)
        self.bidx = torch.full((bucket,), -1, dtype=torch.int32, device=dev)
        self.indptr = torch.zeros(bucket + 1, dtype=torch.int32, device=dev)
        # room for every page of the cache, and for the warm-up's bucket of dummy rows sharing one page
        self.indices = torch.zeros(max(e.cache.num_pages, bucket), dtype=torch.int32, device=dev)
        self.lpl = torch.zeros(bucket, dtype=torch.int32, device=dev)
        self.wrapper = BatchDecodeWithPagedKVCacheWrapper(
            e.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=e.cfg.use_tensor_cores,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.lpl)
        self.sbufs = e.sampler.buffers(bucket) if e.sampler is not None else None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None
        self.tokens: Optional[torch.Tensor] = None  # sampled in the graph (None: greedy, argmax outside)
        self.attn_graph: Optional[torch.cuda.CUDAGraph] = None

    def _forward(self, timer: Optional[_Timer]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(logits, sampled tokens or None) of the whole bucket."""
        e = self.e

        def attention(layer, q, k, v):
            kq, vq = e.cache.quantize(layer, k, v)
            append_paged_kv_cache(kq, vq, self.bidx, self.pos, e.cache.layer(layer), self.indices, self.indptr, self.lpl)
            ks, vs = e.cache.scales(layer)
            if timer is not None:
                timer.start()
            o = self.wrapper.run(q, e.cache.layer(layer), k_scale=ks, v_scale=vs)
            if timer is not None:
                timer.stop()
            return o

        logits = e.model.forward(self.ids, self.pos, attention)
        return logits, (e.sampler.sample(logits, self.sbufs) if e.sampler is not None else None)

    def step(self, reqs: Sequence[Request], timer: Optional[_Timer]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits ``[len(reqs), vocab]`` of the decode step (K/V of each request's last token written),
        and the sampled tokens ``[len(reqs)]`` (None when greedy)."""
        e, n, b = self.e, len(reqs), self.bucket
        ps = e.cache.page_size
        npages = np.array([len(r.pages) for r in reqs] + [0] * (b - n), dtype=np.int64)
        indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(npages, out=indptr[1:])
        indices = _page_ids(reqs)
        lpl = np.array([(r.kv_len) % ps + 1 for r in reqs] + [0] * (b - n), dtype=np.int32)  # after this token
        self.wrapper.plan(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(lpl),
                          e.cfg_model.num_heads, e.cfg_model.num_kv_heads, e.cfg_model.head_dim, ps,
                          window_left=e.cfg_model.window_left, q_data_type=e.model.attn_dtype,
                          kv_data_type=e.cache.dtype)
        host = torch.tensor([[r.last_token for r in reqs] + [0] * (b - n),
                             [r.kv_len for r in reqs] + [0] * (b - n),
                             list(range(n)) + [-1] * (b - n)], dtype=torch.int64)
        self.ids.copy_(host[0])
        self.pos.copy_(host[1])
        self.bidx.copy_(host[2])
        if self.sbufs is not None:
            e.sampler.fill(self.sbufs, reqs)
        if e.device.type != "cuda" or not e.cfg.cuda_graph:
            return _rows(self._forward(timer), n)
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
            return _rows(out, n)
        self.graph.replay()
        return _rows((self.logits, self.tokens), n)

    def time_attention(self) -> float:
        """Seconds the current plan's attention takes over all layers (a graph of the wrapper's
        runs alone, on dummy queries; the cache is only read)."""
        e = self.e
        cfg = e.cfg_model
        if self.attn_graph is None:
            self._q = torch.randn(self.bucket, cfg.num_heads, cfg.head_dim, device=e.device).to(e.model.attn_dtype)
            self._o = torch.empty_like(self._q)

            def body():
                for layer in range(cfg.num_layers):
                    ks, vs = e.cache.scales(layer)
                    self.wrapper.run(self._q, e.cache.layer(layer), k_scale=ks, v_scale=vs, out=self._o)

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


class Engine:
    """Continuous batching over a paged KV cache. ``run(requests)`` serves them all and returns
    :class:`Stats`; with a ``reference``, every step's logits are compared with it."""

    def __init__(self, model: LlamaModel, kv_dtype: torch.dtype, cfg: EngineConfig,
                 reference: Optional[DenseReference] = None, num_pages: Optional[int] = None) -> None:
        self.model, self.cfg, self.reference = model, cfg, reference
        self.cfg_model = model.cfg
        self.device = model.device
        mc = model.cfg
        self.cache = PagedKVCache(mc.num_layers, num_pages or cfg.num_pages, cfg.page_size, mc.num_kv_heads,
                                  mc.head_dim, kv_dtype, self.device)
        self.workspace = torch.zeros(cfg.workspace_bytes, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                 use_tensor_cores=cfg.use_tensor_cores)
        self.buckets = batch_buckets(cfg.max_batch)
        self._runners: Dict[int, _DecodeRunner] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" and cfg.cuda_graph else None
        self.sampler = Sampler(cfg.sampling, self.device) if cfg.sampling is not None else None
        self.stats = Stats(num_pages=self.cache.num_pages)
        self.logits: Dict[int, List[torch.Tensor]] = {}  # rid -> per-step logits (record_logits)

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
        mc, ps, cache = self.cfg_model, self.cache.page_size, self.cache
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
        self.prefill_wrapper.plan(torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr), kvx_d,
                                  torch.from_numpy(lpl), mc.num_heads, mc.num_kv_heads, mc.head_dim, ps,
                                  causal=True, window_left=mc.window_left, q_data_type=self.model.attn_dtype,
                                  kv_data_type=cache.dtype)
        calibrate = cache.is_fp8 and cache.k_scale is None

        def attention(layer, q, k, v):
            if calibrate:
                cache.calibrate(layer, k, v)
            kq, vq = cache.quantize(layer, k, v)
            append_paged_kv_cache(kq, vq, batch_indices, positions, cache.layer(layer), kvx_d, kvi_d, lpl_d)
            ks, vs = cache.scales(layer)
            timer.start()
            o = self.prefill_wrapper.run(q, cache.layer(layer), k_scale=ks, v_scale=vs)
            timer.stop()
            return o

        last_rows = (qo_d[1:] - 1).long()
        logits = self.model.forward(ids, positions, attention, logits_rows=last_rows)
        if calibrate and self.reference is not None:
            self.reference.set_kv_quant((cache.dtype, cache.k_scale, cache.v_scale))
        for r in reqs:
            r.kv_len = len(r.prompt)
        return logits

    def _decode(self, reqs: List[Request], timer: _Timer) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.cfg.cuda_graph:
            bucket = next(b for b in self.buckets if b >= len(reqs))
            runner = self._runners.get(bucket)
            if runner is None:
                runner = self._runners[bucket] = _DecodeRunner(self, bucket)
            logits, sampled = runner.step(reqs, None if self.device.type == "cuda" else timer)
        else:
            logits = self._decode_eager(reqs, timer)
            sampled = self._sample_eager(reqs, logits)
        for r in reqs:
            r.kv_len += 1
        return logits, sampled

    def _decode_eager(self, reqs: List[Request], timer: _Timer) -> torch.Tensor:
        mc, ps, cache = self.cfg_model, self.cache.page_size, self.cache
        b = len(reqs)
        indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum([len(r.pages) for r in reqs], out=indptr[1:])
        indices = _page_ids(reqs)
        lpl = np.array([r.kv_len % ps + 1 for r in reqs], dtype=np.int32)
        pos = np.array([r.kv_len for r in reqs], dtype=np.int32)
        ind_d, idx_d, lpl_d, pos_d, bidx_d = self._to_device([indptr, indices, lpl, pos, np.arange(b)])
        ids = torch.tensor([r.last_token for r in reqs], dtype=torch.long).to(self.device)
        self.decode_wrapper.plan(torch.from_numpy(indptr), idx_d, torch.from_numpy(lpl), mc.num_heads,
                                 mc.num_kv_heads, mc.head_dim, ps, window_left=mc.window_left,
                                 q_data_type=self.model.attn_dtype, kv_data_type=cache.dtype)

        def attention(layer, q, k, v):
            kq, vq = cache.quantize(layer, k, v)
            append_paged_kv_cache(kq, vq, bidx_d, pos_d, cache.layer(layer), idx_d, ind_d, lpl_d)
            ks, vs = cache.scales(layer)
            timer.start()
            o = self.decode_wrapper.run(q, cache.layer(layer), k_scale=ks, v_scale=vs)
            timer.stop()
            return o

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
                runner.step(dummies, None)
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
        mc, w = self.cfg_model, self.model.w
        one_layer = LlamaModel(dataclasses.replace(mc, num_layers=1), dataclasses.replace(w, layers=w.layers[:1]),
                               self.model.dtype, self.model.attn_dtype)
        engine = Engine(one_layer, self.cache.dtype, dataclasses.replace(self.cfg, record_logits=False),
                        num_pages=self.cache.num_pages)
        engine.run([Request(i, list(prompt), n) for i, (prompt, n) in enumerate(workload)])
        self._sync()

    # ------------------------------------------------------------------ the loop
    def run(self, requests: Sequence[Request], on_step: Optional[Callable[["Engine", StepInfo], None]] = None) -> Stats:
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
        t_start = time.perf_counter()
        while True:
            plan = sched.schedule()
            if plan is None:
                break
            kind, reqs = plan
            timer = _Timer(self.device)
            t0 = time.perf_counter()
            if kind == "prefill":
                logits = self._prefill(reqs, timer)
                sampled = self._sample_eager(reqs, logits)
            else:
                logits, sampled = self._decode(reqs, timer)
            tokens = (logits.argmax(-1) if sampled is None else sampled).tolist()  # syncs
            dt = time.perf_counter() - t0
            attn = timer.flush()
            if kind == "prefill":
                st.prefill_steps += 1
                st.prefill_time += dt
                st.prefill_attn_time += attn
            else:
                st.decode_steps += 1
                st.decode_time += dt
                st.decode_tokens += len(reqs)
                st.decode_batch_sizes.append(len(reqs))
                self._sample_decode_attention(reqs, attn, dt)
            if self.reference is not None:
                if kind == "prefill":
                    for r in reqs:
                        self.reference.reserve(r.rid, r.max_kv_len)
                segments = [(r.rid, r.prompt if kind == "prefill" else [r.last_token]) for r in reqs]
                self._check(segments, logits, reqs, tokens)
            if self.cfg.record_logits:
                rows = logits.float().cpu()
                for i, r in enumerate(reqs):
                    self.logits.setdefault(r.rid, []).append(rows[i])
            for r, t in zip(reqs, tokens):
                r.output.append(int(t))
            st.generated_tokens += len(reqs)
            for r in sched.retire():
                if self.reference is not None:
                    self.reference.release(r.rid)
            st.peak_pages = self.cache.allocator.peak_used
            if on_step is not None:
                on_step(self, StepInfo(kind, len(reqs), n_tokens(kind, reqs), dt))
        st.wall_time = time.perf_counter() - t_start
        return st

    def _sample_decode_attention(self, reqs, attn: float, dt: float) -> None:
        st = self.stats
        graphed = self.cfg.cuda_graph and self.device.type == "cuda"
        if not graphed:
            st.decode_attn_time += attn
            st.decode_attn_base += dt
            return
        if (st.decode_steps - 1) % max(1, self.cfg.attn_sample_every):
            return
        # the step just replayed a graph: time its attention alone (same plan, same cache), and
        # the full step's replay, both as device time
        runner = self._runners[next(b for b in self.buckets if b >= len(reqs))]
        if runner.graph is None or runner.logits is None:
            return
        st.decode_attn_time += runner.time_attention()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # replaying the step again rewrites the same K/V values (same inputs): harmless; its draws
        # are undone so that the tokens do not depend on which steps are timed
        rng = self.sampler.generator.get_state() if self.sampler is not None else None
        start.record()
        runner.graph.replay()
        end.record()
        end.synchronize()
        if rng is not None:
            self.sampler.generator.set_state(rng)
        st.decode_attn_base += start.elapsed_time(end) / 1e3
        st.decode_sampled_tokens += len(reqs)


def _rows(out: Tuple[torch.Tensor, Optional[torch.Tensor]], n: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The first ``n`` rows (the real requests) of a padded bucket's (logits, tokens)."""
    logits, tokens = out
    return logits[:n], (tokens[:n] if tokens is not None else None)


def _page_ids(reqs: Sequence[Request]) -> np.ndarray:
    """The concatenated page ids of ``reqs`` (int32), from each request's cached array."""
    if not reqs:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate([r.page_array() for r in reqs])


def n_tokens(kind: str, reqs: Sequence[Request]) -> int:
    return sum(len(r.prompt) for r in reqs) if kind == "prefill" else len(reqs)
