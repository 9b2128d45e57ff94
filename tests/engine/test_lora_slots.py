"""The LoRA slot pool, slot assignment (eviction, pinning) and the host adapter cache."""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from types import SimpleNamespace

import pytest
import torch

from engine.adapter_cache import HostAdapterCache, pack_adapter
from engine.adapter_slots import AdapterSlots, SlotsExhausted
from engine.lora_inputs import LoraInputs, PendingExpand, sgmv_ops
from engine.lora_manager import LoraManager
from engine.lora_pool import LoraSlotPool, PackedAdapter, fused_targets, served_modules
from engine.named_shapes import NAMED_SHAPES
from engine.parallel import TensorParallel
from loraformat.architectures import Split
from loraformat.peft_compile import CanonicalAdapter
from lorakernels.sgmv_ref import SgmvMeta

CONFIG = NAMED_SHAPES["tiny"]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_dims(module: str) -> tuple[int, int]:
    c = CONFIG
    return {
        "q_proj": (c.hidden_size, c.q_size),
        "k_proj": (c.hidden_size, c.kv_size),
        "v_proj": (c.hidden_size, c.kv_size),
        "o_proj": (c.q_size, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }[module]


def canonical(rank: int, modules=MODULES, seed: int = 0, scaling: float = 2.0) -> CanonicalAdapter:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(CONFIG.num_layers):
        for module in modules:
            in_dim, out_dim = module_dims(module)
            tensors[f"layers.{layer}.{module}.lora_A"] = torch.randn(rank, in_dim, generator=gen)
            tensors[f"layers.{layer}.{module}.lora_B"] = torch.randn(out_dim, rank, generator=gen)
    return CanonicalAdapter("tiny", CONFIG.num_layers, rank, scaling * rank, scaling, False, tuple(modules), {}, tensors)


def packed(name: str, rank: int = 4, modules=MODULES, seed: int = 0) -> PackedAdapter:
    targets = {t.name: t for t in fused_targets(CONFIG)}
    return pack_adapter(name, canonical(rank, modules, seed), targets, torch.float32, pin=False)


def slot_delta(pool: LoraSlotPool, slot: int, layer: int, module: str) -> torch.Tensor:
    """B @ A of one projection as stored in the slot: [out, in]."""
    for target in pool.targets.values():
        if module in target.modules:
            k = target.modules.index(module)
            offset, size = target.output_slices[k]
            a = pool.a[target.name][layer, slot, k * pool.max_rank : (k + 1) * pool.max_rank]
            b = pool.b[target.name][layer, slot, offset : offset + size]
            return b @ a
    raise KeyError(module)


def test_packed_adapter_reproduces_every_projection():
    adapter = canonical(4, seed=1)
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    pool.load(1, pack_adapter("x", adapter, pool.targets, torch.float32, pin=False))
    pool.wait_for_loads()  # the runner's call before every forward: on the CPU, nothing to wait for
    assert (pool.ranks[1], pool.scalings[1]) == (4, 2.0)
    for layer in range(CONFIG.num_layers):
        for module in MODULES:
            a, b = adapter.module_weights(layer, module)
            torch.testing.assert_close(slot_delta(pool, 1, layer, module), b @ a)
    assert pool.ranks[pool.base_slot] == 0 and not pool.a["qkv"][:, pool.base_slot].any()
    with pytest.raises(dataclasses.FrozenInstanceError):  # the slot buffers were sized from a target's widths
        pool.targets["qkv"].in_dim = 1


def test_loading_a_smaller_adapter_leaves_no_residue_of_the_previous_tenant():
    pool = LoraSlotPool(CONFIG, num_slots=1, max_rank=16, dtype=torch.float32, device="cpu")
    pool.load(0, packed("all", rank=16, seed=2))
    pool.load(0, packed("qv", rank=2, modules=("q_proj", "v_proj"), seed=3))
    for layer in range(CONFIG.num_layers):
        for module in ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            assert not slot_delta(pool, 0, layer, module).any(), module
    assert not pool.a["qkv"][:, 0, 2:16].any()  # q's rows past rank 2
    assert not pool.b["qkv"][:, 0, :, 2:].any()
    assert pool.ranks[0] == 2


def test_loads_of_changing_ranks_through_one_slot_each_hold_their_adapter_alone():
    """A slot's views are kept for the latest rank loaded (LoraSlotPool._slot_views): loads of ranks
    8, 3, 8, 16 (the max) and 3 in turn, beside loads into the other slot, each hold that adapter's
    weights and nothing of the ones before."""
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=16, dtype=torch.float32, device="cpu")
    for i, rank in enumerate((8, 3, 8, 16, 3)):
        adapter = canonical(rank, seed=10 + i)
        pool.load(0, pack_adapter(f"r{i}", adapter, pool.targets, torch.float32, pin=False))
        pool.load(1, packed(f"other{i}", rank=16 - rank or 1, seed=20 + i))
        for layer in range(CONFIG.num_layers):
            for module in MODULES:
                a, b = adapter.module_weights(layer, module)
                torch.testing.assert_close(slot_delta(pool, 0, layer, module), b @ a)
        for name in pool.targets:
            assert not pool.b[name][:, 0, :, rank:].any(), (rank, name)
            stacked = pool.a[name][:, 0].unflatten(1, (pool.targets[name].num_stack, 16))
            assert not stacked[:, :, rank:].any(), (rank, name)
        assert pool.ranks[0] == rank


