"""The pinned arena packed adapters live in with --host-pinned-gb (engine/pinned_arena.py), on the CPU
(an unpinned buffer stands in for the page-locked one): first-fit blocks in whole granules, neighbours
merged when freed, a block lent again only after the copy that reads it, and pack_adapter's use of it."""

from __future__ import annotations

import gc
import io
import threading
from pathlib import Path

import pytest
import torch

from engine.adapter_cache import pack_adapter
from engine.lora_pool import FusedTarget, fused_targets
from engine.pinned_arena import HostReads, PinnedArena
from loraformat.architectures import Split
from loraformat.peft_compile import FORMAT, FORMAT_VERSION, CanonicalAdapter, read_canonical
from loraformat.safetensors_io import TensorViews, write_safetensors
from tests.engine.test_lora_slots import CONFIG, MODULES, canonical

KB = 1024


class FakeEvent:
    def __init__(self):
        self.passed = False

    def query(self) -> bool:
        return self.passed


def arena(granules: int = 8) -> PinnedArena:
    return PinnedArena(granules * KB, pin=False, granule=KB)


def test_blocks_are_first_fit_whole_granules_and_merge_when_freed():
    a = arena(8)
    assert a.capacity == 8 * KB and a.free_bytes == 8 * KB
    assert a.take(1) == (0, KB)  # rounded up to a granule
    assert a.take(2 * KB + 1) == (KB, 3 * KB)
    assert a.take(4 * KB) == (4 * KB, 4 * KB)
    assert a.take(1) is None and a.num_misses == 1 and a.num_blocks == 3
    a.give_back(KB, 3 * KB, HostReads())
    assert a.take(4 * KB) is None  # 3 granules free, not 4
    a.give_back(0, KB, HostReads())  # merges with the run after it
    assert a.take(4 * KB) == (0, 4 * KB)
    a.give_back(0, 4 * KB, HostReads())
    a.give_back(4 * KB, 4 * KB, HostReads())  # and with the run before it: whole again
    assert a.free_bytes == 8 * KB and a.num_blocks == 0
    assert a.take(8 * KB) == (0, 8 * KB)
    with pytest.raises(ValueError, match="positive size"):
        PinnedArena(0, pin=False)


def test_a_block_still_read_by_a_queued_copy_is_not_lent_again():
    a = arena(2)
    block = a.take(2 * KB)
    event = FakeEvent()
    a.give_back(*block, HostReads(event))
    assert a.take(KB) is None and a.num_blocks == 1  # the copy out of it has not run yet
    event.passed = True
    assert a.take(KB) == (0, KB)


