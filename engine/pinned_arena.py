"""Page-locked host memory taken once at startup, for the host cache's packed adapters.

A packed adapter's tensors live in pinned memory so that a slot load is one asynchronous copy
(engine/lora_pool.py). Pinning them as each adapter is packed asks the driver to page-lock fresh memory,
and on the H200 that held up the engine loop's GPU launches in another thread for as long as it took:
up to 110 ms for an 84 MB all-target Llama-3-8B adapter, 15 ms for a 14 MB q/v one
(benchmarks/pinned_alloc_stall.py, BENCHMARKS.md). A cold burst of new adapters then stalls decoding once per
adapter. With `--host-pinned-gb` the engine takes that memory once, before it serves, and packs adapters
into blocks of it; an adapter that does not fit is pinned the old way. By default (`auto_arena_bytes`)
the arena holds the host cache's adapters (those in slots and --max-host-adapters others) at the slots'
capacity, up to 4 GiB and an eighth of the memory the process may use (the host's, or its container's
limit): on the H200 it took the cold Zipf pass's slowest step gaps from 477 to 82 ms.

A block goes back when its PackedAdapter is collected, but a GPU copy from it may still be queued: the
slot pool notes the event after its latest copy (`HostReads`), and the block is reused only once that
event has passed. Blocks are handed out first fit, in whole granules, and neighbours merge when freed.
"""

from __future__ import annotations

import collections
import math
import threading
import weakref
from dataclasses import dataclass

import torch

GRANULE = 1 << 20  # block sizes round up to this: fewer, larger free runs
AUTO_MAX_BYTES = 4 << 30  # the default arena's ceiling


def block_size(nbytes: int, granule: int = GRANULE) -> int:
    """The block an arena lends for a request of `nbytes`: whole granules, one at least."""
    return max(1, -(-nbytes // granule)) * granule


def auto_arena_bytes(adapter_bytes: int, num_adapters: int, host_bytes: int, granule: int = GRANULE) -> int:
    """The default arena's size: room for `num_adapters` blocks (`block_size`) of `adapter_bytes` (a
    full-rank adapter's packed bytes, `adapter_cache.packed_bytes`; the host cache keeps the adapters in
    slots and --max-host-adapters others), at most AUTO_MAX_BYTES and an eighth of `host_bytes` (the
    memory this process may use; each engine process takes its own); 0: no arena."""
    return max(0, min(AUTO_MAX_BYTES, host_bytes // 8, block_size(adapter_bytes, granule) * num_adapters))



@dataclass
class HostReads:
    """The latest queued GPU copy out of a packed adapter's host memory (a CUDA event; None: none)."""

    event: object | None = None  # torch.cuda.Event, or anything with query()

    def done(self) -> bool:
        return self.event is None or self.event.query()


def _page_lock(t: torch.Tensor) -> None:
    """Page-lock exactly t's bytes (cudaHostRegister). `torch.empty(..., pin_memory=True)` would go
    through PyTorch's pinned allocator, which rounds a request up to a power of two: 5 GiB asked would
    lock 8. The memory then counts as pinned (`is_pinned()`), so copies from it run asynchronously.
    The call runs on a thread of its own: a refusal leaves CUDA's last error set on the calling thread,
    where PyTorch's next launch check would read it (the engine serves on without the arena)."""
    nbytes = t.numel() * t.element_size()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))))
    thread.start()
    thread.join()
    if result != [0]:
        raise RuntimeError(f"page-locking {nbytes} bytes of host memory failed (cudaError {result[0] if result else '?'})")


def _page_unlock(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class PinnedArena:
    """One pinned buffer of `nbytes` (rounded up to whole granules), lent out in blocks."""

    def __init__(self, nbytes: int, *, pin: bool = True, granule: int = GRANULE):
        if nbytes <= 0:
            raise ValueError(f"a pinned arena needs a positive size, got {nbytes} bytes")
        self.granule = granule
        self.capacity = -(-nbytes // granule) * granule
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8)
        if pin:
            _page_lock(self.buffer)
            # unlocked with the arena, so the pages can be locked again later in the process (another
            # engine's arena); views still held elsewhere keep the memory, no longer locked
            weakref.finalize(self, _page_unlock, self.buffer.data_ptr())
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), by offset, never adjacent
        # blocks given back, maybe still read by a queued copy: appended from any thread (a collector's
        # finalizer may run inside take itself), drained under the lock by take
        self._returned: collections.deque[tuple[int, int, HostReads]] = collections.deque()
        self._waiting: list[tuple[int, int, HostReads]] = []
        self._lock = threading.Lock()
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer as each dtype a view asked for
        self.num_blocks = 0  # lent and not yet back
        self.num_lent = 0  # blocks lent in all
        self.num_misses = 0  # requests no free run could hold

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """(offset, size) of a block of at least nbytes, or None when no free run holds it."""
        size = block_size(nbytes, self.granule)
        with self._lock:
            self._reclaim()
            for i, (offset, run) in enumerate(self._free):
                if run >= size:
                    if run == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, run - size)
                    self.num_blocks += 1
                    self.num_lent += 1
                    return offset, size
            self.num_misses += 1
            return None

    def give_back(self, offset: int, size: int, reads: HostReads) -> None:
        """Return a block; it is lent again once `reads` is done. Safe from any thread, any time."""
        self._returned.append((offset, size, reads))

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over bytes [offset, offset + nbytes) of the buffer: one torch call (packing threads
        make these beside the engine loop, and each torch call lets go of the GIL and takes it back), on
        the buffer seen once as `dtype`, where the offset is a whole number of elements."""
        itemsize = dtype.itemsize
        if offset % itemsize or self.capacity % itemsize or nbytes != math.prod(shape) * itemsize:
            return self.buffer[offset : offset + nbytes].view(dtype).view(shape)
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.buffer.view(dtype)
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        return typed.as_strided(shape, tuple(reversed(strides)), offset // itemsize)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(run for _, run in self._free)

    def _reclaim(self) -> None:
        while self._returned:
            self._waiting.append(self._returned.popleft())
        still = []
        for offset, size, reads in self._waiting:
            if reads.done():
                self._free_run(offset, size)
                self.num_blocks -= 1
            else:
                still.append((offset, size, reads))
        self._waiting = still

    def _free_run(self, offset: int, size: int) -> None:
        runs = self._free
        i = 0
        while i < len(runs) and runs[i][0] < offset:
            i += 1
        runs.insert(i, (offset, size))
        if i + 1 < len(runs) and offset + size == runs[i + 1][0]:  # merge with the next run
            runs[i] = (offset, size + runs.pop(i + 1)[1])
        if i > 0 and runs[i - 1][0] + runs[i - 1][1] == offset:  # and with the previous one
            prev_offset, prev_size = runs[i - 1]
            runs[i - 1] = (prev_offset, prev_size + runs.pop(i)[1])