def test_targets_an_adapter_lacks_are_left_out_and_rank_0_in_its_slot():
    """A q/v adapter packs only its qkv target (no zeros for o, gate_up, down on the host) and has rank 0
    in the slot's other targets, which the kernels of those targets then skip; loading it over an
    all-target tenant still zeroes that tenant's o, gate_up and down buffers; clear zeroes every rank."""
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=16, dtype=torch.float32, device="cpu")
    qv = packed("qv", rank=4, modules=("q_proj", "v_proj"), seed=5)
    assert set(qv.a) == set(qv.b) == {"qkv"}
    pool.load(0, packed("all", rank=8, seed=6))
    assert {name: ranks[0] for name, ranks in pool.target_ranks.items()} == {"qkv": 8, "o": 8, "gate_up": 8, "down": 8}
    pool.load(0, qv)
    pool.load(1, packed("down", rank=2, modules=("down_proj",), seed=7))
    assert {name: ranks[:2] for name, ranks in pool.target_ranks.items()} == {
        "qkv": [4, 0], "o": [0, 0], "gate_up": [0, 0], "down": [0, 2],
    }  # fmt: skip
    assert pool.ranks == [4, 2, 0]
    for name in ("o", "gate_up", "down"):
        assert not pool.a[name][:, 0].any() and not pool.b[name][:, 0].any(), name
    pool.clear(1)
    assert all(ranks == [4, 0, 0] if name == "qkv" else ranks == [0, 0, 0] for name, ranks in pool.target_ranks.items())


def test_load_refuses_the_base_slot_and_ranks_over_the_max():
    """Guards the base slot (rank 0 forever, so base-model tokens get no delta) and the buffer bound."""
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    for slot in (-1, pool.base_slot):
        with pytest.raises(ValueError, match=rf"slot {slot} is not an adapter slot \(0\.\.1\)"):
            pool.load(slot, packed("x", rank=4))
    with pytest.raises(ValueError, match="adapter rank 9 is over the pool's max rank 8"):
        pool.load(0, packed("x", rank=9))
    assert pool.ranks == [0, 0, 0] and not any(t.any() for t in (*pool.a.values(), *pool.b.values()))
    pool.load(1, packed("full", rank=8))  # the largest slot and rank themselves fit
    assert pool.ranks == [0, 8, 0] and pool.scalings == [0.0, 2.0, 0.0]
    assert pool.a["qkv"][:, 1].any() and not pool.a["qkv"][:, pool.base_slot].any()


def test_clear_makes_a_slot_rank_0_and_the_next_load_replaces_it_whole():
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    pool.load(0, packed("a", rank=8, seed=1))
    pool.load(1, packed("b", rank=4, seed=2))
    pool.clear(0)
    assert (pool.ranks, pool.scalings) == ([0, 4, 0], [0.0, 2.0, 0.0])
    adapter = canonical(2, modules=("o_proj",), seed=3)
    pool.load(0, pack_adapter("c", adapter, pool.targets, torch.float32, pin=False))
    for layer in range(CONFIG.num_layers):
        a, b = adapter.module_weights(layer, "o_proj")
        torch.testing.assert_close(slot_delta(pool, 0, layer, "o_proj"), b @ a)
        assert not slot_delta(pool, 0, layer, "q_proj").any()
    assert pool.ranks == [2, 4, 0]


