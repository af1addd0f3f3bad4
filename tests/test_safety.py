"""Input that must give a clear error and never a crash or a read outside a tensor: page ids outside
the cache (on the host and in device memory), CPU tensors without the interpreter; and two
FlashInfer semantics engines rely on: a custom mask replaces the causal mask, and a caller's ``lse``
buffer is written even without ``return_lse``."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DEVICE, ON_GPU

import tritoninfer
from tritoninfer import reference, testing
from tritoninfer.cascade import MultiLevelCascadeAttentionWrapper
from tritoninfer.decode import BatchDecodeWithPagedKVCacheWrapper
from tritoninfer.page import append_paged_kv_cache, get_batch_indices_positions
from tritoninfer.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

INT32_MAX = 2**31 - 1


def _ws():
    return testing.make_workspace(32 << 20, DEVICE)


# --------------------------------------------------------------------------------------------------
# a custom mask replaces the causal mask (FlashInfer 0.5.3: MaskMode.CUSTOM whenever a mask is held)
# --------------------------------------------------------------------------------------------------


def _mask_inputs(qo_lens, kv_lens, heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, qo_indptr = testing.random_qo(qo_lens, heads[0], head_dim, dtype, DEVICE, g)
    masks = [torch.rand(qo, kv, generator=g) < 0.6 for qo, kv in zip(qo_lens, kv_lens)]
    # keys right of the causal diagonal are kept somewhere, so applying causal too would change the result
    for m, kv in zip(masks, kv_lens):
        m[0, kv - 1] = True
    flat = torch.cat([m.reshape(-1) for m in masks]).to(DEVICE)
    return g, q, qo_indptr, masks, flat


def _run_masked(entry, causal, qo_lens, kv_lens, heads, head_dim, dtype):
    g, q, qo_indptr, masks, flat = _mask_inputs(qo_lens, kv_lens, heads, head_dim, dtype)
    k, kv_indptr = testing.make_ragged(kv_lens, heads[1], head_dim, dtype, DEVICE, g)
    v, _ = testing.make_ragged(kv_lens, heads[1], head_dim, dtype, DEVICE, g)
    if entry == "single":
        o = tritoninfer.single_prefill_with_kv_cache(q, k, v, custom_mask=masks[0].to(DEVICE), causal=causal)
        ref = reference.single_prefill_with_kv_cache(q, k, v, custom_mask=masks[0])
        return o, ref
    if entry == "ragged":
        w = BatchPrefillWithRaggedKVCacheWrapper(_ws())
        w.plan(qo_indptr, kv_indptr, heads[0], heads[1], head_dim, custom_mask=flat, causal=causal, q_data_type=dtype)
        ref, _ = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, custom_mask=flat.cpu())
        return w.run(q, k, v), ref
    kv = testing.make_paged_kv(kv_lens, 4, heads[1], head_dim, dtype=dtype, device=DEVICE, generator=g)
    w = BatchPrefillWithPagedKVCacheWrapper(_ws())
    w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, heads[0], heads[1], head_dim, 4,
           custom_mask=flat, causal=causal, q_data_type=dtype)
    ref, _ = reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                         kv.kv_last_page_len, custom_mask=flat.cpu())
    if entry == "paged_forward":  # the deprecated forward() replaces the planned causal flag
        return w.forward(q, kv.cache, causal=not causal), ref
    return w.run(q, kv.cache), ref


def _check_mask_replaces_causal(entry, shape, heads, head_dim, dtype):
    """causal=True and causal=False give the same result when a custom mask is given: the mask's."""
    outs = []
    for causal in (False, True):
        o, ref = _run_masked(entry, causal, *shape, heads, head_dim, dtype)
        testing.assert_close(o, ref, dtype)
        outs.append(o)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("entry", ["single", "ragged", "paged", "paged_forward"])
def test_custom_mask_replaces_causal(entry):
    shape = ((5,), (9,)) if entry == "single" else ((5, 3), (9, 4))
    _check_mask_replaces_causal(entry, shape, (4, 2), 16, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["single", "ragged", "paged"])
