"""Starvation drain: when an adapter has waited too long for a GPU slot, stop admitting new requests of
one running adapter so that its slot frees as its running requests finish.

The scheduler calls `update` once per step before admission and skips (leaves waiting) every request
for which `blocks` is true. Nothing is cancelled or preempted: the drained adapter's running requests
finish normally and its waiting requests run again once the starving adapter holds a slot.

Choices:
- At most one drain at a time. One freed slot is enough for the starving adapter (the one whose oldest
  waiting request is oldest); the next starving adapter gets its own drain once this one ends. Draining
  several adapters at once would idle several slots for one waiter.
- The victim is the running adapter with the fewest remaining tokens (sum over its running requests of
  max_new_tokens - len(output_ids)), so the slot frees soonest. Pinned adapters are never drained:
  finishing their requests does not free their slot.
- The drain ends once the starving adapter holds a slot, once it has no waiting request left (cancelled,
  deadline), or once the drained adapter lost its slot to another adapter (the next `update` then
  looks again).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.lora_manager import LoraManager
    from engine.request import Request


class StarvationDrain:
    def __init__(self, wait_s: float, clock: Callable[[], float] = time.monotonic):
        if wait_s <= 0:
            raise ValueError(f"drain wait must be > 0 seconds, not {wait_s}")
        self.wait_s = wait_s
        self.clock = clock  # the clock of Request.arrival
        self.draining: str | None = None  # digest whose new requests wait
        self.starving: str | None = None  # digest the drain frees a slot for
        self.num_drains = 0

    def blocks(self, req: Request) -> bool:
        """Whether admission must leave req waiting: its adapter is being drained."""
        return self.draining is not None and req.namespace == self.draining

    def update(self, waiting: Sequence[Request], running: Sequence[Request], lora: LoraManager) -> None:
        if self.draining is not None and self._is_over(waiting, lora):
            self.draining = self.starving = None
        if self.draining is None:
            self._start(waiting, running, lora)

    def _is_over(self, waiting: Sequence[Request], lora: LoraManager) -> bool:
        return (
            lora.slots.slot_of(self.starving) is not None
            or lora.slots.slot_of(self.draining) is None
            or not any(r.namespace == self.starving for r in waiting)
        )

    def _start(self, waiting: Sequence[Request], running: Sequence[Request], lora: LoraManager) -> None:
        starving = self._starving_adapter(waiting, lora)
        if starving is None:
            return
        victim = fewest_remaining_tokens(running, lora)
        if victim is not None:
            self.draining, self.starving = victim, starving
            self.num_drains += 1

    def _starving_adapter(self, waiting: Sequence[Request], lora: LoraManager) -> str | None:
        """The adapter of the oldest waiting request older than wait_s that no slot can take now."""
        now = self.clock()
        starved = [r for r in waiting if r.namespace and now - r.arrival > self.wait_s]
        for req in sorted(starved, key=lambda r: r.arrival):
            if not lora.can_acquire(req.namespace):
                return req.namespace
        return None


def fewest_remaining_tokens(running: Sequence[Request], lora: LoraManager) -> str | None:
    """The unpinned running adapter whose running requests have the fewest tokens left to generate."""
    remaining: dict[str, int] = {}
    for req in running:
        if req.namespace and not _is_pinned(req.namespace, lora):
            left = max(req.params.max_new_tokens - len(req.output_ids), 0)
            remaining[req.namespace] = remaining.get(req.namespace, 0) + left
    return min(remaining, key=remaining.__getitem__) if remaining else None


def _is_pinned(digest: str, lora: LoraManager) -> bool:
    index = lora.slots.slot_of(digest)
    return index is not None and lora.slots.slots[index].is_pinned
