"""``flashinfer.mla`` (and the MLA names of ``flashinfer.decode`` / ``flashinfer.page``) for
:func:`tritoninfer.install_as_flashinfer`: the MLA wrappers as thin subclasses that add the private
attributes engines use. Imported by ``_compat._module_contents`` when the modules are built.

SGLang's ``fast_mla_decode_plan`` (its CUDA-graph replay path) sets ``_causal``, ``_page_size`` and
``_sm_scale``, then calls ``wrapper._cached_module.plan(float_ws, int_ws, pinned_ws, qo_indptr_cpu,
kv_indptr_cpu, kv_len_arr_cpu, num_heads, head_dim_ckv, causal)`` with the page ids already written
into ``_kv_indices_buf``; it reads ``_float_workspace_buffer``, ``_int_workspace_buffer`` and
``_pin_memory_int_workspace_buffer``. ``tests/test_mla.py`` checks that path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from . import mla as _mla
from ._compat import _CachedModule, _CompatAttributes
from ._options import host_index


class _MLAModule(_CachedModule):
    """What ``BatchMLAPagedAttentionWrapper._cached_module`` stands for in FlashInfer: the compiled
    module whose ``plan`` engines call to re-plan without the wrapper's ``plan()``. ``plan`` takes
    FlashInfer's arguments ``(float_ws, int_ws, pinned_ws, qo_indptr_host, kv_indptr_host,
    kv_len_host, num_heads, head_dim_ckv, causal)``; the page ids are read from the wrapper's
    ``_kv_indices_buf`` (as FlashInfer's kernel does) and the other settings (``head_dim_kpe``,
    dtypes, ``_page_size``, ``_sm_scale``) are the wrapper's current ones. Returns the plan, which
    engines may store as ``_plan_info``."""

    def plan(self, *args):
        w = self._target()
        if len(args) < 9:
            raise TypeError(f"_cached_module.plan (MLA): expected at least 9 arguments, got {len(args)}")
        qo, kvp, kv_len, num_heads, head_dim_ckv, causal = args[3:9]
        step = w._step
        indices = w._kv_indices_buf
        if indices is None:
            raise ValueError("_cached_module.plan reads the page ids from _kv_indices_buf: plan() first, or create "
                             "the wrapper with use_cuda_graph=True and its buffers")
        w._plan_impl(host_index(qo, "qo_indptr"), host_index(kvp, "kv_indptr"), indices,
                     host_index(kv_len, "kv_len_arr"), int(num_heads), int(head_dim_ckv), step.head_dim_kpe,
                     w._page_size, bool(causal), w._sm_scale, step.q_dtype, step.kv_dtype, sources=None)
        w.__dict__.pop("_compat_page_size", None)
        return w._step.device_plan


def _planned_field(field: str) -> property:
    """``_causal`` / ``_sm_scale``: the planned value. FlashInfer's ``run()`` reads them, so setting
    one takes effect at once (the step is replaced with the new value; nothing else changes)."""

    def get(self):
        step = self.__dict__.get("_step")
        if step is None:
            return self.__dict__.get(f"_compat{field}")
        return getattr(step, field[1:])

    def set(self, value) -> None:
        step = self.__dict__.get("_step")
        if step is None:
            self.__dict__[f"_compat{field}"] = value
            return
        value = bool(value) if field == "_causal" else float(value)
        if value != getattr(step, field[1:]):
            if field == "_sm_scale" and (value > 0) != (step.sm_scale > 0):
                raise ValueError(f"{field}: a scale of another sign needs plan() (the kernel variant changes)")
            self.__dict__["_step"] = dataclasses.replace(step, **{field[1:]: value})

    return property(get, set, doc=f"The planned ``{field[1:]}`` (FlashInfer's ``{field}``).")


def _page_size_get(self):
    pending = self.__dict__.get("_compat_page_size")
    if pending is not None:
        return pending
    step = self.__dict__.get("_step")
    return None if step is None else step.page_size


def _page_size_set(self, value) -> None:
    # a page size only takes effect through a plan (the next _cached_module.plan uses it); run()
    # checks the cache against the planned one
    self.__dict__["_compat_page_size"] = int(value)


_SHARED = {name: _CompatAttributes.__dict__[name] for name in (
    "_int_workspace_buffer", "_pin_memory_int_workspace_buffer", "_planned", "_plan_info", "_cached_q_data_type",
    "_cached_kv_data_type", "_check_planned")}


def _subclass(core: type, module: str, extra: Dict[str, Any]) -> type:
    namespace = {
        "__module__": module,
        "__qualname__": core.__name__,
        "__doc__": (core.__doc__ or "") + "\n\n(Registered by tritoninfer.install_as_flashinfer(): adds the private "
                   "attributes FlashInfer engines use, see tritoninfer._compat_mla.)",
        **_SHARED,
        **extra,
    }
    return type(core.__name__, (core,), namespace)


BatchMLAPagedAttentionWrapper = _subclass(_mla.BatchMLAPagedAttentionWrapper, "flashinfer.mla", {
    "_cached_module": property(_MLAModule.of),
    "_causal": _planned_field("_causal"),
    "_sm_scale": _planned_field("_sm_scale"),
    "_page_size": property(_page_size_get, _page_size_set),
})
BatchDecodeMlaWithPagedKVCacheWrapper = _subclass(_mla.BatchDecodeMlaWithPagedKVCacheWrapper, "flashinfer.decode", {})


def contents() -> Dict[str, Dict[str, Any]]:
    """The MLA names, per FlashInfer module."""
    return {
        "flashinfer.mla": {"BatchMLAPagedAttentionWrapper": BatchMLAPagedAttentionWrapper},
        "flashinfer.decode": {"BatchDecodeMlaWithPagedKVCacheWrapper": BatchDecodeMlaWithPagedKVCacheWrapper},
        "flashinfer.page": {"append_paged_mla_kv_cache": _mla.append_paged_mla_kv_cache},
    }


__all__ = ["contents"]
