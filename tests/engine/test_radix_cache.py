"""RadixCache: matching, splits, page alignment, namespaces, locks, LRU eviction, and a randomized model."""

import random

import pytest
import torch

from engine.kv_pool import PageAllocator, num_new_pages, pages_of_slots, slots_of_pages
from engine.radix_cache import RadixCache


class Clock:
    """An injectable clock: tests set `now` to order accesses explicitly."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def make_cache(page_size: int = 1, num_pages: int = 64, clock=None) -> RadixCache:
    return RadixCache(page_size, PageAllocator(num_pages, page_size), clock=clock)


def take_slots(cache: RadixCache, num_tokens: int) -> list[int]:
    """Fresh slots for num_tokens tokens (whole pages; the tail of the last page unused)."""
    pages = cache.allocator.allocate(num_new_pages(0, num_tokens, cache.page_size))
    return slots_of_pages(pages, cache.page_size)[:num_tokens]


def cache_tokens(cache: RadixCache, namespace: str, tokens: list[int]) -> list[int]:
    """Inserts tokens as a finished request with no prior match would; frees what the caller owns."""
    slots = take_slots(cache, len(tokens))
    num_cached = cache.insert(namespace, tokens, slots)
    aligned_len = len(tokens) // cache.page_size * cache.page_size
    free_whole_pages(cache, slots[:num_cached])
    free_whole_pages(cache, slots[aligned_len:])
    return slots


def free_whole_pages(cache: RadixCache, slots: list[int]) -> None:
    """Frees the pages under slots (a partial tail page as a whole: the request owns all of it)."""
    cache.allocator.free(sorted({slot // cache.page_size for slot in slots}))


def test_insert_and_match_with_splits():
    cache = make_cache()
    slots_a = cache_tokens(cache, "", [1, 2, 3, 4])
    slots_b = take_slots(cache, 4)
    assert cache.insert("", [1, 2, 7, 8], slots_b) == 2  # shares [1, 2]: the node splits
    cache.allocator.free(slots_b[:2])  # the caller's duplicates of the cached [1, 2]
    cache.check_invariants()
    assert [node.key for node in cache.root.children.values()] == [(1, 2)]
    head = next(iter(cache.root.children.values()))
    assert sorted(child.key for child in head.children.values()) == [(3, 4), (7, 8)]

    assert cache.match_prefix("", [1, 2, 9]).slots.tolist() == slots_a[:2]
    assert cache.match_prefix("", [1, 2, 7, 8, 9]).slots.tolist() == slots_a[:2] + slots_b[2:]
    assert cache.match_prefix("", [5]).cached_len == 0
    assert cache.match_prefix("", [5]).node is cache.root

    match = cache.match_prefix("", [1, 2, 3])  # ends inside the node (3, 4): it splits
    assert match.slots.tolist() == slots_a[:3]
    assert match.node.key == (3,) and [c.key for c in match.node.children.values()] == [(4,)]
    assert cache.total_size() == 6
    cache.check_invariants()


def test_page_alignment_shares_whole_pages_only():
    cache = make_cache(page_size=4)
    tokens_a = [1, 2, 3, 4, 5, 6, 7, 8]
    slots_a = cache_tokens(cache, "", tokens_a)
    tokens_b = [1, 2, 3, 4, 5, 6, 7, 9]  # 7 tokens in common with tokens_a
    assert cache.match_prefix("", tokens_b).slots.tolist() == slots_a[:4]
    slots_b = take_slots(cache, 8)
    assert cache.insert("", tokens_b, slots_b) == 4
    cache.allocator.free(pages_of_slots(slots_b[:4], 4))
    assert cache.match_prefix("", tokens_b).slots.tolist() == slots_a[:4] + slots_b[4:]
    assert cache.match_prefix("", tokens_a[:7]).cached_len == 4  # a partial page never matches
    # A partial last page is not cached at all.
    assert cache.insert("", [9, 9, 9], take_slots(cache, 3)) == 0
    assert cache.total_size() == 12
    cache.check_invariants()


def test_namespaces_never_share():
    cache = make_cache(page_size=2)
    tokens = [5, 6, 7, 8]
    slots = {ns: take_slots(cache, 4) for ns in ("adapter-x", "adapter-y", "")}
    for ns in ("adapter-x", "adapter-y", ""):
        assert cache.match_prefix(ns, tokens).cached_len == 0
        # Nothing of another namespace may count as cached: a namespace-blind key would return 4 here.
        assert cache.insert(ns, tokens, slots[ns]) == 0
    for ns in ("adapter-x", "adapter-y", ""):
        assert cache.match_prefix(ns, tokens).slots.tolist() == slots[ns]
    assert cache.match_prefix("adapter-z", tokens).cached_len == 0
    assert cache.total_size() == 12
    cache.check_invariants()
    cache.reset()
    assert cache.allocator.num_free_pages == cache.allocator.num_usable_pages


def test_locked_paths_are_never_evicted():
    cache = make_cache()
    cache_tokens(cache, "", [1, 2, 3])
    slots_other = cache_tokens(cache, "", [1, 2, 9])
    node = cache.match_prefix("", [1, 2, 3]).node
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 1
    assert cache.evict(100) == 1  # only the unlocked leaf (9,)
    assert cache.match_prefix("", [1, 2, 9]).cached_len == 2
    assert slots_other[2] not in cache.match_prefix("", [1, 2, 3]).slots.tolist()
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 0  # still locked once
    cache.dec_lock_ref(node)
    with pytest.raises(ValueError, match='unlocked node'):
        cache.dec_lock_ref(node)
    assert cache.evictable_size() == 3 and cache.protected_size() == 0
    assert cache.evict(100) == 3
    assert cache.total_size() == 0
    assert cache.allocator.num_free_pages == cache.allocator.num_usable_pages
    cache.check_invariants()


def test_eviction_is_lru_and_cascades_to_parents():
    clock = Clock()
    cache = make_cache(clock=clock)
    for clock.now, tokens in enumerate([[1, 2, 3], [1, 2, 4], [7, 8], [1, 5]]):
        cache_tokens(cache, "", tokens)
    # Tree: (1,) -> {(2,) -> {(3,), (4,)}, (5,)}, (7, 8). Touch [1, 2, 3] last.
    clock.now = 10
    cache.match_prefix("", [1, 2, 3])

    assert cache.evict(1) == 1  # oldest leaf: (4,), accessed at 1
    assert cache.match_prefix("", [1, 2, 4]).cached_len == 2  # refreshes (1,) and (2,) to 10
    assert cache.evict(2) == 2  # (7, 8), accessed at 2, before (5,) at 3
    assert cache.match_prefix("", [7, 8]).cached_len == 0
    clock.now = 11
    assert cache.match_prefix("", [1, 5]).cached_len == 2
    assert cache.evict(1) == 1  # (3,) at 10 before (5,) at 11
    clock.now = 12
    assert cache.match_prefix("", [1, 2, 3]).cached_len == 2  # (2,) is a leaf now, at 12
    assert cache.evict(1) == 1  # (5,) at 11
    assert cache.evict(2) == 2  # (2,), then its parent (1,) once it is a leaf
    assert cache.total_size() == 0
    assert cache.allocator.num_free_pages == cache.allocator.num_usable_pages
    cache.check_invariants()


def test_split_keeps_locks_of_the_locked_node():
    cache = make_cache(page_size=2)
    cache_tokens(cache, "x", [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix("x", [1, 2, 3, 4, 5, 6]).node
    cache.inc_lock_ref(node)
    cache.match_prefix("x", [1, 2, 9, 9])  # splits the locked node
    cache.check_invariants()
    assert cache.protected_size() == 6
    assert cache.evict(100) == 0
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 6
    cache.check_invariants()


def test_insert_of_a_cached_prefix_counts_as_a_use():
    """A request that inserts tokens the tree holds already (it matched them, or computed them alongside
    another request) makes them recently used: eviction takes the older prefix first."""
    clock = Clock()
    cache = make_cache(clock=clock)
    for clock.now, tokens in enumerate([[1, 2], [7, 8]]):
        cache_tokens(cache, "", tokens)
    clock.now = 5
    slots = take_slots(cache, 2)
    assert cache.insert("", [1, 2], slots) == 2  # all cached already: (1, 2) is now used at 5
    cache.allocator.free(slots)
    assert cache.evict(2) == 2
    assert cache.match_prefix("", [7, 8]).cached_len == 0  # (7, 8), used at 1, went first
    assert cache.match_prefix("", [1, 2]).cached_len == 2
    cache.check_invariants()


def test_token_ids_as_a_tensor_key_the_same_nodes_as_a_list():
    cache = make_cache(page_size=2)
    slots = take_slots(cache, 5)
    assert cache.insert("", torch.tensor([1, 2, 3, 4, 5]), slots) == 0  # the partial page stays the caller's
    free_whole_pages(cache, slots[4:])
    assert cache.match_prefix("", torch.tensor([1, 2, 3, 9])).slots.tolist() == slots[:2]
    assert cache.match_prefix("", [1, 2, 3, 4]).slots.tolist() == slots[:4]
    assert cache.insert("", torch.tensor([1, 2, 3, 4]), slots[:4]) == 4
    assert cache.total_size() == 4
    cache.check_invariants()


def test_allocator_of_another_page_size_is_refused():
    with pytest.raises(ValueError, match=r"^page_size 2 != allocator page_size 4$"):
        RadixCache(2, PageAllocator(8, 4))


def _corrupt_sizes(cache: RadixCache, node) -> None:
    cache._evictable_size += 2


def _corrupt_protected(cache: RadixCache, node) -> None:
    cache._protected_size += 2


def _corrupt_child_key(cache: RadixCache, node) -> None:
    node.key = (9, 9)


def _corrupt_misaligned(cache: RadixCache, node) -> None:
    node.key, node.value = node.key[:1], node.value[:1]


def _corrupt_length(cache: RadixCache, node) -> None:
    node.key = (*node.key, 3, 4)  # two more tokens than slots


def _corrupt_lock_order(cache: RadixCache, node) -> None:
    child = next(iter(node.children.values()))
    child.lock_ref = 1  # locked, under an unlocked parent
    cache._evictable_size -= len(child.key)
    cache._protected_size += len(child.key)


def _corrupt_negative_lock(cache: RadixCache, node) -> None:
    node.lock_ref = -1


def _corrupt_shared_slot(cache: RadixCache, node) -> None:
    child = next(iter(node.children.values()))
    child.value = node.value[: len(child.value)].clone()


def _corrupt_page_order(cache: RadixCache, node) -> None:
    node.value = node.value.flip(0)  # the page's slots, last first


def _corrupt_namespace(cache: RadixCache, node) -> None:
    child = next(iter(node.children.values()))
    del node.children[("x", child.key[:2])]
    child.namespace = "y"
    node.children[("y", child.key[:2])] = child


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_sizes, "evictable_size out of sync"),
        (_corrupt_protected, "protected_size out of sync"),
        (_corrupt_child_key, "child keyed inconsistently"),
        (_corrupt_misaligned, "node is not whole pages"),
        (_corrupt_length, "key/value length mismatch"),
        (_corrupt_lock_order, "locked node under a less locked parent"),
        (_corrupt_negative_lock, "negative lock_ref"),
        (_corrupt_shared_slot, "slot held by two nodes"),
        (_corrupt_namespace, "namespace differs from parent's"),
        (_corrupt_page_order, "whole pages in page order"),
    ],
)
def test_check_invariants_catches_each_inconsistency(corrupt, message):
    """Every test that ends in check_invariants relies on it failing for a broken tree."""
    cache = make_cache(page_size=2)
    cache_tokens(cache, "x", [1, 2, 3, 4])
    cache_tokens(cache, "x", [1, 2, 5, 6])  # (1, 2) -> {(3, 4), (5, 6)}
    cache.check_invariants()
    node = cache.match_prefix("x", [1, 2]).node
    corrupt(cache, node)
    with pytest.raises((AssertionError, ValueError), match=message):  # ValueError: from pages_of_slots
        cache.check_invariants()


def test_insert_rejects_misaligned_slots():
    cache = make_cache(page_size=4)
    with pytest.raises(ValueError, match='whole pages in page order'):
        cache.insert("", [1, 2, 3, 4], [4, 5, 6, 8])
    with pytest.raises(ValueError, match='3 tokens but 2 slots'):
        cache.insert("", [1, 2, 3], [4, 5])


def test_reset_refuses_locked_tree():
    cache = make_cache()
    cache_tokens(cache, "", [1, 2])
    cache.inc_lock_ref(cache.match_prefix("", [1, 2]).node)
    with pytest.raises(RuntimeError, match='locked tokens'):
        cache.reset()


# -- randomized test against a reference model ---------------------------------------------------


def tree_pages(cache: RadixCache) -> dict[tuple[str, tuple[int, ...]], tuple[int, ...]]:
    """(namespace, tokens of a whole-page prefix) -> the slots of its last page, for every cached page."""
    page_size, pages = cache.page_size, {}
    stack = [(child, ()) for child in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        for start in range(0, len(node.key), page_size):
            full = prefix + node.key[: start + page_size]
            pages[node.namespace, full] = tuple(node.value[start : start + page_size].tolist())
        stack.extend((child, prefix + node.key) for child in node.children.values())
    return pages


def expected_match(reference, namespace, tokens, page_size) -> list[int]:
    slots: list[int] = []
    for end in range(page_size, len(tokens) + 1, page_size):
        page = reference.get((namespace, tuple(tokens[:end])))
        if page is None:
            break
        slots += page
    return slots


class Simulation:
    """Requests that follow the ownership rules of engine.radix_cache, checked against a plain dict."""

    def __init__(self, page_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.page_size = page_size
        self.cache = RadixCache(page_size, PageAllocator(48, page_size))
        self.reference: dict = {}  # what tree_pages(cache) must equal
        self.running: list[dict] = []
        self.templates = [[self.rng.randrange(3) for _ in range(24)] for _ in range(3)]

    def random_tokens(self) -> list[int]:
        prefix = self.rng.choice(self.templates)[: self.rng.randrange(25)]
        return prefix + [self.rng.randrange(3) for _ in range(self.rng.randrange(6))]

    def start(self) -> None:
        namespace, tokens = self.rng.choice(["", "x", "y"]), self.random_tokens()
        match = self.cache.match_prefix(namespace, tokens)
        assert match.slots.tolist() == expected_match(self.reference, namespace, tokens, self.page_size)
        self.cache.inc_lock_ref(match.node)
        num_pages = num_new_pages(match.cached_len, len(tokens) - match.cached_len, self.page_size)
        if not self.cache.allocator.can_allocate(num_pages):
            self.evict(num_pages * self.page_size)
        if not self.cache.allocator.can_allocate(num_pages):
            self.cache.dec_lock_ref(match.node)
            return
        own_pages = self.cache.allocator.allocate(num_pages)
        own_slots = slots_of_pages(own_pages, self.page_size)[: len(tokens) - match.cached_len]
        self.running.append(dict(namespace=namespace, tokens=tokens, node=match.node,
                                 cached_len=match.cached_len, slots=match.slots.tolist() + own_slots,
                                 own_pages=own_pages))

    def finish(self) -> None:
        req = self.running.pop(self.rng.randrange(len(self.running)))
        namespace, tokens, slots, cached_len = req["namespace"], req["tokens"], req["slots"], req["cached_len"]
        num_expected = len(expected_match(self.reference, namespace, tokens, self.page_size))
        num_cached = self.cache.insert(namespace, tokens, slots)
        assert num_cached == num_expected >= cached_len
        aligned_len = len(tokens) // self.page_size * self.page_size
        free_whole_pages(self.cache, slots[cached_len:num_cached])
        free_whole_pages(self.cache, slots[aligned_len:])
        for end in range(num_cached + self.page_size, aligned_len + 1, self.page_size):
            self.reference[namespace, tuple(tokens[:end])] = tuple(slots[end - self.page_size : end])
        self.cache.dec_lock_ref(req["node"])

    def evict(self, num_tokens: int) -> None:
        num_freed = self.cache.evict(num_tokens)
        after = tree_pages(self.cache)
        assert after.items() <= self.reference.items()
        assert num_freed == (len(self.reference) - len(after)) * self.page_size
        assert num_freed >= min(num_tokens, self.cache.evictable_size() + num_freed)
        for req in self.running:  # locked prefixes survive
            assert len(expected_match(after, req["namespace"], req["tokens"], self.page_size)) >= req["cached_len"]
        self.reference = after

    def check(self) -> None:
        self.cache.check_invariants()
        tree = tree_pages(self.cache)
        assert tree == self.reference
        tree_page_ids = {slot // self.page_size for page in tree.values() for slot in page}
        own_page_ids = [page for req in self.running for page in req["own_pages"]]
        assert len(tree_page_ids) == len(tree) and tree_page_ids.isdisjoint(own_page_ids)
        assert len(set(own_page_ids)) == len(own_page_ids)
        allocator = self.cache.allocator
        assert len(tree) + len(own_page_ids) + allocator.num_free_pages == allocator.num_usable_pages
        assert self.cache.total_size() == len(tree) * self.page_size

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.4 and len(self.running) < 6:
            self.start()
        elif op < 0.75 and self.running:
            self.finish()
        elif op < 0.85:
            self.evict(self.rng.randrange(1, 4 * self.page_size))
        else:
            namespace, tokens = self.rng.choice(["", "x", "y"]), self.random_tokens()
            expected = expected_match(self.reference, namespace, tokens, self.page_size)
            assert self.cache.match_prefix(namespace, tokens).slots.tolist() == expected


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_randomized_against_reference(page_size, seed):
    sim = Simulation(page_size, seed)
    for _ in range(400):
        sim.step()
        sim.check()
    while sim.running:
        sim.finish()
    sim.check()
    assert sim.cache.protected_size() == 0
    sim.cache.reset()  # every cached page returned once: a leak or a double free fails here
    allocator = sim.cache.allocator
    assert allocator.num_free_pages == allocator.num_usable_pages
    assert sorted(allocator.allocate(allocator.num_usable_pages)) == list(range(1, allocator.num_pages))
