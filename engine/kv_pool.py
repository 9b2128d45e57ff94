"""KV memory owners: the page allocator, the request-to-token table and the page arithmetic.

The KV tensors live elsewhere (one pool of `num_slots` token slots per layer); this module only decides
which slot ids are in use. Vocabulary:

    slot  one token's KV position in the pool, an int in [0, num_slots)
    page  `page_size` consecutive slots; slot = page * page_size + offset, offset in [0, page_size)

A request owns whole pages, and token i of a request sits at offset `i % page_size` of its page: a
request fills its last page before it takes a new one, and a prefix shared through the radix cache is
always a whole number of pages. Example, page_size = 4, a request of 10 tokens on pages [7, 2, 9]:

    tokens [0, 4)   -> page 7, slots [28, 32)
    tokens [4, 8)   -> page 2, slots [8, 12)
    tokens [8, 10)  -> page 9, slots [36, 38)   (slots 38, 39 free but owned by the request)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DUMMY_PAGE = 0
"""Page 0 is never handed out: its slots (slot 0 in particular) take the KV writes of padded tokens
(CUDA-graph padding, dummy requests), so a padded step can never corrupt a live request's KV."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PageAllocator:
    """Owns the pages of the KV pool; the scheduler and the radix cache take and return pages here.

    Invariants: every page in [1, num_pages) is either free (in `_free_pages`) or held by exactly one
    owner (a running request or the radix cache); page 0 is reserved (`DUMMY_PAGE`) and never free.
    `free` of a page that is free already, or out of range, raises before changing anything.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need num_pages >= 2 (page 0 is reserved) and page_size >= 1, "
                             f"got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Popped from the end: low page ids go out first, which keeps tests readable.
        self._free_pages: list[int] = list(range(num_pages - 1, DUMMY_PAGE, -1))
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free_pages)

    def allocate(self, num_pages: int) -> list[int]:
        """Takes `num_pages` free pages; raises MemoryError (taking nothing) if there are not enough."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if not self.can_allocate(num_pages):
            raise MemoryError(f"asked for {num_pages} KV pages, {self.num_free_pages} free")
        if num_pages == 0:
            return []
        pages = self._free_pages[-num_pages:][::-1]
        del self._free_pages[-num_pages:]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Returns pages; raises ValueError (returning nothing) on an unknown, reserved or free page."""
        pages = [int(p) for p in pages]
        seen: set[int] = set()
        for page in pages:
            if not DUMMY_PAGE < page < self.num_pages:
                raise ValueError(f"page {page} is not an allocatable page of this pool")
            if self._is_free[page] or page in seen:
                raise ValueError(f"page {page} freed twice")
            seen.add(page)
        for page in pages:
            self._is_free[page] = True
        self._free_pages.extend(reversed(pages))

    def free_slots(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Frees the pages of `slots`, a whole-page run as returned by `slots_of_pages`."""
        self.free(pages_of_slots(slots, self.page_size))


