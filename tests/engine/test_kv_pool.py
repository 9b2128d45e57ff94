"""PageAllocator, ReqToTokenPool and the page arithmetic of engine.kv_pool."""

import pytest
import torch

from engine.kv_pool import (
    DUMMY_PAGE,
    PageAllocator,
    ReqToTokenPool,
    extend_slots,
    num_new_pages,
    num_slots_for_memory,
    pages_of_slots,
    slots_of_pages,
)


def test_allocator_accounting_and_reserved_page():
    allocator = PageAllocator(num_pages=5, page_size=4)
    assert allocator.num_slots == 20
    assert allocator.num_free_pages == 4  # page 0 is reserved
    assert allocator.can_allocate(4) and not allocator.can_allocate(5)
    pages = allocator.allocate(3)
    assert len(set(pages)) == 3 and DUMMY_PAGE not in pages
    assert allocator.num_free_pages == 1 and allocator.num_used_pages == 3
    with pytest.raises(MemoryError):
        allocator.allocate(2)
    assert allocator.num_free_pages == 1  # a refused allocate takes nothing
    allocator.free(pages[:2])
    assert allocator.num_free_pages == 3
    rest = allocator.allocate(3)
    assert sorted(rest + pages[2:]) == [1, 2, 3, 4]
    assert allocator.allocate(0) == []


def test_allocator_rejects_double_free_and_unknown_pages():
    allocator = PageAllocator(num_pages=4, page_size=1)
    pages = allocator.allocate(2)
    allocator.free([pages[0]])
    with pytest.raises(ValueError, match="twice"):
        allocator.free([pages[0]])
    with pytest.raises(ValueError, match="twice"):
        allocator.free([pages[1], pages[1]])
    for bad in (DUMMY_PAGE, 4, -1):
        with pytest.raises(ValueError, match='not an allocatable page'):
            allocator.free([bad])
    # A refused free returns nothing, not even its valid pages.
    assert allocator.num_free_pages == 2
    allocator.free([pages[1]])
    assert allocator.num_free_pages == 3


def test_free_slots_returns_whole_pages():
    allocator = PageAllocator(num_pages=4, page_size=4)
    pages = allocator.allocate(2)
    allocator.free_slots(slots_of_pages(pages, 4))
    assert allocator.num_free_pages == 3
    with pytest.raises(ValueError, match='not whole pages of 4'):
        pages_of_slots([4, 5, 6], 4)  # not a whole page
    with pytest.raises(ValueError, match='whole pages in page order'):
        pages_of_slots([5, 6, 7, 8], 4)  # not page-aligned


@pytest.mark.parametrize(
    ("page_size", "seq_len", "extend_len", "expected"),
    [
        (1, 0, 5, 5), (1, 7, 3, 3), (1, 7, 0, 0),
        (4, 0, 1, 1), (4, 0, 4, 1), (4, 0, 5, 2), (4, 6, 2, 0), (4, 6, 3, 1), (4, 8, 1, 1), (4, 6, 7, 2),
        (16, 0, 16, 1), (16, 15, 1, 0), (16, 15, 2, 1), (16, 16, 33, 3), (16, 3, 0, 0), (16, 17, 15, 0),
    ],
)
def test_num_new_pages(page_size, seq_len, extend_len, expected):
    assert num_new_pages(seq_len, extend_len, page_size) == expected


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_slots_fill_last_page_first(page_size):
    """Growing a request in random steps puts token i at offset i % page_size, pages never shared."""
    allocator = PageAllocator(num_pages=200, page_size=page_size)
    generator = torch.Generator().manual_seed(page_size)
    slots: list[int] = []
    num_pages_taken = 0
    while len(slots) < 150:
        extend_len = int(torch.randint(0, 20, (1,), generator=generator))
        new_pages = allocator.allocate(num_new_pages(len(slots), extend_len, page_size))
        num_pages_taken += len(new_pages)
        last_slot = slots[-1] if slots else -1
        slots += extend_slots(len(slots), extend_len, last_slot, new_pages, page_size)
    assert all(slot % page_size == i % page_size for i, slot in enumerate(slots))
    assert len(set(slots)) == len(slots)
    assert num_pages_taken == -(-len(slots) // page_size)
    assert allocator.num_free_pages == 199 - num_pages_taken


def test_extend_slots_example_and_checks():
    assert extend_slots(6, 7, 9, [5, 3], 4) == [10, 11, 20, 21, 22, 23, 12]
    with pytest.raises(ValueError, match="needed"):
        extend_slots(6, 7, 9, [5], 4)
    with pytest.raises(ValueError, match="offset"):
        extend_slots(6, 1, 10, [], 4)


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(max_reqs=2, max_context=8)
    row_a, row_b = pool.alloc(), pool.alloc()
    assert row_a != row_b and not pool.can_alloc()
    with pytest.raises(MemoryError):
        pool.alloc()
    pool.write(row_a, 0, [4, 5, 6])
    pool.write(row_a, 3, torch.tensor([9]))
    assert pool.read(row_a, 0, 4) == [4, 5, 6, 9]
    pool.write(row_a, 1, [7])  # an overwrite inside the row keeps the rest
    assert pool.read(row_a, 0, 4) == [4, 7, 6, 9]
    # The workers' copies follow the logged writes, in order, as plain ints.
    assert pool.take_writes() == [(row_a, 0, (4, 5, 6)), (row_a, 3, (9,)), (row_a, 1, (7,))] and pool.take_writes() == []
    with pytest.raises(ValueError, match='do not fit max_context'):
        pool.write(row_a, 6, [1, 2, 3])  # past max_context
    pool.write(row_b, 0, [3, 3])
    pool.free(row_b)
    with pytest.raises(ValueError, match='is not allocated'):
        pool.free(row_b)
    with pytest.raises(ValueError, match='is not allocated'):
        pool.write(row_b, 0, [1])  # a freed row takes no writes
    assert pool.can_alloc() and pool.alloc() == row_b
    assert pool.read(row_b, 0, 1) == []  # a row handed out again starts empty


def test_kv_slots_for_memory_hold_k_and_v_of_every_layer():
    """The auto-sized pool of the CUDA path: Llama 3 8B in bf16 keeps 2 x 32 layers x 8 heads x 128 x 2 bytes
    = 128 KiB per token, so 85% of 80 GiB holds 557056 tokens (and a partial slot rounds down)."""
    llama3_8b = dict(num_layers=32, num_kv_heads=8, head_dim=128)
    assert num_slots_for_memory(80 << 30, 0.85, **llama3_8b, dtype=torch.bfloat16) == 557056
    assert num_slots_for_memory(80 << 30, 0.85, **llama3_8b, dtype=torch.float32) == 557056 // 2
    assert num_slots_for_memory((128 << 10) * 3 - 1, 1.0, **llama3_8b, dtype=torch.bfloat16) == 2