def test_loads_copy_on_their_own_stream_after_queued_work_and_forwards_wait_for_the_latest(monkeypatch):
    """Guards the CUDA ordering of slot loads, with fake streams (no GPU here): a load makes the copy stream
    wait for the work queued on the compute stream (it may still read the slot's previous tenant), issues
    every copy on the copy stream, then records an event; `load` never makes the compute stream wait, and
    `wait_for_loads` waits for the latest load of each slot asked for, once."""
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    log, active = [], [None]

    class FakeStream:
        def __init__(self, name: str):
            self.name = name

        def wait_stream(self, stream) -> None:
            log.append(f"{self.name} waits for {stream.name}")

        def wait_event(self, event) -> None:
            log.append(f"{self.name} waits for event {event.number}")

    class FakeEvent:
        def __init__(self):
            self.number = sum(entry.startswith("event") for entry in log)

        def record(self, stream) -> None:
            log.append(f"event {self.number} on {stream.name}")

    @contextlib.contextmanager
    def on_stream(stream):
        active[0] = stream
        yield
        active[0] = None

    copy_stream, compute_stream = FakeStream("copy"), FakeStream("compute")
    pool._copy_stream = copy_stream  # what the pool makes for itself on a CUDA device
    copy_target = pool._copy_target
    monkeypatch.setattr(pool, "_copy_target", lambda *args: (log.append(f"copy on {active[0].name}"), copy_target(*args)))
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute_stream)

    for slot, name in ((0, "a"), (1, "b"), (0, "c")):
        pool.load(slot, packed(name, seed=len(log)))
    one_load = ["copy waits for compute", *["copy on copy"] * len(pool.targets)]
    assert log == [*one_load, "event 0 on copy", *one_load, "event 1 on copy", *one_load, "event 2 on copy"]
    del log[:]
    pool.wait_for_loads([1, pool.base_slot])
    assert log == ["compute waits for event 1"]
    pool.wait_for_loads()
    assert log == ["compute waits for event 1", "compute waits for event 2"]  # slot 0's latest covers its first
    pool.wait_for_loads()
    assert len(log) == 2
    assert pool.ranks[:2] == [4, 4] and pool.a["qkv"][:, 0].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_does_not_hold_the_host_until_the_running_step_ends():
    """On CUDA a load only enqueues: with the compute stream busy (a long sleep kernel standing in for a
    step), `load` returns while that work still runs, and the slot then holds the adapter. The stacked
    targets' A (q/k/v, gate/up) are the pieces that once went through pageable memory and waited."""
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=8, dtype=torch.bfloat16, device="cuda")
    adapter = canonical(4, seed=9)
    host = pack_adapter("x", adapter, pool.targets, torch.bfloat16, pin=True)
    pool.load(0, host)  # a first load: the copy stream's first allocations
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles on the compute stream
    busy = torch.cuda.Event()
    busy.record()
    pool.load(1, host)
    assert not busy.query(), "load waited for the compute stream's work"
    pool.wait_for_loads()
    torch.cuda.synchronize()
    for target in pool.targets.values():
        for k, module in enumerate(target.modules):
            offset, size = target.output_slices[k]
            for layer in range(CONFIG.num_layers):
                a, b = (w.to(torch.bfloat16).cuda() for w in adapter.module_weights(layer, module))
                assert torch.equal(pool.a[target.name][layer, 1, k * 8 : k * 8 + 4], a), (module, layer)
                assert torch.equal(pool.b[target.name][layer, 1, offset : offset + size, :4], b), (module, layer)


