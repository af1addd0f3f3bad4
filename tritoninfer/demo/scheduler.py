"""Requests and the continuous-batching scheduler.

Each step is either a prefill of newly admitted requests or a decode of every running request.
Admission (first come, first served) needs a free batch slot, room in the step's prefill token
budget, and enough free pages for the request's whole life (prompt + generated tokens), which are
reserved, not allocated: pages are allocated as the KV grows and all of a request's pages go back
to the allocator when it finishes, so no request is ever preempted.

A request finishes after ``max_new_tokens`` tokens or when it emits one of its ``stop_token_ids``
(kept in its output). The engine may launch a step before it has read the previous one's tokens
(``EngineConfig.overlap``): ``launched`` counts the tokens launched, ``output`` those read back, and
:meth:`Scheduler.retire` retires a request as soon as no more tokens are to be launched for it
(``exhausted``): at launch for the length limit, when the token is read for a stop token.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Deque, List, Optional, Tuple

import numpy as np

from .kv_cache import PageAllocator
from .sampler import SamplingParams

__all__ = ["Request", "Scheduler", "pages_for"]


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclasses.dataclass
class Request:
    rid: int
    prompt: List[int]
    max_new_tokens: int
    output: List[int] = dataclasses.field(default_factory=list)
    pages: List[int] = dataclasses.field(default_factory=list)
    kv_len: int = 0  # tokens whose K/V are in the cache
    reserved: int = 0  # pages reserved for the request's whole life
    sampling: Optional[SamplingParams] = None  # None: the engine's default (greedy without EngineConfig.sampling)
    stop_token_ids: Tuple[int, ...] = ()  # emitting one of these ends the request (the token is kept)
    stopped: bool = False  # a stop token was read back
    launched: int = 0  # tokens launched on the device (read back or not)
    slot: int = -1  # the engine's row of its device token table while running
    _page_cache: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)

    def page_array(self) -> np.ndarray:
        """``pages`` as int32 numpy, rebuilt only when a page was added (keeps per-step host work small)."""
        if self._page_cache is None or len(self._page_cache) != len(self.pages):
            self._page_cache = np.asarray(self.pages, dtype=np.int32)
        return self._page_cache

    @property
    def done(self) -> bool:
        """Finished: every token it will emit has been read back."""
        return self.stopped or len(self.output) >= self.max_new_tokens

    @property
    def exhausted(self) -> bool:
        """No more tokens are to be launched for it (some may still be on their way back)."""
        return self.stopped or max(self.launched, len(self.output)) >= self.max_new_tokens

    @property
    def max_kv_len(self) -> int:
        # the last generated token is never fed back, so its K/V is never written
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def last_token(self) -> int:
        return self.output[-1]

    def last_page_len(self, page_size: int) -> int:
        return (self.kv_len - 1) % page_size + 1 if self.kv_len else 0


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_batch: int, max_prefill_tokens: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: expected a positive int, got {max_batch}")
        self.allocator = allocator
        self.page_size = page_size
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: Deque[Request] = collections.deque()
        self.running: List[Request] = []
        self.finished: List[Request] = []
        self._reserved_unallocated = 0  # pages promised to running requests, not yet allocated

    def add(self, req: Request) -> None:
        need = pages_for(req.max_kv_len, self.page_size)
        if need > self.allocator.num_pages:
            raise ValueError(
                f"request {req.rid}: {req.max_kv_len} tokens need {need} pages, the cache has {self.allocator.num_pages}")
        req.reserved = need
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _can_admit(self, req: Request, batch: List[Request], tokens: int) -> bool:
        if len(self.running) + len(batch) >= self.max_batch:
            return False
        if batch and tokens + len(req.prompt) > self.max_prefill_tokens:
            return False
        return self.allocator.num_free - self._reserved_unallocated >= req.reserved

    def schedule(self) -> Optional[Tuple[str, List[Request]]]:
        """The next step: ``("prefill", new requests)``, ``("decode", running requests)`` or None.

        Prefill steps allocate the prompt's pages; decode steps allocate a page for each request
        whose next token starts one."""
        batch: List[Request] = []
        tokens = 0
        while self.waiting and self._can_admit(self.waiting[0], batch, tokens):
            req = self.waiting.popleft()
            self._reserved_unallocated += req.reserved
            self._grow(req, len(req.prompt))
            tokens += len(req.prompt)
            batch.append(req)
        if batch:
            self.running.extend(batch)
            return "prefill", batch
        if not self.running:
            if self.waiting:  # cannot happen: add() checks that every request fits an empty cache
                raise RuntimeError("scheduler: waiting requests but none can be admitted")
            return None
        for req in self.running:
            self._grow(req, req.kv_len + 1)
        return "decode", list(self.running)

    def _grow(self, req: Request, kv_len: int) -> None:
        need = pages_for(kv_len, self.page_size) - len(req.pages)
        if need > 0:
            req.pages.extend(self.allocator.alloc(need))
            self._reserved_unallocated -= need

    def retire(self) -> List[Request]:
        """Move exhausted requests out of the batch and free their pages (and unused reservation).

        With steps in flight this is safe: every kernel runs on one stream, so a later step that
        reuses a freed page is ordered after the steps that still write to it."""
        done = [r for r in self.running if r.exhausted]
        if done:
            self.running = [r for r in self.running if not r.exhausted]
            for req in done:
                self._reserved_unallocated -= req.reserved - len(req.pages)
                self.allocator.free(req.pages)
                req.pages = []
                self.finished.append(req)
        return done