def test_gpu_custom_mask_replaces_causal(entry):
    shape = ((300,), (700,)) if entry == "single" else ((200, 64, 130), (500, 64, 900))
    _check_mask_replaces_causal(entry, shape, (32, 8), 128, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# a caller's lse buffer is written without return_lse (FlashInfer hands it to the kernel either way)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["decode", "paged", "ragged"])
def test_lse_buffer_written_without_return_lse(entry):
    g = torch.Generator().manual_seed(1)
    heads, d, dtype = (4, 2), 32, torch.float16
    kv_lens = (9, 3, 17)
    qo_lens = (1, 1, 1) if entry == "decode" else (3, 2, 5)
    q, qo_indptr = testing.random_qo(qo_lens, heads[0], d, dtype, DEVICE, g)
    out = torch.empty(q.shape, dtype=dtype, device=DEVICE)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=DEVICE)
    if entry == "ragged":
        k, kv_indptr = testing.make_ragged(kv_lens, heads[1], d, dtype, DEVICE, g)
        v, _ = testing.make_ragged(kv_lens, heads[1], d, dtype, DEVICE, g)
        w = BatchPrefillWithRaggedKVCacheWrapper(_ws())
        w.plan(qo_indptr, kv_indptr, heads[0], heads[1], d, causal=True, q_data_type=dtype)
        result = w.run(q, k, v, out=out, lse=lse)
        _, ref_lse = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, causal=True)
    else:
        kv = testing.make_paged_kv(kv_lens, 4, heads[1], d, dtype=dtype, device=DEVICE, generator=g)
        if entry == "decode":
            w = BatchDecodeWithPagedKVCacheWrapper(_ws())
            w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, heads[0], heads[1], d, 4, q_data_type=dtype)
            _, ref_lse = reference.batch_decode_with_paged_kv_cache(q, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                                    kv.kv_last_page_len)
        else:
            w = BatchPrefillWithPagedKVCacheWrapper(_ws())
            w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, heads[0], heads[1], d, 4,
                   causal=True, q_data_type=dtype)
            _, ref_lse = reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, kv.cache, kv.kv_indptr,
                                                                     kv.kv_indices, kv.kv_last_page_len, causal=True)
        result = w.run(q, kv.cache, out=out, lse=lse)
    assert result is out  # not a tuple: return_lse is False
    testing.assert_lse_close(lse, ref_lse, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# page ids outside the cache: host-side tables are checked at plan()/run()
# --------------------------------------------------------------------------------------------------

BAD_IDS = ["too_large", "num_pages", "minus_one", "int32_max"]


def _bad_value(kind: str, num_pages: int) -> int:
    return {"too_large": num_pages + 959, "num_pages": num_pages, "minus_one": -1, "int32_max": INT32_MAX}[kind]


def _table_with_bad_id(kind, kv_lens=(9, 14, 5), page=4, heads=(4, 2), d=16):
    g = torch.Generator().manual_seed(2)
    kv = testing.make_paged_kv(kv_lens, page, heads[1], d, device=DEVICE, generator=g)
    indices = kv.kv_indices.clone()
    bad = _bad_value(kind, kv.num_pages)
    position = int(kv.kv_indptr[1]) + 1  # the second page of request 1
    indices[position] = bad
    return g, kv, indices, bad


def _expect_page_error(bad):
    # the argument's own name: decode's plan() calls it ``indices``
    return pytest.raises(ValueError, match=rf"^indices: request 1 refers to page id {bad}\b")


@pytest.mark.skipif(ON_GPU, reason="the page table's host copy: CPU tensors (on the GPU the ids are bounded by the kernels)")
@pytest.mark.parametrize("kind", BAD_IDS)
def test_host_page_ids_checked(kind):
    """Page ids on the host: -1 is refused by plan(); ids past the cache by the first run() that
    knows the cache's size. Decode, paged prefill and each cascade level."""
    g, kv, indices, bad = _table_with_bad_id(kind)
    q, _ = testing.random_qo((1, 1, 1), 4, 16, torch.float16, DEVICE, g)
    decode = BatchDecodeWithPagedKVCacheWrapper(_ws())
    with _expect_page_error(bad):
        decode.plan(kv.kv_indptr, indices, kv.kv_last_page_len, 4, 2, 16, 4)
        decode.run(q, kv.cache)
    prefill = BatchPrefillWithPagedKVCacheWrapper(_ws())
    qo_indptr = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"paged_kv_indices: request 1 refers to page id {bad}\b"):
        prefill.plan(qo_indptr, kv.kv_indptr, indices, kv.kv_last_page_len, 4, 2, 16, 4)
        prefill.run(q, kv.cache)
    cascade = MultiLevelCascadeAttentionWrapper(2, _ws())
    shared = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"level 1: .*request 1 refers to page id {bad}\b"):
        cascade.plan([torch.tensor([0, 3], dtype=torch.int32), qo_indptr], [shared, kv.kv_indptr],
                     [kv.kv_indices[:1].clone(), indices], [torch.tensor([4], dtype=torch.int32), kv.kv_last_page_len],
                     4, 2, 16, 4)
        cascade.run(q, kv.cache)