def test_blocks_come_back_from_other_threads():
    a = arena(64)
    blocks = [a.take(KB) for _ in range(64)]
    threads = [threading.Thread(target=a.give_back, args=(*b, HostReads())) for b in blocks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.free_bytes == 64 * KB and a.take(64 * KB) == (0, 64 * KB)


def test_packed_adapters_live_in_the_arena_and_give_their_block_back_when_collected():
    targets = {t.name: t for t in fused_targets(CONFIG)}
    adapter = canonical(4, MODULES, seed=3)
    plain = pack_adapter("d", adapter, targets, torch.float32, pin=False)
    size = sum(t.nbytes for t in (*plain.a.values(), *plain.b.values()))
    big = PinnedArena(4 * size, pin=False, granule=4 * KB)
    packed = pack_adapter("d", adapter, targets, torch.float32, pin=True, arena=big)
    start, end = big.buffer.data_ptr(), big.buffer.data_ptr() + big.capacity
    for name in plain.a:
        for got, want in ((packed.a[name], plain.a[name]), (packed.b[name], plain.b[name])):
            assert torch.equal(got, want) and got.is_contiguous()
            assert start <= got.data_ptr() and got.data_ptr() + got.nbytes <= end
    ptrs = sorted(t.data_ptr() for t in (*packed.a.values(), *packed.b.values()))
    assert len(set(ptrs)) == len(ptrs)  # each tensor its own bytes
    assert big.num_blocks == 1 and big.free_bytes < big.capacity
    event = FakeEvent()
    packed.reads.event = event  # as LoraSlotPool.load notes its copy
    del packed
    gc.collect()
    assert big.free_bytes < big.capacity and big.num_blocks == 1  # back, not lendable until the copy has run
    event.passed = True
    assert big.free_bytes == big.capacity and big.num_blocks == 0


def test_an_adapter_the_arena_cannot_hold_is_pinned_as_before(monkeypatch):
    import engine.adapter_cache as adapter_cache

    placed = []
    monkeypatch.setattr(adapter_cache, "_empty", lambda shape, dtype, pin, share: placed.append(pin) or torch.empty(shape, dtype=dtype))
    targets = {t.name: t for t in fused_targets(CONFIG)}
    small = PinnedArena(KB, pin=False, granule=KB)
    packed = pack_adapter("d", canonical(4, MODULES), targets, torch.float32, pin=True, arena=small)
    assert small.num_misses == 1 and small.num_blocks == 0 and placed and all(placed)
    assert all(not (small.buffer.data_ptr() <= t.data_ptr() < small.buffer.data_ptr() + KB) for t in packed.a.values())
    # unpinned (CPU) and shared (tensor-parallel) packs never use it
    pack_adapter("d", canonical(4, MODULES), targets, torch.float32, pin=False, arena=small)
    assert small.num_misses == 1


def test_a_pack_that_fails_in_the_arena_gives_its_block_back(monkeypatch):
    import engine.adapter_cache as adapter_cache

    def broken(adapter, target, a, b):
        raise MemoryError("copy failed")

    monkeypatch.setattr(adapter_cache, "_fill", broken)
    targets = {t.name: t for t in fused_targets(CONFIG)}
    big = PinnedArena(64 * KB * KB, pin=False, granule=KB)
    with pytest.raises(MemoryError, match="copy failed"):
        pack_adapter("d", canonical(4, MODULES), targets, torch.float32, pin=True, arena=big)
    assert big.free_bytes == big.capacity and big.num_blocks == 0 and big.num_lent == 1


def expected_pack(adapter, target) -> tuple[torch.Tensor, torch.Tensor]:
    """A target's packed A and B built the plain way: zeros, then each present projection copied in."""
    r = adapter.rank
    a = torch.zeros(adapter.num_layers, target.num_stack * r, target.in_dim)
    b = torch.zeros(adapter.num_layers, target.out_dim, r)
    for layer in range(adapter.num_layers):
        for k, module in enumerate(target.modules):
            weights = adapter.module_weights(layer, module)
            if weights is not None:
                offset, size = target.output_slices[k]
                a[layer, k * r : (k + 1) * r] = weights[0]
                b[layer, offset : offset + size] = weights[1]
    return a, b


def as_artifact(adapter: CanonicalAdapter, dtype_a: torch.dtype, dtype_b: torch.dtype, path: Path | None = None) -> CanonicalAdapter:
    """The adapter written as a canonical artifact (lora_A tensors of `dtype_a`, lora_B of `dtype_b`)
    and read back as the engine reads one (tensors: TensorViews): from its bytes in memory, as fetched,
    or from a file at `path` (memory-mapped), as a local adapter."""
    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "base_model": adapter.base_model,
        "num_layers": str(adapter.num_layers), "rank": str(adapter.rank), "alpha": str(adapter.alpha),
        "scaling": str(adapter.scaling), "use_rslora": "false", "target_modules": ",".join(adapter.target_modules),
    }  # fmt: skip
    tensors = {name: t.to(dtype_a if name.endswith("A") else dtype_b) for name, t in adapter.tensors.items()}
    if path is not None:
        write_safetensors(path, tensors, metadata)
        read = read_canonical(path)
    else:
        out = io.BytesIO()
        write_safetensors(out, tensors, metadata)
        read = read_canonical(memoryview(bytearray(out.getvalue())))
    assert isinstance(read.tensors, TensorViews)
    return read


F32, BF16 = torch.float32, torch.bfloat16
SOURCES = {  # how the adapter reaches pack_adapter: artifact dtypes of A and B, its pieces' smallest common
    # row, the packed dtype; None: in memory, copied tensor by tensor
    "tensors": None,
    "bytes": ((F32, F32), 256, F32),  # the packed dtype: gathered from its bytes
    "file": ((F32, F32), 256, F32),  # the same from a memory-mapped file
    "to-f32": ((BF16, BF16), 64, F32),  # another dtype: gathered, then converted
    "to-bf16": ((F32, F32), 256, BF16),  # PEFT's fp32 adapters into a bf16 engine
    "mixed": ((F32, BF16), 64, F32),  # two dtypes: its tensors viewed and copied
    "fine": ((F32, F32), 1 << 20, F32),  # rows too fine to gather: viewed and copied
}


