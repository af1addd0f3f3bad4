"""A wrapper's last eager ``run()`` replayed for a call that differs only in its tensors' addresses
(``tritoninfer/_replay.py``), on the GPU launch path faked on the CPU (``testing.fake_driver_launches``):
the replayed launch is the one the full path makes for the same call, and every call of another kind
takes the full path."""

import contextlib
import ctypes
import struct

import numpy as np
import pytest
import torch

from tritoninfer import (BatchDecodeWithPagedKVCacheWrapper, BatchMLAPagedAttentionWrapper,
                         BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper, _driver, _replay,
                         testing)

HQ, HK, D, PAGE = 8, 2, 128, 16
PARAMS = 64  # parameter slots read per launch (the Gluon prefill's TMA maps hold their base address here)


@pytest.fixture
def replays(monkeypatch):
    """Each ``RunReplay.run`` outcome (True: it launched)."""
    outcomes = []
    real = _replay.RunReplay.run

    def run(self, *args):
        done = real(self, *args)
        outcomes.append(done is not None)
        return done

    monkeypatch.setattr(_replay.RunReplay, "run", run)
    return outcomes


@contextlib.contextmanager
def fake_driver(monkeypatch, hopper: bool):
    """``testing.fake_driver_launches`` whose TMA maps hold their base address (the fake encoder writes
    nothing else), so launches that differ in a box's base differ in their parameters."""
    def encode(tensor_map, dtype, address, *rest):
        ctypes.c_uint64.from_address(tensor_map.address).value = address

    with testing.fake_driver_launches(params_read=PARAMS, hopper=hopper) as record:
        monkeypatch.setattr(_driver, "encode_tiled", encode)
        yield record