@pytest.mark.skipif(ON_GPU, reason="host-side check of CPU tensors")
@pytest.mark.parametrize("kind", BAD_IDS)
def test_append_host_page_ids_checked(kind):
    g, kv, indices, bad = _table_with_bad_id(kind)
    lens = torch.tensor(kv.kv_lens, dtype=torch.int32)
    append_indptr = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    batch_indices, positions = get_batch_indices_positions(append_indptr, lens, 6)
    k = testing.randn((6, 2, 16), torch.float16, DEVICE, g)
    with pytest.raises(ValueError, match=rf"kv_indices: page id {bad} is outside"):
        # request 1's last two tokens (positions 12, 13) are in its fourth page; make it the bad one
        indices[int(kv.kv_indptr[1]) + 3] = bad
        append_paged_kv_cache(k, k, batch_indices, positions, kv.cache, indices, kv.kv_indptr, kv.kv_last_page_len)


# --------------------------------------------------------------------------------------------------
# page ids in device memory: the kernels bound them and report them (run in a subprocess: before the
# fix these cases crashed the process)
# --------------------------------------------------------------------------------------------------

_DEVICE_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    DEVICE = sys.argv[1]
    import tritoninfer
    from tritoninfer import testing
    from tritoninfer.decode import BatchDecodeWithPagedKVCacheWrapper, fast_decode_plan
    from tritoninfer.prefill import BatchPrefillWithPagedKVCacheWrapper
    from tritoninfer.page import append_paged_kv_cache, get_batch_indices_positions

    results = {}
    g = torch.Generator().manual_seed(3)
    kv = testing.make_paged_kv((9, 14, 5), 4, 2, 16, device=DEVICE, generator=g)
    q, _ = testing.random_qo((1, 1, 1), 4, 16, torch.float16, DEVICE, g)
    qo_indptr = torch.arange(4, dtype=torch.int32)
    bad_values = {"too_large": kv.num_pages + 959, "num_pages": kv.num_pages, "minus_one": -1, "int32_max": 2**31 - 1}

    def attempt(name, fn):
        try:
            fn()
            tritoninfer.check_errors()
            results[name] = "no error"
        except ValueError as exc:
            results[name] = str(exc)

    def decode_after_plan(bad):
        # the ids change in memory after plan(): only the kernel sees them
        indices = kv.kv_indices.clone()
        w = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 24, DEVICE))
        w.plan(kv.kv_indptr, indices, kv.kv_last_page_len, 4, 2, 16, 4)
        indices[int(kv.kv_indptr[1]) + 1] = bad
        o = w.run(q, kv.cache)
        assert torch.isfinite(o[0]).all() and torch.isfinite(o[2]).all()

    def prefill_after_plan(bad):
        indices = kv.kv_indices.clone()
        w = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(1 << 24, DEVICE))
        w.plan(qo_indptr, kv.kv_indptr, indices, kv.kv_last_page_len, 4, 2, 16, 4, causal=True)
        indices[int(kv.kv_indptr[1]) + 1] = bad
        w.run(q, kv.cache)

    def graph_decode(bad, where):
        # CUDA-graph mode: the engine writes the buffers, fast_decode_plan copies nothing
        batch = 3
        indptr_buf = torch.empty(batch + 1, dtype=torch.int32, device=DEVICE)
        indices_buf = torch.zeros(64, dtype=torch.int32, device=DEVICE)
        last_buf = torch.empty(batch, dtype=torch.int32, device=DEVICE)
        w = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 24, DEVICE), use_cuda_graph=True,
                                               paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
                                               paged_kv_last_page_len_buffer=last_buf)
        indptr_buf.copy_(kv.kv_indptr)
        indices_buf[: kv.kv_indices.numel()].copy_(kv.kv_indices)
        last_buf.copy_(kv.kv_last_page_len)
        fast_decode_plan(w, indptr_buf, indices_buf, last_buf, 4, 2, 16, 4, q_data_type=torch.float16,
                         global_override_indptr_cpu=kv.kv_indptr.cpu())
        if where == "indices":
            indices_buf[int(kv.kv_indptr[1]) + 1] = bad
        else:  # request 1's pages start past the end of the indices buffer
            indptr_buf[1] = bad
        w.run(q, kv.cache)

    for kind, bad in bad_values.items():
        attempt(f"decode/{kind}", lambda: decode_after_plan(bad))
        attempt(f"prefill/{kind}", lambda: prefill_after_plan(bad))
        attempt(f"graph_decode/{kind}", lambda: graph_decode(bad, "indices"))
    attempt("graph_decode/indptr", lambda: graph_decode(62, "indptr"))

    # the next plan() raises a fault found since the last check, then the record is clear
    w = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 24, DEVICE))
    indices = kv.kv_indices.clone()
    w.plan(kv.kv_indptr, indices, kv.kv_last_page_len, 4, 2, 16, 4)
    indices[int(kv.kv_indptr[1]) + 1] = 999
    w.run(q, kv.cache)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    try:
        w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 16, 4)
        results["next_plan"] = "no error"
    except ValueError as exc:
        results["next_plan"] = str(exc)
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 16, 4)
    results["plan_after"] = "ok"

    if DEVICE == "cuda":
        # append with device ids: the kernel skips and reports (on the CPU the host check comes first)
        lens = torch.tensor(kv.kv_lens, dtype=torch.int32, device=DEVICE)
        append_indptr = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=DEVICE)
        bi, pos = get_batch_indices_positions(append_indptr, lens, 6)
        k = testing.randn((6, 2, 16), torch.float16, DEVICE, g)
        for kind, bad in bad_values.items():
            indices = kv.kv_indices.clone()
            indices[int(kv.kv_indptr[1]) + 3] = bad
            attempt(f"append/{kind}", lambda: append_paged_kv_cache(k, k, bi, pos, kv.cache, indices, kv.kv_indptr,
                                                                     kv.kv_last_page_len))
    print("RESULTS " + json.dumps(results))