@pytest.mark.parametrize(
    "where,source",
    [("arena", "tensors"), ("fresh", "tensors"), ("arena", "bytes"), ("arena", "to-bf16"), *(("fresh", s) for s in SOURCES if s != "tensors")],
)
def test_a_pack_writes_every_element_of_memory_it_did_not_zero_first(monkeypatch, tmp_path, where, source):
    """Packed tensors are allocated uninitialized (an arena block, fresh pinned or plain memory) and
    written once: the projections an adapter lacks (k_proj in a q/v adapter's q/k/v stack, v_proj in one
    layer, the MLP stack's down_proj here) come out as zeros, not as what the memory held before (NaN
    bytes here), and the rest as the adapter's weights, from each source (SOURCES). An artifact gathered
    from its bytes has no view made of its tensors."""
    import engine.adapter_cache as adapter_cache

    adapter = canonical(4, ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj"), seed=5)
    del adapter.tensors["layers.1.v_proj.lora_A"], adapter.tensors["layers.1.v_proj.lora_B"]
    views: list[str] = []  # the artifact tensors packing made a view of
    dtype = F32
    if SOURCES[source] is not None:
        dtypes, min_row, dtype = SOURCES[source]
        adapter = as_artifact(adapter, *dtypes, path=tmp_path / "artifact" if source == "file" else None)
        sf = adapter.tensors._sf
        monkeypatch.setattr(sf, "tensor", lambda name, make=sf.tensor: views.append(name) or make(name))
        monkeypatch.setattr(adapter_cache, "MIN_GATHER_ROW", min_row)
    targets = {t.name: t for t in fused_targets(CONFIG)}
    dirty = PinnedArena(64 * KB * KB, pin=False, granule=KB)
    dirty.buffer.fill_(0xFF)  # NaN in every float32 and bfloat16
    if where == "fresh":
        monkeypatch.setattr(
            adapter_cache, "_empty", lambda shape, dtype, pin, share: torch.full(shape, float("nan"), dtype=dtype)
        )  # fmt: skip
    packed = pack_adapter("d", adapter, targets, dtype, pin=True, arena=dirty if where == "arena" else None)
    assert len(views) == (len(adapter.tensors) if source in ("mixed", "fine") else 0)
    assert dirty.num_blocks == (1 if where == "arena" else 0)
    assert set(packed.a) == {"qkv", "o", "gate_up"}  # down_proj: no projection of its target, left out
    for name, (a, b) in ((n, expected_pack(adapter, targets[n])) for n in packed.a):
        assert packed.a[name].dtype == packed.b[name].dtype == dtype
        assert torch.equal(packed.a[name], a.to(dtype)) and torch.equal(packed.b[name], b.to(dtype)), name
    qkv = targets["qkv"]
    assert not packed.a["qkv"][:, 4:8].any() and not packed.b["qkv"][:, qkv.output_slices[1][0] : qkv.output_slices[2][0]].any()
    assert not packed.a["qkv"][1, 8:12].any() and packed.a["qkv"][0, 8:12].any()


def test_artifacts_of_one_header_share_a_gather_plan_and_keep_their_own_bytes(monkeypatch):
    """Adapters of one shape, rank, alpha and targets have the same artifact header: the gather plan is
    made once for all of them (per target), and each packs its own weights by it, not the first one's."""
    import engine.adapter_cache as adapter_cache
    import loraformat.safetensors_io as safetensors_io

    monkeypatch.setattr(safetensors_io, "_HEADERS", safetensors_io._ParsedHeaders(8))  # none parsed before
    plans = []
    real = adapter_cache._gather_plan
    monkeypatch.setattr(adapter_cache, "_gather_plan", lambda *args: plans.append(args[2].name) or real(*args))
    modules = ("q_proj", "v_proj", "o_proj")
    first, second = (canonical(4, modules, seed=seed, scaling=1.5) for seed in (41, 42))
    del first.tensors["layers.1.v_proj.lora_A"], first.tensors["layers.1.v_proj.lora_B"]
    del second.tensors["layers.1.v_proj.lora_A"], second.tensors["layers.1.v_proj.lora_B"]
    targets = {t.name: t for t in fused_targets(CONFIG)}
    for adapter in (first, second, first):
        artifact = as_artifact(adapter, F32, F32)
        packed = pack_adapter("d", artifact, targets, F32, pin=False)
        for name in packed.a:
            a, b = expected_pack(adapter, targets[name])
            assert torch.equal(packed.a[name], a) and torch.equal(packed.b[name], b), name
    assert sorted(plans) == ["o", "qkv"]  # one plan per target for the three artifacts of one header
    third = canonical(4, modules, seed=43, scaling=1.5)  # all of v_proj: another header, its own plans
    packed = pack_adapter("d", as_artifact(third, F32, F32), targets, F32, pin=False)
    assert sorted(plans) == ["o", "o", "qkv", "qkv"]
    assert torch.equal(packed.a["qkv"], expected_pack(third, targets["qkv"])[0])


def test_a_gather_whose_zeros_outweigh_the_artifact_zeroes_them_all(monkeypatch):
    """Missing pieces' rows are taken from anywhere (capped at the data region's end) and then zeroed:
    an artifact of one projection in one layer (k_proj of layer 0, rank 1) packs into a q/k stack of
    three layers three times its size, zeros everywhere but there."""
    import engine.adapter_cache as adapter_cache

    monkeypatch.setattr(adapter_cache, "MIN_GATHER_ROW", 1)
    gen = torch.Generator().manual_seed(3)
    k_a, k_b = torch.randn(1, 64, generator=gen), torch.randn(64, 1, generator=gen)
    tensors = {"layers.0.k_proj.lora_A": k_a, "layers.0.k_proj.lora_B": k_b}
    adapter = as_artifact(CanonicalAdapter("tiny", 3, 1, 1.0, 1.0, False, ("k_proj",), {}, tensors), F32, F32)
    target = FusedTarget("qk", ("q_proj", "k_proj"), 64, ((0, 64), (64, 64)), Split.COLUMN)
    packed = pack_adapter("d", adapter, {"qk": target}, F32, pin=False)
    a, b = packed.a["qk"], packed.b["qk"]
    assert a.shape == (3, 2, 64) and b.shape == (3, 128, 1)
    assert torch.equal(a[0, 1:], k_a) and torch.equal(b[0, 64:], k_b)
    a[0, 1:], b[0, 64:] = 0, 0
    assert not a.any() and not b.any()


def test_an_artifact_piece_of_the_wrong_size_is_refused_by_name():
    """An artifact read without the model's shape whose tensor does not fit its target's width."""
    tensors = {"layers.0.q_proj.lora_A": torch.ones(2, 32), "layers.0.q_proj.lora_B": torch.ones(64, 2)}
    adapter = as_artifact(CanonicalAdapter("tiny", 1, 2, 2.0, 1.0, False, ("q_proj",), {}, tensors), F32, F32)
    target = FusedTarget("qk", ("q_proj", "k_proj"), 64, ((0, 64), (64, 64)), Split.COLUMN)
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj\.lora_A: 256 bytes where target qk holds 512"):
        pack_adapter("d", adapter, {"qk": target}, F32, pin=False)


def test_the_default_arena_holds_the_host_cache_within_its_ceilings():
    from engine.pinned_arena import AUTO_MAX_BYTES, auto_arena_bytes

    gib = 1 << 30
    assert auto_arena_bytes(10 << 20, 64, 512 * gib) == 640 << 20  # the host cache's adapters at full rank
    assert auto_arena_bytes((10 << 20) + 1, 64, 512 * gib) == 64 * (11 << 20)  # each block whole granules
    assert auto_arena_bytes(336 << 20, 64, 512 * gib) == AUTO_MAX_BYTES == 4 * gib
    assert auto_arena_bytes(336 << 20, 64, 16 * gib) == 2 * gib  # an eighth of a small host
    assert auto_arena_bytes(10 << 20, 0, 512 * gib) == auto_arena_bytes(10 << 20, 64, 0) == 0


def test_full_rank_adapters_fill_the_default_arena_exactly(tmp_path):
    """packed_bytes is what a pack of a full-rank adapter on every target asks of the arena: an arena
    of auto_arena_bytes for 3 holds 3 such packs, and nothing more."""
    from engine.adapter_cache import ARENA_ALIGN, packed_bytes
    from engine.pinned_arena import auto_arena_bytes

    targets = {t.name: t for t in fused_targets(CONFIG)}
    nbytes = packed_bytes(targets.values(), CONFIG.num_layers, 8, torch.float32)
    plain = pack_adapter("d", canonical(8, MODULES), targets, torch.float32, pin=False)
    aligned = sum(-(-t.nbytes // ARENA_ALIGN) * ARENA_ALIGN for t in (*plain.a.values(), *plain.b.values()))
    assert nbytes == aligned
    arena = PinnedArena(auto_arena_bytes(nbytes, 3, 1 << 40, granule=4 * KB), pin=False, granule=4 * KB)
    packs = [pack_adapter(f"d{i}", canonical(8, MODULES, seed=i), targets, torch.float32, pin=True, arena=arena) for i in range(3)]
    assert arena.num_blocks == 3 and arena.num_misses == 0 and arena.take(nbytes) is None
    assert len(packs) == 3


def test_host_memory_is_the_lower_of_the_host_and_its_container_limit(tmp_path):
    from engine.host_memory import host_memory_bytes

    physical = host_memory_bytes(limits=())
    assert physical > 0
    (tmp_path / "v2").write_text("max\n")
    (tmp_path / "v1").write_text(f"{1 << 30}\n")
    assert host_memory_bytes(limits=(str(tmp_path / "v2"),)) == physical  # no limit
    assert host_memory_bytes(limits=(str(tmp_path / "missing"), str(tmp_path / "v1"))) == min(physical, 1 << 30)


@pytest.mark.parametrize("modules", [(), ("q_proj", "v_proj")])
def test_max_packed_bytes_cover_a_slot_of_the_pool(tiny_llama_dir, tmp_path, modules):
    """The engine's largest pack at --max-lora-rank holds one slot's bytes, plus at most the alignment
    of each target's two tensors."""
    from engine.adapter_cache import ARENA_ALIGN
    from engine.config import EngineConfig
    from engine.core import EngineCore

    config = EngineConfig(model_dir=str(tiny_llama_dir), work_dir=str(tmp_path), max_lora_rank=8, lora_target_modules=modules)
    core = EngineCore.build(config)
    try:
        pool = core.workers.local.runner.lora_pool
        one_slot = sum(t[:, 0].numel() * t.element_size() for buffers in (pool.a, pool.b) for t in buffers.values())
        assert one_slot <= core.max_packed_bytes() < one_slot + 2 * len(pool.a) * ARENA_ALIGN
    finally:
        core.close()


def test_the_arena_by_default_on_cuda_only_and_a_refused_one_falls_back(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    """host_pinned_gb None (the default): no arena and no warning off CUDA; on one CUDA rank, an arena
    of auto_arena_bytes, none if the driver refuses to page-lock it (logged), where an explicit size's
    refusal fails the start. An explicit size off CUDA is warned about."""
    import dataclasses

    from engine import core as core_module
    from engine.config import EngineConfig
    from engine.core import EngineCore

    config = EngineConfig(model_dir=str(tiny_llama_dir), work_dir=str(tmp_path / "a"), max_loras_per_batch=2, max_host_adapters=3)
    core = EngineCore.build(config)
    assert core.pinned_arena is None and "host-pinned-gb" not in caplog.text
    explicit = EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir), work_dir=str(tmp_path / "b"), host_pinned_gb=1))
    assert explicit.pinned_arena is None and "--host-pinned-gb has no effect here" in caplog.text

    taken = []

    class Arena:  # stands in for the page-locked buffer
        def __init__(self, nbytes):
            if refuse:
                raise RuntimeError("page-locking failed (cudaError 2)")
            taken.append(nbytes)

    def on_cuda(gb):  # the same core as if it served one CUDA rank; pinned_arena computed afresh
        core.config = dataclasses.replace(core.config, device="cuda:0", host_pinned_gb=gb)
        core.__dict__.pop("pinned_arena", None)
        return core.pinned_arena

    monkeypatch.setattr(core_module, "PinnedArena", Arena)
    monkeypatch.setattr(core_module, "host_memory_bytes", lambda: 64 << 30)
    refuse = False
    block = -(-core.max_packed_bytes() // (1 << 20)) << 20  # whole granules
    assert isinstance(on_cuda(None), Arena) and taken == [(2 + 3) * block]  # slots' and cached others
    assert isinstance(on_cuda(0.5), Arena) and taken[-1] == 1 << 29
    assert on_cuda(0) is None
    refuse = True
    assert on_cuda(None) is None and "no pinned arena (page-locking failed" in caplog.text
    with pytest.raises(RuntimeError, match="page-locking failed"):
        on_cuda(0.5)
    core.close()
    explicit.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_view_is_the_bytes_it_names(dtype):
    """An arena view is the buffer's bytes [offset, offset + nbytes), shaped and typed as asked, written
    through in both directions."""
    a = PinnedArena(8 * KB, pin=False, granule=KB)
    a.buffer.zero_()
    view = a.view(KB, 2 * 3 * 4 * dtype.itemsize, dtype, (2, 3, 4))
    assert view.shape == (2, 3, 4) and view.dtype == dtype and view.is_contiguous()
    view.copy_(torch.arange(24, dtype=torch.float32).view(2, 3, 4).to(dtype))
    region = a.buffer[KB : KB + view.nbytes].view(dtype).view(2, 3, 4)
    assert torch.equal(region, view) and not a.buffer[: KB].any() and not a.buffer[KB + view.nbytes :].any()
    region[1, 2, 3] = 100
    assert view[1, 2, 3] == 100
    other = a.view(3 * KB, 8 * dtype.itemsize, dtype, (8,))  # another block's view does not overlap
    other.fill_(1)
    assert view[1, 2, 3] == 100 and torch.equal(a.buffer[3 * KB : 3 * KB + other.nbytes].view(dtype), other)