def _page_table(lens, num_pages, g):
    pages = [-(-n // PAGE) for n in lens]
    indptr = torch.tensor([0, *np.cumsum(pages)], dtype=torch.int32)
    indices = torch.randperm(num_pages, generator=g)[:sum(pages)].to(torch.int32)
    last = torch.tensor([n - PAGE * (p - 1) for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr, indices, last


class Setup:
    """A planned wrapper of one ``kind`` and a maker of the inputs of one call (new tensors each time, of
    the same shapes, strides and dtypes)."""

    def __init__(self, kind: str):
        self.kind = kind
        g = torch.Generator().manual_seed(0)
        ws = testing.make_workspace(16 << 20, "cpu")
        self.num_pages = 600
        if kind.startswith("decode"):
            lens = [700, 33, 4000]
            layout = "HND" if kind == "decode-hnd" else "NHD"
            self.w = BatchDecodeWithPagedKVCacheWrapper(ws, layout)
            self.w.plan(*_page_table(lens, self.num_pages, g), HQ, HK, D, PAGE, q_data_type=torch.bfloat16)
            self.rows = len(lens)
        elif kind.startswith("paged"):
            lens = [1300, 1500]
            self.w = BatchPrefillWithPagedKVCacheWrapper(ws)
            qo_indptr = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
            self.w.plan(qo_indptr, *_page_table(lens, self.num_pages, g), HQ, HK, D, PAGE, causal=True,
                        q_data_type=torch.bfloat16)
            self.rows = sum(lens)
        elif kind.startswith("mla"):
            # (one long request: the plan splits, so a run launches the kernel and its merge pass)
            lens = [9000] if kind == "mla-split" else [200] * 20
            pages = [-(-n // 64) for n in lens]
            self.num_pages = 300
            self.w = BatchMLAPagedAttentionWrapper(ws)
            self.w.plan(torch.arange(len(lens) + 1, dtype=torch.int32),
                        torch.tensor([0, *np.cumsum(pages)], dtype=torch.int32),
                        torch.randperm(self.num_pages, generator=g)[:sum(pages)].to(torch.int32),
                        torch.tensor(lens, dtype=torch.int32), 16, 512, 64, 64, False, 0.1, torch.bfloat16,
                        torch.bfloat16)
            self.rows = len(lens)
            assert self.w._step.device_plan.has_splits == (kind == "mla-split")
        else:
            lens = [1300, 1500]
            self.w = BatchPrefillWithRaggedKVCacheWrapper(ws)
            qo_indptr = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
            self.w.plan(qo_indptr, qo_indptr, HQ, HK, D, q_data_type=torch.bfloat16)
            self.rows = sum(lens)
        assert self.w._step.route.is_core != kind.endswith("gluon")

    def inputs(self) -> tuple:
        if self.kind.startswith("mla"):
            return (torch.zeros(self.rows, 16, 512, dtype=torch.bfloat16), torch.zeros(self.rows, 16, 64, dtype=torch.bfloat16),
                    torch.zeros(self.num_pages, 64, 512, dtype=torch.bfloat16),
                    torch.zeros(self.num_pages, 64, 64, dtype=torch.bfloat16))
        q = torch.zeros(self.rows, HQ, D, dtype=torch.bfloat16)
        if self.kind.startswith("decode") or self.kind.startswith("paged"):
            if self.kind == "decode-tuple":
                return q, (torch.zeros(self.num_pages, PAGE, HK, D, dtype=torch.bfloat16),
                           torch.zeros(self.num_pages, PAGE, HK, D, dtype=torch.bfloat16))
            shape = (self.num_pages, 2, HK, PAGE, D) if self.kind == "decode-hnd" else (self.num_pages, 2, PAGE, HK, D)
            return q, torch.zeros(shape, dtype=torch.bfloat16)
        kv = torch.zeros(self.rows, 2, HK, D, dtype=torch.bfloat16)  # K and V: views of one tensor
        return q, kv[:, 0], kv[:, 1]

    def outputs(self, with_lse: bool) -> dict:
        heads, dim = (16, 512) if self.kind.startswith("mla") else (HQ, D)
        out = torch.empty(self.rows, heads, dim, dtype=torch.bfloat16)
        return dict(out=out, lse=torch.empty(self.rows, heads)) if with_lse else dict(out=out)

    def run(self, inputs, **kwargs):
        return self.w.run(*inputs, **kwargs)


KINDS = ["decode-5d", "decode-tuple", "decode-hnd", "paged", "ragged", "paged-gluon", "ragged-gluon", "mla", "mla-split",
         "mla-gluon"]


def _scales(kind: str, scale) -> dict:
    """vLLM's scales (it passes its layer's k_scale and v_scale, 1.0 for a 16-bit cache, at every run)."""
    if scale is None or kind.startswith("ragged"):  # (the ragged run() takes none)
        return {}
    return dict(ckv_scale=scale, kpe_scale=scale) if kind.startswith("mla") else dict(k_scale=scale, v_scale=scale)


@pytest.mark.parametrize("scale", [None, 1.0], ids=["no-scales", "scales"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out-lse"])
@pytest.mark.parametrize("kind", KINDS)
def test_replayed_launch_is_the_full_paths(kind, with_lse, scale, replays, monkeypatch):
    """A second call with new tensors of the same kind (and the same scales) is replayed; its launch (grid
    and parameters: the new tensors' addresses, K and V at their offsets into a paged cache, the boxes'
    bases) equals the one the full path makes for that call."""
    if kind.startswith("mla") and scale is not None:
        pytest.skip("MLA's scales are for an fp8 cache (a 16-bit one refuses them)")
    with fake_driver(monkeypatch, kind.endswith("gluon")) as record:
        s = Setup(kind)
        first = s.inputs()
        scales = _scales(kind, scale)
        s.run(first, **s.outputs(with_lse), return_lse=with_lse, **scales)
        s.run(first, **s.outputs(with_lse), return_lse=with_lse, **scales)  # (the first compiled; this is recorded)
        second, kwargs = s.inputs(), s.outputs(with_lse)
        kwargs.update(scales)
        record.launches.clear()
        result = s.run(second, **kwargs, return_lse=with_lse)
        assert replays[-1], "the second call was not replayed"
        replayed = list(record.launches)
        assert len(replayed) == 1 + (kind == "mla-split")  # (+ the merge pass)
        s.w._replay = None
        attempts = len(replays)
        record.launches.clear()
        s.run(second, **kwargs, return_lse=with_lse)
        assert len(replays) == attempts  # (the full path)
        full = list(record.launches)
        assert len(full) == len(replayed)
        for (grid, params), (full_grid, full_params) in zip(replayed, full):
            # (a 4-byte slot read as 8 bytes ends in whatever follows it: its low half is the value)
            assert grid == full_grid and [v & 0xFFFFFFFF for v in params] == [v & 0xFFFFFFFF for v in full_params]
        for t in (second[0], kwargs["out"]) + ((kwargs["lse"],) if with_lse else ()):
            assert t.data_ptr() in replayed[0][1] and t.data_ptr() in full[0][1]
        assert (result[0] if with_lse else result) is kwargs["out"]


@pytest.mark.parametrize("kind", ["decode-5d", "ragged-gluon"])
def test_replay_allocates_the_outputs_the_full_path_would(kind, replays):
    """Without ``out``/``lse`` the replay allocates them as the full path does and launches into them."""
    with testing.fake_driver_launches(params_read=PARAMS, hopper=kind.endswith("gluon")) as record:
        s = Setup(kind)
        for _ in range(2):
            s.run(s.inputs(), return_lse=True)
        out, lse = s.run(s.inputs(), return_lse=True)
        assert replays[-1]
        assert out.shape == (s.rows, HQ, D) and out.dtype == torch.bfloat16 and lse.shape == (s.rows, HQ)
        assert out.data_ptr() in record.launches[-1][1] and lse.data_ptr() in record.launches[-1][1]


def _other_calls(s: Setup):
    """(what differs, the call's inputs, its keyword arguments, the error the full path raises or None)."""
    q, *rest = s.inputs()
    out = s.outputs(False)["out"]
    big = torch.zeros(q.numel() + 8, dtype=torch.bfloat16)
    wide = torch.zeros(*q.shape[:-1], q.shape[-1] + 8, dtype=torch.bfloat16)[..., :q.shape[-1]]
    calls = [
        ("q's dtype", (q.half(), *rest), dict(out=out), ValueError),
        ("q's shape", (q[:-1], *rest), dict(out=out[:-1]), ValueError),
        ("q's strides", (wide, *rest), dict(out=out), None),
        ("q's address not 16-byte aligned", (big[1:1 + q.numel()].view(q.shape), *rest), dict(out=out), None),
        ("a tensor subclass", (torch.nn.Parameter(q, requires_grad=False), *rest), dict(out=out), None),
        ("out's dtype", (q, *rest), dict(out=out.float()), ValueError),
        ("out not given", (q, *rest), dict(), None),
        ("return_lse", (q, *rest), dict(out=out, return_lse=True), None),
    ]
    if s.kind.startswith("decode") or s.kind.startswith("paged"):
        calls.append(("a scale", (q, *rest), dict(out=out, v_scale=0.5), None))
        calls.append(("a scale of another value", (q, *rest), dict(out=out, k_scale=1.0, v_scale=0.5), None))
        calls.append(("a tensor scale", (q, *rest), dict(out=out, k_scale=torch.tensor(1.0)), None))
        cache = rest[0]
        more = tuple(torch.cat([c, c[:1]]) for c in cache) if type(cache) is tuple else torch.cat([cache, cache[:1]])
        calls.append(("the cache's pages", (q, more), dict(out=out), None))
    if s.kind.startswith("mla"):
        q_pe, ckv, kpe = rest
        calls.append(("the LSE's base", (q, *rest), dict(out=out, return_lse=True, return_lse_base_on_e=True), None))
        calls.append(("the cache's pages", (q, q_pe, torch.cat([ckv, ckv[:1]]), torch.cat([kpe, kpe[:1]])),
                      dict(out=out), None))
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_calls_of_another_kind_take_the_full_path(kind, replays):
    """After a recorded call, a call that differs in anything the full path checks but addresses (or
    has options) is not replayed: it gets the full path's result or error."""
    with testing.fake_driver_launches(params_read=PARAMS, hopper=kind.endswith("gluon")):
        s = Setup(kind)
        for what, inputs, kwargs, error in _other_calls(s):
            out = s.outputs(False)["out"]
            for _ in range(2):
                s.run(s.inputs(), out=out)
            assert s.w._replay is not None
            replays.clear()
            if error is not None:
                with pytest.raises(error):
                    s.run(inputs, **kwargs)
            else:
                s.run(inputs, **kwargs)
            assert not any(replays), what


def test_a_new_plan_takes_the_full_path(replays):
    with testing.fake_driver_launches(params_read=PARAMS) as record:
        s = Setup("decode-5d")
        inputs = s.inputs()
        for _ in range(2):
            s.run(inputs)
        s.w.plan(*_page_table([700, 33, 4001], s.num_pages, torch.Generator().manual_seed(1)), HQ, HK, D, PAGE,
                 q_data_type=torch.bfloat16)
        replays.clear()
        s.run(inputs)
        assert replays == [False] and record.launches
        s.run(inputs)
        assert replays == [False, True]


def test_one_tensor_as_two_arguments_is_not_recorded(replays):
    """``out=q``: the launch's two addresses are one argument's, which the next call may pass as two
    tensors, so the call is not recorded (a replay would write into q)."""
    with testing.fake_driver_launches(params_read=PARAMS):
        s = Setup("ragged")
        inputs = s.inputs()
        for _ in range(3):
            s.run(inputs, out=inputs[0])
        assert s.w._replay is None and not any(replays)


@pytest.mark.gpu
def test_gpu_replayed_mla_layers_match_reference(replays):
    """The same for the MLA wrapper (DeepSeek's dims, 128 heads, page 64; one long request, so the plan
    splits and a run is the kernel and its merge pass; the Gluon kernel on an H200)."""
    from tritoninfer import reference

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(4)
    lens, heads, page, num_pages = [9000, 300, 17], 128, 64, 400
    pages = [-(-n // page) for n in lens]
    qo_indptr = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0, *np.cumsum(pages)], dtype=torch.int32, device="cuda")
    kv_indices = torch.randperm(num_pages, generator=g)[:sum(pages)].to("cuda", torch.int32)
    kv_len = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def rand(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    layers = [(rand(len(lens), heads, 512), rand(len(lens), heads, 64), rand(num_pages, page, 512),
               rand(num_pages, page, 64)) for _ in range(3)]
    w = BatchMLAPagedAttentionWrapper(testing.make_workspace(128 << 20, "cuda"))
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_len, heads, 512, 64, page, False, 0.1, torch.bfloat16, torch.bfloat16)
    assert w._step.device_plan.has_splits
    for _ in range(2):
        for q_nope, q_pe, ckv, kpe in layers:
            out = w.run(q_nope, q_pe, ckv, kpe)
            ref, _ = reference.mla_paged_attention(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len, 0.1)
            testing.assert_close(out, ref, torch.bfloat16)
    assert replays.count(True) >= 4, replays


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "decode-tuple", "paged", "ragged"])
def test_gpu_replayed_layers_match_reference(kind, replays):
    """On the GPU: one plan run over three layers (each its own query, cache or K/V, of the same shapes),
    twice, as an engine runs a step; the runs after the first recorded one are replays, and every layer's
    output is its reference's. Long bf16 prefill at head_dim 128 takes the Gluon kernel on an H200."""
    from tritoninfer import reference

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(3)
    ws = testing.make_workspace(128 << 20, "cuda")
    decode = kind.startswith("decode")
    lens = [3000, 40, 1500] if decode else [2048, 1100]
    rows = len(lens) if decode else sum(lens)
    kv = testing.make_paged_kv(lens, PAGE, HK, D, dtype=torch.bfloat16, device="cuda", generator=g,
                               form="tuple" if kind == "decode-tuple" else "5d")
    qo_indptr = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device="cuda")

    def rand(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    layers = []  # (q, the run's K/V arguments): one page table, each layer's own cache contents
    for _ in range(3):
        if kind == "ragged":
            kv_args = (rand(sum(lens), HK, D), rand(sum(lens), HK, D))
        elif kind == "decode-tuple":
            kv_args = ((rand(*kv.cache[0].shape), rand(*kv.cache[1].shape)),)
        else:
            kv_args = (rand(*kv.cache.shape),)
        layers.append((rand(rows, HQ, D), kv_args))
    if decode:
        w = BatchDecodeWithPagedKVCacheWrapper(ws)
        w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, HQ, HK, D, PAGE, q_data_type=torch.bfloat16)
    elif kind == "paged":
        w = BatchPrefillWithPagedKVCacheWrapper(ws)
        w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, HQ, HK, D, PAGE, causal=True,
               q_data_type=torch.bfloat16)
    else:
        w = BatchPrefillWithRaggedKVCacheWrapper(ws)
        w.plan(qo_indptr, qo_indptr, HQ, HK, D, causal=True, q_data_type=torch.bfloat16)
    for _ in range(2):  # (the first run compiles on Triton's path, the second is recorded, the rest replay)
        for q, kv_args in layers:
            out = w.run(q, *kv_args)
            if kind == "ragged":
                ref = reference.batch_prefill_with_ragged_kv_cache(q, *kv_args, qo_indptr, qo_indptr, causal=True)
            elif kind == "paged":
                ref = reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, kv_args[0], kv.kv_indptr, kv.kv_indices,
                                                                  kv.kv_last_page_len, "NHD", causal=True)
            else:
                ref = reference.batch_decode_with_paged_kv_cache(q, kv_args[0], kv.kv_indptr, kv.kv_indices,
                                                                 kv.kv_last_page_len, "NHD")
            testing.assert_close(out, ref[0] if isinstance(ref, tuple) else ref, torch.bfloat16)
    assert replays.count(True) >= 4, replays


@pytest.mark.parametrize("kind", ["decode-5d", "ragged-gluon", "mla-gluon"])
def test_a_replay_keeps_no_argument_alive(kind):
    """A replay keeps what the recorded call's tensors were, not the tensors: a layer's activations and
    outputs are freed when the caller drops them."""
    import gc
    import weakref

    with testing.fake_driver_launches(params_read=PARAMS, hopper=kind.endswith("gluon")):
        s = Setup(kind)
        s.run(s.inputs(), **s.outputs(False))
        inputs, kwargs = s.inputs(), s.outputs(False)
        s.run(inputs, **kwargs)
        assert s.w._replay is not None
        refs = [weakref.ref(t) for t in (*inputs, kwargs["out"])]
        del inputs, kwargs
        gc.collect()
        assert all(r() is None for r in refs)


@pytest.mark.parametrize("kind", ["decode-5d", "paged"])
def test_other_scale_values_take_the_full_path(kind, replays):
    """A call recorded with scales (vLLM passes its layer's) is replayed only for the same values: the
    launch's floats were computed from them."""
    with testing.fake_driver_launches(params_read=PARAMS) as record:
        s = Setup(kind)
        for _ in range(2):
            s.run(s.inputs(), **s.outputs(False), k_scale=1.0, v_scale=1.0)
        s.run(s.inputs(), **s.outputs(False), k_scale=1.0, v_scale=1.0)
        assert replays[-1]
        replayed = record.launches[-1][1]
        s.run(s.inputs(), **s.outputs(False), k_scale=1.0, v_scale=0.5)
        assert not replays[-1]
        s.run(s.inputs(), **s.outputs(False), k_scale=1.0, v_scale=0.5)
        half = struct.unpack("I", struct.pack("f", 0.5))[0]  # v_scale, a float32 parameter
        assert replays[-1] and any(v & 0xFFFFFFFF == half for v in record.launches[-1][1])
        assert not any(v & 0xFFFFFFFF == half for v in replayed)


@pytest.mark.parametrize("kind", ["decode-5d", "paged"])
def test_forward_with_the_same_scores_is_replayed(kind, replays):
    """SGLang calls the deprecated ``forward()`` at every layer with the planned scores given again: the
    step stays (so its replay does); other scores replace the step, as FlashInfer's ``forward()`` does."""
    with testing.fake_driver_launches(params_read=PARAMS):
        s = Setup(kind)
        extra = {} if kind.startswith("decode") else dict(causal=True)
        for _ in range(3):
            s.w.forward(*s.inputs(), sm_scale=0.1, logits_soft_cap=0.0, **extra)
        step = s.w._step
        s.w.forward(*s.inputs(), sm_scale=0.1, logits_soft_cap=0.0, **extra)
        assert replays[-2:] == [True, True] and s.w._step is step
        s.w.forward(*s.inputs(), sm_scale=0.2, logits_soft_cap=0.0, **extra)
        assert s.w._step is not step and s.w._step.params.sm_scale == 0.2 and not replays[-1]


def _single(kind: str):
    """A single-request function and a maker of one call's tensors (new each time, the same kinds)."""
    import tritoninfer

    if kind == "single-decode":
        return tritoninfer.single_decode_with_kv_cache, lambda: (
            torch.zeros(HQ, D, dtype=torch.bfloat16), torch.zeros(3000, HK, D, dtype=torch.bfloat16),
            torch.zeros(3000, HK, D, dtype=torch.bfloat16))
    rows = 4096 if kind == "single-prefill-gluon" else 300  # (causal on the Gluon kernel from 4K tokens)
    return tritoninfer.single_prefill_with_kv_cache, lambda: (
        torch.zeros(rows, HQ, D, dtype=torch.bfloat16), torch.zeros(rows, HK, D, dtype=torch.bfloat16),
        torch.zeros(rows, HK, D, dtype=torch.bfloat16))


@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out-lse"])
@pytest.mark.parametrize("kind", ["single-decode", "single-prefill", "single-prefill-gluon"])
def test_single_functions_replay_what_the_full_path_launches(kind, with_lse, replays, monkeypatch):
    """The single-request functions keep their last call the same way (one slot each): a call with new
    tensors of the same kinds and the same options is replayed, and launches what the full path does."""
    from tritoninfer import decode, prefill

    fn, make = _single(kind)
    opts = {} if kind == "single-decode" else dict(causal=True)
    slot = (decode if kind == "single-decode" else prefill)._SINGLE_REPLAY
    with fake_driver(monkeypatch, kind.endswith("gluon")) as record:
        for _ in range(2):
            fn(*make(), return_lse=with_lse, **opts)
        record.launches.clear()
        inputs = make()
        result = fn(*inputs, return_lse=with_lse, **opts)
        assert replays[-1]
        replayed = record.launches[-1]
        slot[0] = None
        full = fn(*inputs, return_lse=with_lse, **opts)
        out = (result[0] if with_lse else result)
        full_out = (full[0] if with_lse else full)
        assert out.shape == full_out.shape and out.dtype == full_out.dtype
        # (each call allocates its output: compare the launches with the outputs' addresses masked)
        outs = {out.data_ptr() & 0xFFFFFFFF, full_out.data_ptr() & 0xFFFFFFFF}
        if with_lse:
            outs |= {result[1].data_ptr() & 0xFFFFFFFF, full[1].data_ptr() & 0xFFFFFFFF}
        low = [[v & 0xFFFFFFFF for v in params] for _, params in (replayed, record.launches[-1])]
        assert replayed[0] == record.launches[-1][0]
        assert [v for v in low[0] if v not in outs] == [v for v in low[1] if v not in outs]
        assert inputs[0].data_ptr() in replayed[1] or kind.endswith("gluon")  # (Gluon: q through its TMA map)


def test_single_functions_take_the_full_path_for_other_calls(replays, monkeypatch):
    """Other options (a scale, a mask) or a route switch flipped between calls: the full path."""
    from tritoninfer import _route

    fn, make = _single("single-prefill-gluon")
    with fake_driver(monkeypatch, True):
        for _ in range(3):
            fn(*make(), causal=True)
        assert replays[-1]
        q, k, v = make()
        for kwargs in (dict(causal=True, sm_scale=0.05), dict(causal=False),
                       dict(causal=True, custom_mask=torch.ones(q.shape[0], k.shape[0], dtype=torch.bool))):
            replays.clear()
            fn(q, k, v, **kwargs)
            assert not any(replays), kwargs
        fn(q, k, v, causal=True)
        monkeypatch.setattr(_route, "HOPPER_PREFILL", False)
        replays.clear()
        fn(q, k, v, causal=True)
        assert not any(replays)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["single-decode", "single-prefill", "single-prefill-gluon"])
def test_gpu_replayed_single_calls_match_reference(kind, replays):
    """On the GPU: a single-request function called for three layers (each its own q, K, V), twice, as
    transformers' integration calls it; the calls after the recorded one are replays, each matching the
    reference (4,096 causal tokens take the Gluon kernel on an H200)."""
    from tritoninfer import reference

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(5)
    fn, make = _single(kind)
    layers = [tuple(torch.randn(*t.shape, generator=g).to("cuda", torch.bfloat16) for t in make()) for _ in range(3)]
    ref_fn = reference.single_decode_with_kv_cache if kind == "single-decode" else reference.single_prefill_with_kv_cache
    opts = {} if kind == "single-decode" else dict(causal=True)
    for _ in range(2):
        for q, k, v in layers:
            out = fn(q, k, v, **opts)
            ref = ref_fn(q, k, v, **opts)
            testing.assert_close(out, ref[0] if isinstance(ref, tuple) else ref, torch.bfloat16)
    assert replays.count(True) >= 4, replays