''')


def _run_device_script():
    env = dict(os.environ)
    if not ON_GPU:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _DEVICE_SCRIPT, DEVICE], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, f"the process died (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


@pytest.fixture(scope="module")
def device_results():
    return _run_device_script()


@pytest.mark.parametrize("entry", ["decode", "prefill", "graph_decode"])
@pytest.mark.parametrize("kind", BAD_IDS)
def test_device_page_ids_bounded_and_reported(device_results, entry, kind):
    bad = _bad_value(kind, 8)  # make_paged_kv((9, 14, 5), 4) has 3 + 4 + 2 + 2 extra = 11 pages
    bad = {"too_large": 11 + 959, "num_pages": 11}.get(kind, bad)
    msg = device_results[f"{entry}/{kind}"]
    assert f"kv_indices: request 1 refers to page id {bad}," in msg and "[0, 11) pages" in msg, msg


def test_device_page_table_past_indices_reported(device_results):
    msg = device_results["graph_decode/indptr"]
    assert msg.startswith("kv_indptr: the pages of request 1 (from entry 62) run past the end of kv_indices (64 entries)"), msg


def test_next_plan_raises_a_recorded_fault(device_results):
    assert "page id 999" in device_results["next_plan"]
    assert device_results["plan_after"] == "ok"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", BAD_IDS)
def test_gpu_append_page_ids_reported(device_results, kind):
    bad = {"too_large": 11 + 959, "num_pages": 11, "minus_one": -1, "int32_max": INT32_MAX}[kind]
    msg = device_results[f"append/{kind}"]
    assert f"maps to page id {bad}," in msg and "request 1" in msg, msg


@pytest.mark.gpu
def test_gpu_hopper_prefill_page_ids_reported():
    """The Gluon prefill reads pages through TMA boxes, which the hardware bounds; a check kernel
    reports the ids (long bf16 requests, head_dim 128, page 16: the Hopper path where it applies)."""
    g = torch.Generator().manual_seed(4)
    kv = testing.make_paged_kv((2048, 2048), 16, 8, 128, dtype=torch.bfloat16, device=DEVICE, generator=g)
    q, qo_indptr = testing.random_qo((2048, 2048), 32, 128, torch.bfloat16, DEVICE, g)
    indices = kv.kv_indices.clone()
    w = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(128 << 20, DEVICE))
    w.plan(qo_indptr, kv.kv_indptr, indices, kv.kv_last_page_len, 32, 8, 128, 16, causal=True,
           q_data_type=torch.bfloat16)
    indices[int(kv.kv_indptr[1]) + 5] = kv.num_pages + 3
    w.run(q, kv.cache)
    with pytest.raises(ValueError, match=rf"request 1 refers to page id {kv.num_pages + 3},"):
        tritoninfer.check_errors()


# --------------------------------------------------------------------------------------------------
# CPU tensors without the interpreter
# --------------------------------------------------------------------------------------------------


def test_cpu_tensors_without_interpreter_say_what_to_do():
    script = textwrap.dedent('''
        import torch, tritoninfer
        from tritoninfer import testing
        out = []
        kv = testing.make_paged_kv((5, 3), 4, 2, 16)
        w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
        for call in (lambda: w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 16, 4),
                     lambda: tritoninfer.rmsnorm(torch.randn(2, 16), torch.ones(16)),
                     lambda: tritoninfer.single_decode_with_kv_cache(torch.randn(4, 16).half(),
                                                                     torch.randn(5, 2, 16).half(),
                                                                     torch.randn(5, 2, 16).half())):
            try:
                call()
                out.append("no error")
            except ValueError as exc:
                out.append(str(exc))
        print("\\n".join(out))
    ''')
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3 and all("TRITON_INTERPRET=1" in line for line in lines), proc.stdout


def test_empty_rows_raise_no_numpy_warning():
    """Rows that see no key give LSE -inf without a log2(0): under the interpreter numpy would warn
    ('divide by zero encountered in log2') to every user of the library."""
    import warnings

    g = torch.Generator().manual_seed(5)
    kv = testing.make_paged_kv((0, 6), 4, 2, 16, device=DEVICE, generator=g)
    q, _ = testing.random_qo((1, 1), 4, 16, torch.float16, DEVICE, g)
    w = BatchDecodeWithPagedKVCacheWrapper(_ws())
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 16, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _, lse = w.run(q, kv.cache, return_lse=True)
    assert torch.isinf(lse[0]).all() and torch.isfinite(lse[1]).all()


def test_check_page_ids_reports_only_ids_that_exist():
    """The page-id check of the Gluon kernels' plans (``_hopper.check_page_ids``): a request without
    pages reports nothing, also against an empty cache (FlashInfer's MLA tests plan kv_len 0 over a
    cache of no pages); an id past the cache is reported with its request."""
    from tritoninfer import _hopper

    indptr = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    indices = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    _hopper.check_page_ids(indptr, indices, 3, 0)
    tritoninfer.check_errors()
    indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=DEVICE)
    indices = torch.tensor([0, 1, 2, 3, 6, 0, 0, 0], dtype=torch.int32, device=DEVICE)
    _hopper.check_page_ids(indptr, indices, 3, 4)
    with pytest.raises(ValueError, match="request 2 refers to page id 6"):
        tritoninfer.check_errors()
