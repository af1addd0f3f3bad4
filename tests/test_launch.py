"""The launch cache (``tritoninfer._launch``): its key must separate every pair of arguments that
Triton specialises differently, or a cached kernel would run with the wrong assumptions."""
import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from tritoninfer._launch import _arg_key, _args_key

INTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 16,
        (1 << 40) + 16, (1 << 63) - 1, -(1 << 63), 1 << 63, (1 << 63) + 16]


def _triton(a):
    return native_specialize_impl(BaseBackend, a, False, True, True)


def _values():
    base = torch.empty(64, dtype=torch.bfloat16)
    tensors = [base, base[1:], base[8:], base.view(torch.float16), base.float()[4:], base.float()[1:]]
    return INTS + [True, False, 0.0, 1.0, 2.5, None] + tensors


@pytest.mark.parametrize("a,b", list(itertools.combinations(_values(), 2)))
def test_key_separates_what_triton_specialises_differently(a, b):
    if _arg_key(a) == _arg_key(b):
        assert _triton(a) == _triton(b)
    if _args_key((a,)) == _args_key((b,)):
        assert _triton(a) == _triton(b)


def test_key_merges_values_triton_treats_alike():
    """The cache must hit across calls, e.g. for a new token count or a new tensor."""
    assert _arg_key(32) == _arg_key(48) and _arg_key(17) == _arg_key(3)
    assert _arg_key(torch.empty(8)) == _arg_key(torch.empty(16))
    assert _arg_key(0.5) == _arg_key(3.0)


@pytest.mark.gpu
def test_cached_launches_follow_alignment_and_call_profiler_hooks():
    """Decode through the launch cache: a q view 2 bytes off 16-byte alignment must get its own
    kernel (a wrong cache hit would read misaligned vectors), and a registered launch hook must be
    called on cached launches too."""
    from triton import knobs

    import tritoninfer
    from tritoninfer import reference, testing

    g = torch.Generator().manual_seed(0)
    kv = testing.make_paged_kv([300, 77, 1024], 16, 2, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    base = torch.randn(3 * 8 * 128 + 1, generator=g).to("cuda", torch.bfloat16)
    wrapper = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(32 << 20, "cuda"))
    wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 128, 16, q_data_type=torch.bfloat16)
    calls = []

    def hook(metadata):
        calls.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for offset in (0, 1, 0, 1):
            q = base[offset:offset + 3 * 8 * 128].view(3, 8, 128)
            o = wrapper.run(q, kv.cache)
            ref, _ = reference.batch_decode_with_paged_kv_cache(q, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                                 kv.kv_last_page_len, "NHD")
            testing.assert_close(o, ref, torch.bfloat16)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert calls.count("attention_fwd_kernel") == 4


@pytest.mark.gpu
def test_bound_launch_rejects_tensors_on_another_device():
    """The bound launch passes addresses to Triton's launcher, which then cannot catch a CPU tensor:
    the launch checks every tensor's device itself."""
    import tritoninfer
    from tritoninfer import testing

    kv = testing.make_paged_kv([40, 7], 16, 2, 128, dtype=torch.bfloat16, device="cuda",
                               generator=torch.Generator().manual_seed(0))
    wrapper = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(32 << 20, "cuda"))
    wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 128, 16, q_data_type=torch.bfloat16)
    q = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    wrapper.run(q.cuda(), kv.cache)  # binds the launch
    with pytest.raises(ValueError, match="device"):
        wrapper.run(q, kv.cache.cpu())
