"""``torch.compile`` support: the public ops as ``torch.library`` custom ops.

Dynamo cannot trace Triton's launcher (addresses, driver calls), so under ``torch.compile`` each
public function and wrapper ``run()`` hands its work to a custom op in the ``tritoninfer`` namespace
instead of launching: ``torch.compiler.is_compiling()`` is true while Dynamo traces, and the op's
implementation is the same function run eagerly (checks included, so errors still name the
argument). Outputs are allocated in the traced code and the ops write into them (``mutates_args``),
so their fake implementations have nothing to compute (``segment_packbits``, whose size depends on
the data, returns its output: its fake gives it an unbacked size). An op's implementation calls the
function's private work, never its public name, which a caller may have replaced by its compiled
self (the op would call itself again). Eager calls never go through the dispatcher: the check
costs one function call.

Wrapper ``run()``s go through one op, ``tritoninfer::wrapper_run``, which finds the wrapper by a
handle given at construction and runs its current plan: a compiled graph holds no plan state, so a
re-plan needs no recompilation. (Under ``mode="reduce-overhead"`` the captured CUDA graph keeps the
plan's buffers: re-planned wrappers must be in CUDA-graph mode, as for any CUDA-graph capture.)
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Optional, Sequence

import torch

NAMESPACE = "tritoninfer"


def _no_output(*args, **kwargs) -> None:
    return None


def custom_op(name: str, mutates_args: Sequence[str] = (), fake: Optional[Callable] = None):
    """Registers the decorated function (fully annotated) as ``tritoninfer::name``; ``fake`` is its
    fake implementation (default: none needed, the op only writes into ``mutates_args``)."""

    def register(fn):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=tuple(mutates_args))
        op.register_fake(fake if fake is not None else _no_output)
        return op

    return register


def compiling() -> bool:
    return torch.compiler.is_compiling()


# wrappers by handle, for wrapper_run (weak: an op does not keep a wrapper alive)
_WRAPPERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register_wrapper(wrapper) -> int:
    """A handle for ``wrapper_run`` (called by the wrappers' constructors)."""
    handle = next(_HANDLES)
    _WRAPPERS[handle] = wrapper
    return handle


@custom_op("wrapper_run", mutates_args=("out", "lse"))
def wrapper_run(handle: int, q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor], out: torch.Tensor,
                lse: Optional[torch.Tensor], sinks: Optional[torch.Tensor], q_scale: Optional[float],
                k_scale: Optional[float], v_scale: Optional[float], window_left: Optional[int],
                q_len_per_req: int) -> None:
    """A wrapper's ``run()`` into ``out`` (and ``lse``): ``k`` is the paged cache (a 5-D or 4-D tensor,
    ``v`` None), or the K of a ``(k, v)`` pair / ragged K/V."""
    wrapper = _WRAPPERS.get(handle)
    if wrapper is None:
        raise ValueError(f"tritoninfer::wrapper_run: the wrapper of handle {handle} no longer exists")
    wrapper._run_into(q, k if v is None else (k, v), out, lse, sinks=sinks, q_scale=q_scale, k_scale=k_scale,
                      v_scale=v_scale, window_left=window_left, q_len_per_req=q_len_per_req)


def traced_run(wrapper, q: torch.Tensor, kv, out: Optional[torch.Tensor], lse: Optional[torch.Tensor],
               return_lse: bool, *, zero_out: bool = False, sinks=None, q_scale=None, k_scale=None, v_scale=None,
               window_left=None, q_len_per_req: int = 1):
    """What a wrapper's ``run()`` does while Dynamo traces it: allocate the outputs (shapes from the
    tensors alone, so the graph does not depend on the plan) and call ``wrapper_run``."""
    if isinstance(kv, (tuple, list)):
        k, v = kv
        head_dim_vo = v.shape[-1]
    else:
        k, v = kv, None
        head_dim_vo = kv.shape[-1]
    if out is None:
        alloc = torch.zeros if zero_out else torch.empty
        out = alloc((q.shape[0], q.shape[1], head_dim_vo), dtype=q.dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    wrapper_run(wrapper._handle, q, k, v, out, lse, sinks, q_scale, k_scale, v_scale, window_left, q_len_per_req)
    return (out, lse) if return_lse else out