def test_target_modules_keep_only_the_fused_targets_holding_them():
    """--lora-target-modules: q_proj keeps the whole q/k/v target (one buffer), o_proj the o target; the
    pool has buffers for those alone, loads an adapter within them and refuses one beyond them (nothing
    of it copied); the targets it lacks run the base projection with no LoRA kernel."""
    assert [t.name for t in fused_targets(CONFIG, ("q_proj", "o_proj"))] == ["qkv", "o"]
    assert [t.name for t in fused_targets(CONFIG)] == ["qkv", "o", "gate_up", "down"]
    assert served_modules(CONFIG, ("v_proj",)) == {"q_proj", "k_proj", "v_proj"}
    with pytest.raises(ValueError, match=r"LoRA target modules \['qproj'\] are not projections of llama models"):
        fused_targets(CONFIG, ("qproj", "v_proj"))
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu", modules=("q_proj", "o_proj"))
    full = LoraSlotPool(CONFIG, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    assert set(pool.a) == set(pool.b) == set(pool.target_ranks) == {"qkv", "o"}
    assert sum(t.numel() for t in (*pool.a.values(), *pool.b.values())) < sum(t.numel() for t in (*full.a.values(), *full.b.values())) / 2
    adapter = canonical(4, ("q_proj", "v_proj", "o_proj"), seed=8)
    pool.load(0, pack_adapter("attn", adapter, pool.targets, torch.float32, pin=False))
    for layer in range(CONFIG.num_layers):
        for module in ("q_proj", "v_proj", "o_proj"):
            a, b = adapter.module_weights(layer, module)
            torch.testing.assert_close(slot_delta(pool, 0, layer, module), b @ a)
    with pytest.raises(ValueError, match=r"adapter adapts \['down', 'gate_up'\]: the pool holds \['o', 'qkv'\] only"):
        pool.load(1, packed("all", rank=4))
    assert pool.ranks[1] == 0 and not pool.a["qkv"][:, 1].any()
    meta = SgmvMeta.from_lists([2], [0], pool.ranks, pool.scalings)
    lora = LoraInputs(pool, meta, *sgmv_ops("ref"))
    x, linear = torch.randn(2, CONFIG.hidden_size), torch.nn.Linear(CONFIG.hidden_size, 3, bias=False)
    y, delta = lora.project_deferred(linear, "gate_up", 0, x)
    assert delta is None and torch.equal(y, linear(x))


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tensor_parallel_slot_holds_the_ranks_shard_of_every_projection(tp_rank):
    """A rank's slot holds, per projection, the full delta's output rows of its shard (column targets:
    q/k/v, gate/up) or input columns of its shard (row targets: o, down), so the ranks' deltas, summed
    by the all-reduce, are the full adapter's."""
    tp = TensorParallel(tp_rank, 2)
    adapter = canonical(4, seed=5)
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu", tp=tp)
    pool.load(1, pack_adapter("x", adapter, {t.name: t for t in fused_targets(CONFIG)}, torch.float32, pin=False))
    assert pool.ranks[1] == 4
    for target in pool.targets.values():
        for module in target.modules:
            for layer in range(CONFIG.num_layers):
                a, b = adapter.module_weights(layer, module)
                full = b @ a  # [out, in]
                if target.split is Split.ROW:
                    expected = full[:, tp.part(full.shape[1])]
                else:
                    expected = full[tp.part(full.shape[0])]
                torch.testing.assert_close(slot_delta(pool, 1, layer, module), expected, msg=module)


def make_slots(num_slots: int, policy: str = "lru"):
    clock = iter(range(1, 10_000))
    return AdapterSlots(num_slots, policy, clock=lambda: next(clock))


def loader(name: str):
    # crc32, not hash(): str hashes change with PYTHONHASHSEED, and so would the weights.
    return lambda: packed(name, seed=zlib.crc32(name.encode()) % 1000)


def test_lru_evicts_the_least_recently_used_unused_slot():
    slots = make_slots(2)
    a = slots.acquire("a", loader("a"))
    b = slots.acquire("b", loader("b"))
    slots.release("a")
    slots.release("b")
    slots.acquire("a", loader("a"))  # a is now the most recently used
    slots.release("a")
    assert slots.acquire("c", loader("c")) == b
    assert slots.slot_of("b") is None and slots.slot_of("a") == a
    assert (slots.num_loads, slots.num_evictions) == (3, 1)


def test_fifo_evicts_the_oldest_load():
    slots = make_slots(2, "fifo")
    a = slots.acquire("a", loader("a"))
    slots.acquire("b", loader("b"))
    slots.release("a")
    slots.release("b")
    slots.acquire("a", loader("a"))  # a is the most recently used, but it was loaded first
    slots.release("a")
    assert slots.acquire("c", loader("c")) == a


def test_slots_in_use_or_pinned_are_never_evicted():
    slots = make_slots(2)
    slots.acquire("busy", loader("busy"))
    slots.pin("pinned", loader("pinned"))
    assert not slots.can_acquire("new")
    with pytest.raises(SlotsExhausted):
        slots.acquire("new", loader("new"))
    assert slots.evict("busy") is False and slots.evict("pinned") is False
    slots.release("busy")
    assert slots.can_acquire("new")
    slots.acquire("new", loader("new"))
    assert slots.slot_of("pinned") is not None and slots.slot_of("busy") is None


def test_pinning_is_capped_at_slots_minus_one():
    slots = make_slots(3)
    slots.pin("a", loader("a"))
    slots.pin("b", loader("b"))
    with pytest.raises(SlotsExhausted, match="at most 2"):
        slots.pin("c", loader("c"))
    num_loads = slots.num_loads
    assert slots.pin("a", loader("a")) == slots.slot_of("a")  # already pinned: no new slot taken
    assert slots.num_loads == num_loads and sum(s.is_pinned for s in slots.slots) == 2
    slots.unpin("a")
    slots.pin("c", loader("c"))


def test_release_without_acquire_is_an_error():
    slots = make_slots(1)
    digest = "0123456789abcdef" * 4
    slots.acquire(digest, loader("a"))
    slots.release(digest)
    with pytest.raises(ValueError, match=r"^adapter 0123456789ab released more often than acquired$"):
        slots.release(digest)


def test_lru_counts_a_release_as_a_use():
    """Guards: `release()` refreshing `last_used`. b was acquired after a but a was released last, so a
    is the more recently used; an LRU that only counted acquisitions would evict a."""
    slots = make_slots(2)
    slots.acquire("a", loader("a"))
    b = slots.acquire("b", loader("b"))
    slots.release("b")
    slots.release("a")
    assert slots.acquire("c", loader("c")) == b
    assert slots.slot_of("b") is None and slots.slot_of("a") is not None


def test_host_cache_is_lru_by_digest():
    cache = HostAdapterCache(2)
    for name in ("a", "b"):
        cache.put(packed(name))
    assert cache.get("a") is not None  # a becomes most recent
    cache.put(packed("c"))
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.get("b") is None
    assert (cache.num_hits, cache.num_misses, cache.num_joined) == (1, 0, 0)  # a miss is its fetcher's to count
    cache.count_miss()
    cache.count_miss(joined=True)
    cache.count_miss(joined=True)
    assert (cache.num_hits, cache.num_misses, cache.num_joined) == (1, 1, 2)


def test_host_cache_keeps_what_slots_hold_beyond_its_bound():
    """Resident entries are never evicted and do not count toward max_adapters; once their slot lets
    them go they are ordinary LRU entries again, evicted by the next insert."""
    cache, held = HostAdapterCache(1), {"a", "b"}
    cache.resident = lambda digest: digest in held
    for name in ("a", "b", "c", "d"):
        cache.put(packed(name))
    assert [name for name in "abcd" if name in cache] == ["a", "b", "d"]  # c: the one non-resident past the bound
    held.discard("a")
    assert "a" in cache  # nothing is evicted until an insert
    cache.put(packed("e"))
    assert [name for name in "abcde" if name in cache] == ["b", "e"]


def test_manager_keeps_host_copies_of_slot_adapters_and_adopts_the_ones_slots_take():
    """A one-entry host cache behind two slots: every adapter in a slot stays on the host (a request for
    it must not fetch again), a request's copy that the cache had dropped comes back when a slot takes it,
    and an evicted adapter's copy becomes evictable again."""
    lora = LoraManager(make_slots(2), HostAdapterCache(1))
    cache = lora.host_cache
    a, b = packed("a"), packed("b")
    cache.put(a)
    cache.put(b)
    assert "a" not in cache  # not in a slot yet: the LRU bound applies
    lora.acquire("a", a)  # a's request held its copy: the slot takes it, and the cache keeps it again
    assert "a" in cache and "b" not in cache  # b, in no slot, made room
    lora.acquire("b", b)
    assert "a" in cache and "b" in cache
    cache.put(packed("c"))
    assert "a" in cache and "b" in cache and "c" in cache  # a and b sit in slots; c is the one other
    lora.release("a")
    lora.release("b")
    lora.acquire("c")  # evicts a (least recently used) from its slot
    assert lora.slots.slot_of("a") is None
    cache.put(packed("d"))
    assert "a" not in cache and "d" in cache and "b" in cache and "c" in cache
    lora.load_ahead([("e", packed("e"))], max_loads=1)  # a load ahead adopts its copy too
    assert lora.slots.slot_of("e") is not None and "e" in cache


def test_slots_decide_each_load_once_and_evict_on_request():
    slots = make_slots(2)
    index = slots.acquire("a", loader("a"))
    loads, packed = slots.take_loads()
    assert [(load.slot, load.digest) for load in loads] == [(index, "a")] and packed["a"].rank == 4
    assert slots.take_loads() == ((), {})  # handed over once
    slots.acquire("b", loader("b"))
    slots.release("a")
    slots.release("b")
    assert slots.acquire("c", loader("c")) == index and slots.num_evictions == 1  # a's slot, reloaded
    assert [(load.slot, load.digest) for load in slots.take_loads()[0]] == [(1 - index, "b"), (index, "c")]
    assert slots.evict("c") is False  # in use
    slots.release("c")
    assert slots.evict("c") is True
    assert slots.slot_of("c") is None and slots.slots[index].digest is None
    assert slots.evict("never-loaded") is True  # nothing to drop: gone already
    assert slots.num_evictions == 1  # an explicit evict is not an eviction for room


def idle(slots: AdapterSlots, *names: str) -> None:
    """Place each name and leave it idle, the first least recently used."""
    for name in names:
        slots.acquire(name, loader(name))
        slots.release(name)


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_acquire_spares_wanted_adapters_while_another_is_idle(policy):
    """w1 is the victim of either policy (least recently used, loaded first); a waiting request wants it,
    so the unwanted idle u goes instead."""
    slots = make_slots(3, policy)
    idle(slots, "w1", "u", "w2")
    u = slots.slot_of("u")
    assert slots.acquire("new", loader("new"), wanted={"w1", "w2", "new"}) == u
    assert slots.slot_of("u") is None and slots.slot_of("w1") is not None and slots.slot_of("w2") is not None
    assert (slots.num_loads, slots.num_evictions) == (4, 1)


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_acquire_takes_the_policys_victim_among_wanted_adapters_when_all_idle_ones_are(policy):
    """Every idle adapter is wanted: admission still gets a slot (unlike a load ahead), the policy's victim
    among them; the slot in use and the pinned one stay whatever `wanted` says."""
    slots = make_slots(4, policy)
    slots.pin("pinned", loader("pinned"))
    slots.acquire("busy", loader("busy"))
    idle(slots, "w1", "w2")
    slots.acquire("w2", loader("w2"))  # w2 used again: w1 is the least recently used and the oldest load
    slots.release("w2")
    w1 = slots.slot_of("w1")
    assert slots.can_acquire("new")
    assert slots.acquire("new", loader("new"), wanted={"w1", "w2"}) == w1
    assert {s.digest for s in slots.slots} == {"pinned", "busy", "w2", "new"}


def test_acquire_never_evicts_in_use_or_pinned_adapters_outside_wanted():
    """Only busy (in use) and pinned hold slots, neither wanted: spared-or-not, neither is evictable."""
    slots = make_slots(2)
    slots.pin("pinned", loader("pinned"))
    slots.acquire("busy", loader("busy"))
    assert not slots.can_acquire("new")
    with pytest.raises(SlotsExhausted):
        slots.acquire("new", loader("new"), wanted={"other"})
    assert slots.slot_of("busy") is not None and slots.slot_of("pinned") is not None
    assert (slots.num_loads, slots.num_evictions) == (2, 0)


def test_unknown_eviction_policy_is_refused():
    with pytest.raises(ValueError, match=r"eviction policy 'mru' is not one of \['fifo', 'lru'\]"):
        AdapterSlots(1, "mru")


def test_fifo_goes_by_load_time_not_by_slot_order():
    """The oldest load sits in the higher slot: b reuses slot 0 after x left it, so y (slot 1) is older."""
    slots = make_slots(2, "fifo")
    x = slots.acquire("x", loader("x"))
    y = slots.acquire("y", loader("y"))
    slots.release("x")
    slots.release("y")
    assert slots.evict("x") is True
    assert slots.acquire("b", loader("b")) == x  # the empty slot first, no eviction
    slots.release("b")
    assert slots.num_evictions == 0
    assert slots.acquire("c", loader("c")) == y
    assert [s.digest for s in slots.slots] == ["b", "c"]
    assert slots.num_loads == 4


# ---------------------------------------------------------------------------------------- load ahead


def test_load_ahead_takes_an_empty_slot_that_admission_then_finds():
    slots = make_slots(2)
    busy = slots.acquire("busy", loader("busy"))
    slots.take_loads()
    ahead = slots.load_ahead("next", loader("next"), keep={"next"})
    assert ahead == 1 - busy and slots.slots[ahead].num_users == 0
    assert [(load.slot, load.digest) for load in slots.take_loads()[0]] == [(ahead, "next")]
    assert (slots.num_loads, slots.num_loads_ahead, slots.num_evictions) == (2, 1, 0)
    assert slots.load_ahead("next", loader("next"), keep={"next"}) is None  # placed already: no second copy
    assert slots.acquire("next", loader("next")) == ahead  # its turn: no load left to do
    assert slots.take_loads() == ((), {}) and slots.num_loads == 2


def test_load_ahead_evicts_only_idle_adapters_no_waiting_request_needs():
    """busy is used by a running request, pinned is pinned, wanted is idle but a waiting request needs
    it, idle is idle and unwanted: only idle's slot may go, and only once."""
    slots = make_slots(4)
    for name in ("busy", "wanted", "idle"):
        slots.acquire(name, loader(name))
    slots.pin("pinned", loader("pinned"))
    slots.release("idle")
    slots.release("wanted")  # now the least recently used: LRU alone would take it first
    keep = {"wanted", "x", "y"}
    assert slots.load_ahead("x", loader("x"), keep) == slots.slots.index(next(s for s in slots.slots if s.digest == "x"))
    assert slots.slot_of("idle") is None and slots.num_evictions == 1
    assert slots.load_ahead("y", loader("y"), keep) is None  # x is wanted too: no slot left
    assert {s.digest for s in slots.slots} == {"busy", "pinned", "wanted", "x"}
    assert slots.num_loads_ahead == 1


def test_admission_may_still_take_a_slot_loaded_ahead():
    """A slot loaded ahead has no user: it never blocks a request that can run now."""
    slots = make_slots(1)
    slots.load_ahead("later", loader("later"), keep={"later"})
    assert slots.can_acquire("now")
    assert slots.acquire("now", loader("now")) == 0 and slots.slot_of("later") is None


def manager(num_slots: int) -> LoraManager:
    return LoraManager(make_slots(num_slots), HostAdapterCache(4))


def test_manager_loads_ahead_in_queue_order_once_per_adapter_within_the_bound():
    lora = manager(4)
    lora.acquire("run", packed("run"))
    lora.take_loads()
    waiting = [(name, packed(name)) for name in ("a", "run", "b", "a", "c", "d")]
    assert lora.load_ahead(waiting, max_loads=2) == 2
    assert [load.digest for load in lora.take_loads()[0]] == ["a", "b"]  # run holds a slot already
    assert lora.load_ahead(waiting, max_loads=2) == 1  # one empty slot left
    assert [load.digest for load in lora.take_loads()[0]] == ["c"]
    assert lora.load_ahead(waiting, max_loads=2) == 0  # every other slot holds what the queue wants
    assert lora.slots.slot_of("d") is None and lora.slots.num_evictions == 0


def test_manager_leaves_requests_without_a_host_copy_to_admission():
    lora = manager(2)
    assert lora.load_ahead([("bare", None), ("ok", packed("ok"))], max_loads=2) == 1
    assert [load.digest for load in lora.take_loads()[0]] == ["ok"]


def test_manager_passes_the_wanted_adapters_to_the_slots():
    lora = manager(2)
    lora.acquire("w", packed("w"))
    lora.acquire("u", packed("u"))
    lora.release("w")  # w released first: LRU alone would evict it
    lora.release("u")
    u = lora.slots.slot_of("u")
    assert lora.acquire("new", packed("new"), wanted={"w"}) == u and lora.slots.slot_of("w") is not None


def test_a_forward_waits_only_for_the_loads_of_its_own_slots(monkeypatch):
    """On CUDA each load records an event on the copy stream; a forward waits for those of the slots it
    reads, so a copy ahead into another slot keeps running beside it. The stream is faked here (no GPU)."""
    pool = LoraSlotPool(CONFIG, num_slots=3, max_rank=8, dtype=torch.float32, device="cpu")
    waited = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_event=waited.append))
    pool._pending = {0: "end of slot 0's load", 2: "end of slot 2's load"}
    pool.wait_for_loads([0, 1, pool.base_slot, 0])
    assert waited == ["end of slot 0's load"]
    pool.wait_for_loads([0])
    assert waited == ["end of slot 0's load"]  # waited for once
    pool.wait_for_loads()  # None: every slot
    assert waited == ["end of slot 0's load", "end of slot 2's load"] and not pool._pending


