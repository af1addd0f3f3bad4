"""A wrapper's last eager ``run()``, launched again with a later call's addresses and without its checks.

An engine calls a planned wrapper's ``run()`` once per layer with tensors that differ from the last
call's only in their addresses (each layer's query, cache and output). The full path checks every
argument against the plan, finds the cache views, the kernel variant and the bound launch, and ends
in one ``DriverLaunch`` call (``_launch.py``). ``RunReplay`` keeps that call: the step it ran, what
the full path checked of each argument tensor (type, shape, strides, dtype, device: all but the
address) and, for each address the launch passed, the argument it comes from and the byte offset
into it (K and V are views of a paged cache). A call with the same step, the same scalar options
(scales given as Python numbers, compared by value), no sinks or window, and arguments that match in
all of that passes the same checks, so it is launched at once with its own addresses. Anything else
(another plan or scores, a tensor of another shape, strides, dtype or device, a subclass, other or
tensor scales, sinks, an address that is not 16-byte aligned, a profiler's launch hook, another current
device) takes the full path, which records the call again.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _launch
from ._launch import box_values_of, box_views_of

OUT, LSE = -1, -2  # sources of a launch address besides the inputs: the output and the LSE
NO_SCALES = (None, None, None)  # a call's (q_scale, k_scale, v_scale) when it passes none


def scalar_options(*values) -> bool:
    """Whether a call's scalar options (scales) can be matched by value: each None or a Python number (a
    tensor scale would be read from the device to compare)."""
    for value in values:
        if value is not None and type(value) is not float and type(value) is not int:
            return False
    return True


def replayed(wrapper, inputs: tuple, options: tuple, out: Optional[torch.Tensor], lse: Optional[torch.Tensor],
             return_lse: bool):
    """The wrapper's last recorded run (``wrapper._replay``) launched for this call of its planned step
    (``wrapper._step``): the call's result (``out``, or ``(out, lse)`` with ``return_lse``), or None when
    the call must take the full path."""
    replay = wrapper._replay
    done = replay.run(wrapper._step, inputs, options, out, lse, return_lse) if replay is not None else None
    if done is None:
        return None
    return done if return_lse else done[0]


def capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on ``t``'s device: the single-request functions then neither replay nor
    record (``_step.plan_single`` plans such calls apart, into memory the graph owns)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def facts(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """What the full path checks of a tensor argument, all but its address."""
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def _launched(calls: tuple) -> list:
    """What each driver call is replayed with (``DriverLaunch.replay``): the launch, the head values after
    the addresses (ints, floats, the boxes' shapes and strides), the boxes without their tensors and the
    boxes' view ids."""
    return [(call.launch, call.ints + call.floats + tuple(box_values_of(call.boxes)),
             tuple([box._replace(tensor=None) for box in call.boxes]), box_views_of(call.boxes)) for call in calls]


def _same_fixed(previous: "RunReplay", calls: tuple) -> bool:
    """Whether ``calls`` pass the launch-owned tensors of ``previous`` (the same objects) where it did."""
    own = []
    for call, (sources, box_sources) in zip(calls, previous.sources):
        tensors = list(call.tensors) + [b.tensor for b in call.boxes]
        if len(tensors) != len(sources) + len(box_sources):
            return False
        own += [t for t, (i, _) in zip(tensors, sources + box_sources) if i is None]
    return len(own) == len(previous.fixed) and all(a is b for a, b in zip(own, previous.fixed))


class RunReplay:
    """The last eager call of a wrapper's ``run()`` (``record``), launched again for a matching call
    (``run``). ``inputs``: the call's input tensors in the wrapper's fixed order (query, then the cache
    or K and V); ``options``: its scalar options (the scales); ``out``/``lse``: the tensors the launches wrote (allocated by the full path when the
    caller passed none: ``out_zeroed`` says how); ``calls``: its driver launches, in order (a kernel
    and its merge pass, MLA's)."""

    __slots__ = ("step", "options", "facts", "out_facts", "lse_facts", "alloc_out", "out_zeroed", "alloc_lse", "return_lse",
                 "sources", "fixed", "args_used", "has_fixed", "flat_sources", "spans", "launched", "keep")

    @staticmethod
    def record(step, inputs: tuple, options: tuple, out_arg: Optional[torch.Tensor], lse_arg: Optional[torch.Tensor],
               out: torch.Tensor, lse: Optional[torch.Tensor], return_lse: bool, out_zeroed: bool,
               calls: tuple, previous: Optional["RunReplay"] = None, keep=None) -> Optional["RunReplay"]:
        """The replay of a call the full path launched through ``calls``, or None (one took Triton's path,
        or a launched address that no argument alone holds, other than a launch's own scratch).
        ``previous``: the wrapper's last replay; where this call is of its kind through the same driver
        launches (a new plan's first run), the addresses come from the same arguments and only the step
        and the calls change. ``keep``: an object the launches read through and the replay keeps alive (a
        single-request function's step, whose device plan the launches' arguments point into)."""
        if not calls or None in calls:
            return None
        for t in inputs:
            if type(t) is not torch.Tensor:
                return None
        if len(calls) > 1 and any(call.launch.device != calls[0].launch.device for call in calls):
            return None
        if (previous is not None and previous.options == options and len(previous.launched) == len(calls)
                and all([a[0] is b.launch for a, b in zip(previous.launched, calls)])
                and (not previous.fixed or _same_fixed(previous, calls))
                and previous.return_lse == return_lse and previous.alloc_out == (out_arg is None)
                and previous.out_zeroed == out_zeroed and previous.alloc_lse == (lse_arg is None and lse is not None)
                and previous.facts == tuple(facts(t) for t in inputs) and previous.out_facts == facts(out)
                and previous.lse_facts == facts(lse)):
            previous.step, previous.launched, previous.keep = step, _launched(calls), keep
            return previous
        args = list(enumerate(inputs)) + [(OUT, out)] + ([(LSE, lse)] if lse is not None else [])
        bases: Optional[list] = None  # the arguments' storages, found when a launched tensor is a view
        fixed = []  # launch-owned tensors (a scratch LSE): the same address at every call of the step

        def source(t):
            """``(argument, byte offset)`` of a launched tensor's address, ``(None, address)`` for a tensor
            of no argument's storage, None where it is more than one argument or more than one
            argument shares its storage."""
            nonlocal bases
            same = [i for i, x in args if t is x]
            if same:  # (one tensor passed as two arguments, out=q: the next call may pass two)
                return (same[0], 0) if len(same) == 1 else None
            if bases is None:
                bases = [x.untyped_storage().data_ptr() for _, x in args]
            base = t.untyped_storage().data_ptr()
            holders = [arg for arg, b in zip(args, bases) if b == base]
            if not holders:
                fixed.append(t)
                return None, t.data_ptr()
            if len(holders) > 1:
                return None
            i, x = holders[0]
            return i, t.data_ptr() - x.data_ptr()  # a view of one argument (K or V of a paged cache)

        sources = []
        for call in calls:
            tensor_sources = [source(t) for t in call.tensors]
            box_sources = [source(b.tensor) for b in call.boxes]
            if None in tensor_sources or None in box_sources:
                return None
            sources.append((tensor_sources, box_sources))
        self = RunReplay()
        self.step, self.options, self.sources, self.fixed = step, options, sources, fixed
        self.keep = keep
        # the addresses a run computes: the distinct arguments' (``args_used``: inputs' positions, OUT,
        # LSE), then a 0 for launch-owned tensors (their sources hold the address); each
        # source as (that position, byte offset), every call's tensors then boxes in one list, and each
        # call's (start, boxes, end) in it
        used = list(dict.fromkeys(i for ts, bs in sources for i, _ in ts + bs if i is not None))
        position = {i: k for k, i in enumerate(used)}
        self.args_used = tuple(used)
        self.has_fixed = bool(fixed)
        self.flat_sources, self.spans = [], []
        for tensor_sources, box_sources in sources:
            start = len(self.flat_sources)
            for i, offset in tensor_sources + box_sources:
                self.flat_sources.append((len(used) if i is None else position[i], offset))
            self.spans.append((start, start + len(tensor_sources), len(self.flat_sources)))
        # every address was 16-byte aligned (the driver path takes no other): a run's are where its
        # arguments' addresses are too (a view's offset is a multiple of 16)
        if any(offset & 15 for _, offset in self.flat_sources):
            return None
        self.launched = _launched(calls)  # (the recorded call's tensors are not kept: a layer's activations)
        self.facts = tuple(facts(t) for t in inputs)
        self.alloc_out, self.out_zeroed, self.out_facts = out_arg is None, out_zeroed, facts(out)
        self.alloc_lse, self.lse_facts = lse_arg is None and lse is not None, facts(lse)
        self.return_lse = return_lse
        return self

    def run(self, step, inputs: tuple, options: tuple, out: Optional[torch.Tensor], lse: Optional[torch.Tensor],
            return_lse: bool) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Launches a call that matches the recorded one and returns its ``(out, lse)``; None (nothing
        launched) for any other call. ``options``: the call's scalar options (scales, see
        ``scalar_options``), matched by value: the launches' floats were computed from them."""
        if (step is not self.step or options != self.options or return_lse != self.return_lse
                or len(inputs) != len(self.facts)):
            return None
        for t, f in zip(inputs, self.facts):
            if (type(t), t.shape, t.stride(), t.dtype, t.device) != f:
                return None
        if out is None:
            if not self.alloc_out:
                return None
            _, shape, _, dtype, device = self.out_facts
            out = (torch.zeros if self.out_zeroed else torch.empty)(shape, dtype=dtype, device=device)
        elif self.alloc_out or (type(out), out.shape, out.stride(), out.dtype, out.device) != self.out_facts:
            return None
        if lse is None:
            if self.lse_facts is not None:
                if not self.alloc_lse:
                    return None
                _, shape, _, dtype, device = self.lse_facts
                lse = torch.empty(shape, dtype=dtype, device=device)
        elif self.alloc_lse or facts(lse) != self.lse_facts:
            return None
        args = inputs + (lse, out)  # (OUT = -1, LSE = -2)
        bases = [args[i].data_ptr() for i in self.args_used]
        # every address 16-byte aligned, as the recorded call's were (the kernels' specialisation, and the
        # TMA boxes' bases the full path's route checks)
        aligned = 0
        for p in bases:
            aligned |= p
        if aligned & 15 or _launch._current_index() != self.launched[0][0].device or not _launch._no_hooks():
            return None
        if self.has_fixed:
            bases.append(0)
        addresses = [bases[k] + offset for k, offset in self.flat_sources]
        for (launch, values, boxes, box_views), (start, boxes_at, end) in zip(self.launched, self.spans):
            launch.replay(addresses[start:boxes_at], values, boxes, addresses[boxes_at:end], box_views)
        return out, lse
