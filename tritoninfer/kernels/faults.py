"""Bounds on the indices a caller passes, for the kernels that follow a page table.

No page id or page-table entry may make a kernel read or write outside its tensors: an index out
of range is replaced by a safe one (or the access is skipped) and written to the fault record that
``tritoninfer/_errors.py`` reads on the host (its codes are the ``code`` arguments here).
"""

import triton
import triton.language as tl


@triton.jit
def bound_page_ids(page, bad_page, num_pages):
    """Page ids [any shape] as the K/V addresses may use them: as unsigned ints clamped to
    ``num_pages - 1`` (a negative id is a large unsigned one), so no id reads outside the cache; and
    ``bad_page`` (uint32, same shape) keeps the largest unsigned id seen, for ``report_bad_pages``.
    Two integer instructions per id. Positions past the KV range load id 0, a page whenever the
    cache has one (the launcher refuses an empty cache for a plan that reads KV)."""
    page = page.to(tl.uint32, bitcast=True)
    return tl.minimum(page, tl.cast(num_pages - 1, tl.uint32)).to(tl.int64), tl.maximum(bad_page, page)


@triton.jit
def report_fault(err_ptr, code, req, value, limit):
    """Writes a fault record (``tritoninfer/_errors.py``): one 64-bit store of code, request and value."""
    fault = (tl.cast(code, tl.int64) << 60) | ((tl.cast(req, tl.int64) & 0x0FFFFFFF) << 32) | \
        (tl.cast(value, tl.int64) & 0xFFFFFFFF)
    tl.store(err_ptr, fault)
    tl.store(err_ptr + 1, tl.cast(limit, tl.int64))


@triton.jit
def report_bad_pages(err_ptr, bad_page, num_pages, req):
    """Reports (code 1) the largest id ``bound_page_ids`` kept in ``bad_page`` [N] if it is outside
    ``[0, num_pages)``. An empty cache reports only ids above 0: ``bad_page`` starts at 0, and the
    launchers refuse an empty cache for a plan that reads KV, so a 0 there was read from no page."""
    largest = tl.max(bad_page, 0)
    if (largest >= tl.cast(num_pages, tl.uint32)) & ((largest > 0) | (num_pages > 0)):
        report_fault(err_ptr, 1, req, largest.to(tl.int32, bitcast=True), num_pages)


@triton.jit(do_not_specialize=["num_pages"])
def check_page_ids_kernel(kv_indptr_ptr, kv_indices_ptr, err_ptr, num_pages, BLOCK: tl.constexpr):
    """Reports (code 1) a page id of request ``program_id(0)`` outside ``[0, num_pages)``. For kernels
    whose reads are bounded by the hardware instead (TMA boxes of the Gluon prefill) and so find no
    bad id themselves; ``kv_indptr`` is the plan's own, checked on the host."""
    req = tl.program_id(0)
    start = tl.load(kv_indptr_ptr + req)
    end = tl.load(kv_indptr_ptr + req + 1)
    # [BLOCK]
    bad_page = tl.zeros([BLOCK], tl.uint32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        page = tl.load(kv_indices_ptr + offs, mask=offs < end, other=0)
        _, bad_page = bound_page_ids(page, bad_page, num_pages)
    if end > start:  # a request without pages has no id to report (id 0 of an empty cache is not one)
        report_bad_pages(err_ptr, bad_page, num_pages, req)
