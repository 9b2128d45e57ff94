"""Who calls the engine. With authentication on, a client's key is checked through the registry (the
only holder of keys) and the answer, valid or not, is remembered for at most `ttl_s`: a revoked key
stops working within that bound, and a flood of requests with one key costs one registry call per
bound. Concurrent first requests with one key share one call. Keys are remembered by their sha256,
never in clear.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Awaitable, Callable

from engine.coalesce import CoalescedCalls
from loramux.security import ANONYMOUS, Principal, Unauthenticated

MAX_REMEMBERED_KEYS = 10_000
UNAUTHENTICATED_MESSAGE = "a valid API key is required: send 'authorization: Bearer KEY'"

# key -> its holder, or None for a key the registry refuses (raises Unavailable when it cannot answer)
KeyCheck = Callable[[str], Awaitable[Principal | None]]


class KeyChecker:
    def __init__(self, check: KeyCheck, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._check = check
        self._answers: collections.OrderedDict[str, tuple[float, Principal | None]] = collections.OrderedDict()
        self._calls = CoalescedCalls(self._ask)
        self.num_checks = 0  # registry calls made

    async def caller(self, key: str) -> Principal:
        """The key's holder; Unauthenticated for a missing, unknown or revoked key."""
        if not key:
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        digest = hashlib.sha256(key.encode()).hexdigest()
        remembered = self._answers.get(digest)
        if remembered is not None and self.clock() < remembered[0]:
            holder = remembered[1]
        else:
            holder = await self._calls.get((digest, key))
        if holder is None:
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        return holder

    async def _ask(self, digest_and_key: tuple[str, str]) -> Principal | None:
        digest, key = digest_and_key
        asked_at = self.clock()
        self.num_checks += 1
        holder = await self._check(key)
        self._answers[digest] = (asked_at + self.ttl_s, holder)  # the bound counts from the question
        self._answers.move_to_end(digest)
        while len(self._answers) > MAX_REMEMBERED_KEYS:
            self._answers.popitem(last=False)
        return holder


class OpenDoor:
    """Authentication off: every caller may do everything (the service listens on loopback only,
    unless started with --allow-unauthenticated)."""

    async def caller(self, key: str) -> Principal:
        return ANONYMOUS