def test_sm_carveout_is_set_inside_and_restored_after():
    """engine/lora_inputs.py `sm_carveout`: PyTorch's process-wide setting holds the given SM count
    inside the block only, is restored when the block raises, and is left alone for 0."""
    from engine.lora_inputs import sm_carveout

    get = torch._C._get_sm_carveout_experimental
    before = get()
    with sm_carveout(24):
        assert get() == 24
        with sm_carveout(0):
            assert get() == 24
    assert get() == before
    with pytest.raises(RuntimeError, match="inside"), sm_carveout(8):
        raise RuntimeError("inside")
    assert get() == before


class LoggedStream:
    """A CUDA stream stand-in (the CPU has none) that logs what it is asked to do, in order."""

    def __init__(self, name: str, log: list[tuple]) -> None:
        self.name, self.log = name, log

    def record_event(self):
        self.log.append((self.name, "record"))
        return ("event", len(self.log))

    def wait_event(self, event) -> None:
        self.log.append((self.name, "wait_event", event))

    def wait_stream(self, other) -> None:
        self.log.append((self.name, "wait_stream", other.name))


@pytest.fixture
def stream_log(monkeypatch) -> tuple[list[tuple], list[LoggedStream]]:
    """(the log, the stack of current streams): engine.lora_inputs' current stream is a LoggedStream
    "main" and `torch.cuda.stream(s)` makes s current inside."""
    import engine.lora_inputs

    log: list[tuple] = []
    main = LoggedStream("main", log)
    current = [main]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(engine.lora_inputs.torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(engine.lora_inputs.torch.cuda, "stream", on)
    return log, current


def test_decode_side_stream_runs_only_the_base_gemm_under_the_sm_carveout(stream_log):
    """A decode step's projection with a side stream (LoraInputs.side, CUDA): the base GEMM is enqueued
    first, on the main stream, under the carve-out (it leaves `sm_carveout` SMs free); the side stream
    forks from an event recorded before the GEMM (when x is ready), not after it, so its shrink and
    expand run beside the GEMM with the setting as it was, and main joins the side stream before the
    delta is handed back. Steps without a carve-out leave the setting alone."""
    log, current = stream_log
    get = torch._C._get_sm_carveout_experimental
    before = get()
    pool = LoraSlotPool(CONFIG, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    pool.load(1, packed("all", rank=4))
    meta = SgmvMeta.from_lists([2], [1], pool.ranks, pool.scalings)
    shrink, expand, delta = sgmv_ops("ref")

    def recorded(name, fn):
        def call(*args, **kwargs):
            log.append((current[-1].name, name, get()))
            return fn(*args, **kwargs)

        return call

    gemm = torch.nn.Linear(CONFIG.hidden_size, pool.targets["qkv"].out_dim, bias=False)
    x = torch.randn(2, CONFIG.hidden_size)
    # a target's own carve-out (sm_carveout_targets) wins over sm_carveout; other targets' do not apply
    cases = ((16, {}, 16), (0, {}, before), (16, {"qkv": 0}, before), (16, {"qkv": 8}, 8), (16, {"gate_up": 0}, 16))
    for carveout, by_target, expected in cases:
        log.clear()
        side = LoggedStream("side", log)
        lora = LoraInputs(
            pool, meta, recorded("shrink", shrink), expand, recorded("delta", delta), side=side, sm_carveout=carveout,
            sm_carveout_targets=by_target,
        )  # fmt: skip
        y, d = lora.project_deferred(recorded("gemm", gemm), "qkv", 0, x)
        assert log == [
            ("main", "record"),
            ("main", "gemm", expected),
            ("side", "wait_event", ("event", 1)),  # the event from before the GEMM
            ("side", "shrink", before),
            ("side", "delta", before),
            ("main", "wait_stream", "side"),
        ]
        assert get() == before
        assert torch.equal(y, gemm(x)) and d is not None and d.abs().sum() > 0


def test_decode_fused_delta_targets_take_one_fused_pass_on_the_side_stream(stream_log, monkeypatch):
    """LoraInputs.decode_fused_delta: those targets' side stream runs the fused delta from x (no shrink,
    no delta of v) and hands it back like the unfused delta; other targets keep shrink then delta; a
    target in decode_fused_expand still hands back its PendingExpand. The fused pass is the reference
    shrink then delta here (its kernel runs only in Triton: tests/lorakernels/test_sgmv_decode.py)."""
    import engine.lora_inputs

    log, current = stream_log
    pool = LoraSlotPool(CONFIG, num_slots=3, max_rank=8, dtype=torch.float32, device="cpu")
    pool.load(1, packed("all", rank=4))
    pool.load(2, packed("mlp", rank=8, modules=("gate_proj", "up_proj", "down_proj"), seed=1))
    meta = SgmvMeta.from_lists([1, 2], [1, 2], pool.ranks, pool.scalings)
    shrink, expand, delta = sgmv_ops("ref")

    def fused(x, a, b, meta, num_stack, output_slices):
        log.append((current[-1].name, "fused", num_stack, output_slices))
        return delta(shrink(x, a, meta, num_stack=num_stack), b, meta, output_slices=output_slices)

    def recorded(name, fn):
        def call(*args, **kwargs):
            log.append((current[-1].name, name))
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(engine.lora_inputs, "_fused_delta", fused)
    unfused = LoraInputs(pool, meta, shrink, expand, delta, side=LoggedStream("side", log))
    lora = LoraInputs(
        pool, meta, recorded("shrink", shrink), expand, recorded("delta", delta), side=LoggedStream("side", log),
        decode_fused_delta=frozenset({"o", "down", "gate_up"}), decode_fused_expand=frozenset({"qkv"}),
    )  # fmt: skip
    for target, in_dim in (("o", CONFIG.hidden_size), ("down", CONFIG.intermediate_size), ("gate_up", CONFIG.hidden_size)):
        t = pool.targets[target]
        x = torch.randn(3, in_dim)
        gemm = torch.nn.Linear(in_dim, t.out_dim, bias=False)
        _, want = unfused.project_deferred(gemm, target, 0, x)
        log.clear()
        y, got = lora.project_deferred(gemm, target, 0, x)
        assert [entry[1] for entry in log] == ["record", "wait_event", "fused", "wait_stream"], target
        assert log[2] == ("side", "fused", t.num_stack, t.output_slices)
        assert torch.equal(y, gemm(x)) and torch.equal(got, want) and want.abs().sum() > 0
    log.clear()
    qkv = torch.nn.Linear(CONFIG.hidden_size, pool.targets["qkv"].out_dim, bias=False)
    _, pending = lora.project_deferred(qkv, "qkv", 0, torch.randn(3, CONFIG.hidden_size))
    assert [entry[1] for entry in log] == ["record", "wait_event", "shrink", "wait_stream"]
    assert isinstance(pending, PendingExpand)


def test_decode_norm_shrink_targets_leave_the_side_stream(stream_log):
    """LoraInputs.decode_norm_shrink: the norm writing q/k/v's input shrinks it too (RMSNorm.add_forward
    fills the NormShrink; on the CPU by the reference shrink), and the projection then runs its GEMM alone,
    with no event, no side stream and no carve-out, handing the expand back pending; it adds what the side
    stream's delta adds. Targets not asked for, or idle in the step, get no NormShrink; a projection whose
    norm was asked for its shrink and did not compute it is an error, never a silent base output."""
    from engine.models.blocks import RMSNorm

    log, _ = stream_log
    pool = LoraSlotPool(CONFIG, num_slots=3, max_rank=8, dtype=torch.float32, device="cpu")
    pool.load(1, packed("all", rank=4))
    meta = SgmvMeta.from_lists([2, 1], [1, pool.base_slot], pool.ranks, pool.scalings)
    ops = sgmv_ops("ref")
    lora = LoraInputs(pool, meta, *ops, side=LoggedStream("side", log), decode_norm_shrink=frozenset({"qkv"}))
    unfused = LoraInputs(pool, meta, *ops, side=LoggedStream("side", log))
    norm = RMSNorm(CONFIG.hidden_size, 1e-5)
    gemm = torch.nn.Linear(CONFIG.hidden_size, pool.targets["qkv"].out_dim, bias=False)
    x, residual = torch.randn(3, CONFIG.hidden_size), torch.randn(3, CONFIG.hidden_size)
    assert lora.norm_shrink("gate_up", 0) is None  # not asked for
    shrink = lora.norm_shrink("qkv", 0)
    h, s = norm.add_forward(x, residual, shrink=shrink)
    assert torch.equal(h, norm(residual + x)) and torch.equal(s, residual + x) and shrink.v is not None
    log.clear()
    with torch.inference_mode():
        y, pending = lora.project_deferred(gemm, "qkv", 0, h)
        assert log == []  # the GEMM alone on the current stream
        assert isinstance(pending, PendingExpand) and pending.v is shrink.v
        want_y, want_delta = unfused.project_deferred(gemm, "qkv", 0, h)
        assert want_delta.abs().sum() > 0
        torch.testing.assert_close(pending.apply(y), want_y + want_delta, atol=1e-6, rtol=0)
    lora.norm_shrink("qkv", 1)  # asked for, never filled
    with pytest.raises(RuntimeError, match="did not compute it"):
        lora.project_deferred(gemm, "qkv", 1, h)
    idle = LoraInputs(pool, meta, *ops, side=LoggedStream("side", log), decode_norm_shrink=frozenset({"qkv"}), idle=frozenset({"qkv"}))
    assert idle.norm_shrink("qkv", 0) is None


def test_the_sm_carveout_is_at_most_half_the_device():
    from engine.lora_inputs import usable_sm_carveout

    assert usable_sm_carveout(32, 132) == 32  # an H100 / H200
    assert usable_sm_carveout(32, 40) == 20  # a T4: 32 would leave 8 SMs to the GEMMs
    assert usable_sm_carveout(0, 132) == 0
    assert usable_sm_carveout(5, 1) == 0