class ReqToTokenPool:
    """Owns the rows of the request-to-token table: `table[row, i]` is the KV slot of token i.

    A row belongs to one running request between `alloc` and `free`; its content past the request's
    length is stale and must not be read. The table does not own the slots it names: the request (or
    the radix cache) does. Every write is logged for the next step plan (`take_writes`): each model
    worker keeps the [max_reqs, max_context] table on its device. The front's own copy is a Python list
    per row, only as long as the row's written tokens (a host tensor cost a conversion per request per
    step, the largest part of planning a decode step).
    """

    def __init__(self, max_reqs: int, max_context: int) -> None:
        self.max_reqs = max_reqs
        self.max_context = max_context
        self._rows: list[list[int]] = [[] for _ in range(max_reqs)]
        self._writes: list[tuple[int, int, tuple[int, ...]]] = []
        self._free_rows: list[int] = list(range(max_reqs - 1, -1, -1))
        self._is_free = [True] * max_reqs

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def can_alloc(self) -> bool:
        return bool(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise MemoryError("no free request row")
        row = self._free_rows.pop()
        self._is_free[row] = False
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_reqs or self._is_free[row]:
            raise ValueError(f"request row {row} is not allocated")
        self._is_free[row] = True
        self._rows[row] = []
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: Sequence[int] | torch.Tensor) -> None:
        """table[row, start : start + len(slots)] = slots."""
        if self._is_free[row]:
            raise ValueError(f"request row {row} is not allocated")
        end = start + len(slots)
        if not 0 <= start <= end <= self.max_context:
            raise ValueError(f"tokens [{start}, {end}) do not fit max_context {self.max_context}")
        values = tuple(slots.tolist() if isinstance(slots, torch.Tensor) else map(int, slots))
        cells = self._rows[row]
        if len(cells) < start:
            cells.extend([0] * (start - len(cells)))  # never read: a request writes its row from 0 up
        cells[start:end] = values
        self._writes.append((row, start, values))

    def take_writes(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(row, start, slots) of every write since the last call, in order."""
        writes, self._writes = self._writes, []
        return writes

    def read(self, row: int, start: int, end: int) -> list[int]:
        return self._rows[row][start:end]


def num_slots_for_memory(free_bytes: int, fraction: float, num_layers: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype) -> int:
    """Token slots that `fraction` of `free_bytes` holds: each slot keeps K and V of every layer."""
    bytes_per_slot = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
    return int(free_bytes * fraction) // bytes_per_slot


def num_pages_for(seq_len: int, page_size: int) -> int:
    """Pages a request of `seq_len` tokens owns."""
    return _ceil_div(seq_len, page_size)


def num_new_pages(seq_len: int, extend_len: int, page_size: int) -> int:
    """Pages to allocate to grow a request from `seq_len` to `seq_len + extend_len` tokens.

    The free tail of the last page is used first: page_size 4, seq_len 6, extend_len 3 -> 1 page
    (tokens 6, 7 fill page 1; token 8 opens page 2).
    """
    return num_pages_for(seq_len + extend_len, page_size) - num_pages_for(seq_len, page_size)


def extend_slots(seq_len: int, extend_len: int, last_slot: int, new_pages: Sequence[int],
                 page_size: int) -> list[int]:
    """Slots of tokens [seq_len, seq_len + extend_len) of a request.

    last_slot: the slot of token seq_len - 1 (ignored when seq_len is a multiple of page_size, where the
    last page is full); new_pages: `num_new_pages(seq_len, extend_len, page_size)` fresh pages.

        page_size 4, seq_len 6, extend_len 7, last_slot 9 (page 2), new_pages [5, 3]:
        tokens [6, 8)   -> slots 10, 11        (tail of page 2)
        tokens [8, 12)  -> slots 20..23        (page 5)
        tokens [12, 13) -> slot 12             (page 3)
    """
    if len(new_pages) != num_new_pages(seq_len, extend_len, page_size):
        raise ValueError(f"{len(new_pages)} new pages given, "
                         f"{num_new_pages(seq_len, extend_len, page_size)} needed")
    num_tail = min((-seq_len) % page_size, extend_len)
    if num_tail and last_slot % page_size != (seq_len - 1) % page_size:
        raise ValueError(f"last_slot {last_slot} is not at offset {(seq_len - 1) % page_size} of its page")
    slots = list(range(last_slot + 1, last_slot + 1 + num_tail))
    slots += slots_of_pages(new_pages, page_size)[: extend_len - num_tail]
    return slots


def slots_of_pages(pages: Sequence[int], page_size: int) -> list[int]:
    """All slots of `pages`, in page order."""
    return [page * page_size + offset for page in pages for offset in range(page_size)]


def pages_of_slots(slots: Sequence[int] | torch.Tensor, page_size: int) -> list[int]:
    """The pages of a whole-page run of slots; raises if `slots` is not whole pages in page order."""
    slots = torch.as_tensor(slots, dtype=torch.int64)
    if len(slots) % page_size:
        raise ValueError(f"{len(slots)} slots are not whole pages of {page_size}")
    by_page = slots.view(-1, page_size)
    pages = by_page[:, 0] // page_size
    expected = pages[:, None] * page_size + torch.arange(page_size)
    if not torch.equal(by_page, expected):
        raise ValueError("slots are not whole pages in page order")
    return pages.tolist()
