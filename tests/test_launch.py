"""The launch cache (``tritoninfer._launch``): its key must separate every pair of arguments that
Triton specialises differently, or a cached kernel would run with the wrong assumptions."""
import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from tritoninfer._launch import _arg_key

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


def test_key_merges_values_triton_treats_alike():
    """The cache must hit across calls, e.g. for a new token count or a new tensor."""
    assert _arg_key(32) == _arg_key(48) and _arg_key(17) == _arg_key(3)
    assert _arg_key(torch.empty(8)) == _arg_key(torch.empty(16))
    assert _arg_key(0.5) == _arg_key(3.0)
