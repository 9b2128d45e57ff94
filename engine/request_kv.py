"""KV bookkeeping of requests: admission with a prefix-cache match, growth, and release.

Composes the three owners (page allocator, request-to-token table, radix cache) for one request at a
time; the scheduler decides who gets what. Ownership (see engine/radix_cache.py):
- kv_slots[:cached_len] belong to the tree, pinned by a lock on req.prefix_node;
- kv_slots[cached_len:] lie in req.owned_pages, which this request frees or hands to the tree.
"""

from __future__ import annotations

from engine.kv_pool import PageAllocator, ReqToTokenPool, extend_slots, num_new_pages, pages_of_slots
from engine.radix_cache import RadixCache
from engine.request import Request


class RequestKV:
    def __init__(self, allocator: PageAllocator, req_pool: ReqToTokenPool, radix: RadixCache):
        self.allocator = allocator
        self.req_pool = req_pool
        self.radix = radix
        self.page_size = allocator.page_size

    def can_admit(self) -> bool:
        return self.req_pool.can_alloc()

    def admit(self, req: Request) -> None:
        """Give req a table row and its longest cached prefix (always leaving one token to compute)."""
        match = self.radix.match_prefix(req.namespace, req.all_ids[:-1])
        self.radix.inc_lock_ref(match.node)
        req.prefix_node = match.node
        req.kv_slots = match.slots.tolist()
        req.cached_len = len(req.kv_slots)
        if req.first_cached_len < 0:
            req.first_cached_len = min(req.cached_len, len(req.prompt_ids))
        req.req_row = self.req_pool.alloc()
        if req.kv_slots:
            self.req_pool.write(req.req_row, 0, req.kv_slots)

    def grow(self, req: Request, extend_len: int) -> bool:
        """Reserve slots for req's next extend_len tokens, evicting cached prefixes if needed."""
        kv_len = req.kv_len
        if extend_len == 1 and kv_len % self.page_size:  # a decode token with room in its last page (most
            slot = req.kv_slots[-1] + 1  # steps of every running request): the page's next slot, nothing allocated
            self.req_pool.write(req.req_row, kv_len, (slot,))
            req.kv_slots.append(slot)
            return True
        num_pages = num_new_pages(kv_len, extend_len, self.page_size)
        if not self.allocator.can_allocate(num_pages):
            missing = num_pages - self.allocator.num_free_pages
            self.radix.evict(missing * self.page_size)
            if not self.allocator.can_allocate(num_pages):
                return False
        pages = self.allocator.allocate(num_pages)
        last_slot = req.kv_slots[-1] if req.kv_slots else -1
        slots = extend_slots(kv_len, extend_len, last_slot, pages, self.page_size)
        self.req_pool.write(req.req_row, kv_len, slots)
        req.owned_pages += pages
        req.kv_slots += slots
        return True

    def release(self, req: Request) -> None:
        """Hand req's computed whole pages to the prefix cache, free the rest, unlock, drop the row."""
        if req.req_row < 0:
            return
        tokens = req.all_ids[: req.kv_len]
        num_cached = self.radix.insert(req.namespace, tokens, req.kv_slots)
        aligned_len = req.kv_len - req.kv_len % self.page_size
        duplicates = pages_of_slots(req.kv_slots[req.cached_len : num_cached], self.page_size)
        to_free = set(duplicates)
        if aligned_len < req.kv_len:
            to_free.add(req.kv_slots[aligned_len] // self.page_size)
        self.allocator.free(sorted(to_free))
        self.radix.dec_lock_ref(req.prefix_node)
        self.req_pool.free(req.req_row)
        req.prefix_node, req.req_row, req.kv_slots, req.owned_pages, req.cached_len = None, -1, [], [], 0

    def truncate(self, req: Request, length: int) -> None:
        """Forget req's KV past `length` tokens (e.g. a step that failed never computed it): the
        pages wholly past it go back to the allocator; the page holding token length-1 stays."""
        if length >= req.kv_len:
            return
        if length < req.cached_len:
            raise ValueError(f"cannot truncate below the cached prefix ({req.cached_len} tokens)")
        first_dropped_page = -(-length // self.page_size)  # pages [0, this) hold tokens [0, length)
        dropped = sorted({slot // self.page_size for slot in req.kv_slots[first_dropped_page * self.page_size :]})
        self.allocator.free(dropped)
        req.owned_pages = [page for page in req.owned_pages if page not in set(dropped)]
        req.kv_slots = req.kv_slots[:length]
