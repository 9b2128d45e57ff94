"""The prefix cache: a radix tree over token ids, one subtree per namespace (adapter digest).

Every lookup is keyed by `(namespace, token_ids)`: namespace is the adapter's digest, "" for the base
model. The same tokens under two namespaces produce different KV, so they never share a node: every
children dict is keyed by `(namespace, first page of tokens)`, and the root's children therefore start
one disjoint subtree per namespace.

Only whole pages are cached: keys are cut to a multiple of `page_size` on insert and on match, every
node holds a whole number of pages, and splits happen on page boundaries.

Ownership of KV slots (who frees what):

- A node's slots belong to the tree; only `evict` and `reset` return them to the allocator.
- `match_prefix` hands out the tree's slots for reading; the caller pins them with `inc_lock_ref(node)`
  while a request uses them, and releases with `dec_lock_ref(node)`; locked nodes are never evicted.
- `insert(namespace, tokens, slots)` (slots: the request's slot of every token, len(slots) ==
  len(tokens)) returns `num_cached`, the page-aligned count of leading tokens that were in the tree
  already, and takes ownership of `slots[num_cached:aligned_len]` (aligned_len = len(tokens) cut to
  whole pages). The caller still owns, and must free or keep using:

      slots[0 : cached_len)            the tree's slots it got from match_prefix: never freed by the caller
      slots[cached_len : num_cached)   its own duplicates of tokens another request inserted meanwhile: free
      slots[num_cached : aligned_len)  now the tree's: never freed by the caller
      slots[aligned_len : len)         the last, partial page: free when the request ends

  (cached_len = the request's own match length, <= num_cached, both page-aligned, so each run is whole
  pages.) A request that keeps running after inserting (chunked prefill) calls `match_prefix` again to
  get the tree's slots and node for its prefix, locks the new node and unlocks the old one.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from engine.kv_pool import PageAllocator, pages_of_slots

ChildKey = tuple[str, tuple[int, ...]]


@dataclass(eq=False)
class TreeNode:
    """One segment of cached tokens. key: token ids; value: [len(key)] int64 KV slots of those tokens.

    Invariants (non-root): len(key) == len(value) > 0 and a multiple of page_size; value is whole pages;
    parent.children[child_key(namespace, key)] is self; lock_ref >= the sum of the children's lock_ref
    (a lock pins the whole path to the root).
    """

    namespace: str
    key: tuple[int, ...]
    value: torch.Tensor
    parent: TreeNode | None = field(repr=False)
    children: dict[ChildKey, TreeNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: float = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass
class MatchResult:
    """slots: [cached_len] int64 KV slots of the matched prefix; node: the deepest matched node (the
    root when nothing matched), the node to lock."""

    slots: torch.Tensor
    node: TreeNode

    @property
    def cached_len(self) -> int:
        return len(self.slots)


def child_key(namespace: str, key: Sequence[int], page_size: int) -> ChildKey:
    return namespace, tuple(key[:page_size])


class RadixCache:
    """Owns the prefix tree and, through it, the KV pages of cached prefixes.

    evictable_size() + protected_size() == total_size() == tokens held by the tree; protected tokens are
    those of nodes with lock_ref > 0. `clock` gives access times (default: a counter, so later accesses
    are always newer); eviction takes unlocked leaves with the smallest access time first.
    """

    def __init__(self, page_size: int, allocator: PageAllocator,
                 clock: Callable[[], float] | None = None) -> None:
        if allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self._clock = clock or itertools.count().__next__
        self.reset_tree()

    def reset_tree(self) -> None:
        """Forgets every node without freeing its pages (for a caller that resets the allocator too)."""
        self.root = TreeNode(namespace="", key=(), value=torch.empty(0, dtype=torch.int64), parent=None)
        self._evictable_size = 0
        self._protected_size = 0

    def reset(self) -> None:
        """Frees every cached page; raises if a request still pins part of the tree."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} locked tokens")
        for node in self._nodes():
            self.allocator.free(pages_of_slots(node.value, self.page_size))
        self.reset_tree()

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # -- lookup and insert ------------------------------------------------------------------------

    def match_prefix(self, namespace: str, token_ids: Sequence[int]) -> MatchResult:
        """The longest cached whole-page prefix of token_ids under namespace; refreshes its access time.

        A caller that needs at least one token to compute (for the logits) passes token_ids[:-1].
        """
        key = self._aligned_key(token_ids)
        node, values, now = self.root, [], self._clock()
        while key:
            child = node.children.get(child_key(namespace, key, self.page_size))
            if child is None:
                break
            num_common = self._common_len(child.key, key)
            if num_common < len(child.key):
                child = self._split(child, num_common)
            child.last_access = now
            values.append(child.value)
            node, key = child, key[num_common:]
        slots = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return MatchResult(slots=slots, node=node)

    def insert(self, namespace: str, token_ids: Sequence[int], slots: Sequence[int] | torch.Tensor) -> int:
        """Caches the whole pages of token_ids with their slots; returns num_cached (see module doc)."""
        if len(slots) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(slots)} slots")
        key = self._aligned_key(token_ids)
        value = torch.as_tensor(slots, dtype=torch.int64)[: len(key)]
        pages_of_slots(value, self.page_size)  # raises unless whole pages
        node, num_cached, now = self.root, 0, self._clock()
        while key:
            ckey = child_key(namespace, key, self.page_size)
            child = node.children.get(ckey)
            if child is None:
                node.children[ckey] = TreeNode(namespace=namespace, key=key, value=value[num_cached:].clone(),
                                               parent=node, last_access=now)
                self._evictable_size += len(key)
                break
            num_common = self._common_len(child.key, key)
            if num_common < len(child.key):
                child = self._split(child, num_common)
            child.last_access = now
            num_cached += num_common
            node, key = child, key[num_common:]
        return num_cached

    def _aligned_key(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        aligned_len = len(token_ids) // self.page_size * self.page_size
        return tuple(token_ids[:aligned_len])

    def _common_len(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """Length of the common prefix of a and b, rounded down to whole pages."""
        num_common = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            num_common += 1
        return num_common // self.page_size * self.page_size

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Cuts node after split_len tokens; returns the new parent holding the first part.

        `node` keeps the second part, so a request that locked `node` still holds the end of its match.
        """
        parent = node.parent
        assert parent is not None and 0 < split_len < len(node.key)
        head = TreeNode(namespace=node.namespace, key=node.key[:split_len], value=node.value[:split_len],
                        parent=parent, lock_ref=node.lock_ref, last_access=node.last_access)
        parent.children[child_key(node.namespace, head.key, self.page_size)] = head
        node.key, node.value, node.parent = node.key[split_len:], node.value[split_len:], head
        head.children[child_key(node.namespace, node.key, self.page_size)] = node
        return head

    # -- locking ----------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pins node and every ancestor (a running request pins its matched prefix)."""
        while not node.is_root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undoes one inc_lock_ref(node); raises if node is not locked."""
        if not node.is_root and node.lock_ref <= 0:
            raise ValueError("dec_lock_ref of an unlocked node")
        while not node.is_root:
            if node.lock_ref == 1:
                self._protected_size -= len(node.key)
                self._evictable_size += len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # -- eviction ---------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Frees unlocked leaves, least recently used first, until num_tokens are freed or none is left.

        A parent whose last child goes becomes a leaf and a candidate in turn. Returns the number of
        tokens freed (whole nodes, so possibly more than asked).
        """
        tie = itertools.count()
        heap = [(leaf.last_access, next(tie), leaf) for leaf in self._nodes()
                if not leaf.children and leaf.lock_ref == 0]
        heapq.heapify(heap)
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(pages_of_slots(leaf.value, self.page_size))
            num_freed += len(leaf.key)
            self._evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[child_key(leaf.namespace, leaf.key, self.page_size)]
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return num_freed

    # -- introspection ----------------------------------------------------------------------------

    def _nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Raises AssertionError if the tree or its size counters are inconsistent."""
        num_evictable = num_protected = 0
        seen_slots: set[int] = set()
        for node in self._nodes():
            parent = node.parent
            _check(len(node.key) == len(node.value) > 0, "empty node or key/value length mismatch")
            _check(len(node.key) % self.page_size == 0, "node is not whole pages")
            pages_of_slots(node.value, self.page_size)
            _check(parent.children.get(child_key(node.namespace, node.key, self.page_size)) is node,
                   "child keyed inconsistently")
            _check(parent.is_root or parent.namespace == node.namespace, "namespace differs from parent's")
            _check(node.lock_ref >= 0, "negative lock_ref")
            if not parent.is_root:
                num_child_locks = sum(c.lock_ref for c in parent.children.values())
                _check(parent.lock_ref >= num_child_locks, "locked node under a less locked parent")
            slots = node.value.tolist()
            _check(seen_slots.isdisjoint(slots), "slot held by two nodes")
            seen_slots.update(slots)
            if node.lock_ref:
                num_protected += len(node.key)
            else:
                num_evictable += len(node.key)
        _check(num_evictable == self._evictable_size, "evictable_size out of sync")
        _check(num_protected == self._protected_size, "protected_size out of sync")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
