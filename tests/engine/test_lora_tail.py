"""The LoRA GEMM tail's blocks (engine/lora_tail.py): which adapter each block holds, what is copied in and
when, and the weights' tail rows against the slot pool's B and A. The tokens the tail gives are checked in
tests/engine/test_engine_backends.py (the CPU) and tests/engine/test_gpu.py (CUDA)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.lora_tail import GemmTail, block_variants

ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=31),
    "all": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=32),
    "mlp": dict(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], seed=33),
}


@pytest.fixture
def engine(tiny_llama_dir, make_adapter, tmp_path):
    """(runner, {name: packed adapter}) of a CPU engine with three slots and a two-block tail."""
    adapters = tuple((name, str(make_adapter(f"tail-{name}", **kwargs))) for name, kwargs in ADAPTERS.items())
    config = EngineConfig(
        model_dir=str(tiny_llama_dir), adapters=adapters, work_dir=str(tmp_path / "work"), max_loras_per_batch=3,
        lora_backend="triton", lora_gemm_tail_blocks=2,
    )  # fmt: skip
    core = EngineCore.build(config)
    packed = {name: asyncio.run(core.prepare(core.resolve_adapter(name))) for name in ADAPTERS}
    return core.workers.local.runner, packed


def assert_block_holds(tail: GemmTail, pool, block: int, slot: int) -> None:
    """Block `block`'s weight rows are slot's B^T (each projection's rows in its own columns, zeros in the
    others') and its A rows slot's A, in every target and layer."""
    for name, target in tail.targets.items():
        width, in_dim = tail.width[name], tail.in_dim[name]
        rows = torch.stack([s[in_dim + block * width : in_dim + (block + 1) * width] for s in tail.storage[name]])
        rows = rows.unflatten(1, (target.num_stack, tail.max_rank))
        for k, (offset, size) in enumerate(target.output_slices):
            torch.testing.assert_close(rows[:, k, :, offset : offset + size], pool.b[name][:, slot, offset : offset + size].transpose(1, 2))
            others = torch.ones(rows.shape[-1], dtype=torch.bool)
            others[offset : offset + size] = False
            assert (rows[:, k, :, others] == 0).all()
        torch.testing.assert_close(tail.a_blocks[name][:, block * width : (block + 1) * width], pool.a[name][:, slot])


def test_blocks_are_reused_evicted_least_recent_first_and_recopied_after_a_reload(engine):
    runner, packed = engine
    tail, pool = runner.gemm_tail, runner.lora_pool
    assert tail is not None and tail.blocks == 2
    pool.load(0, packed["qv"])
    pool.load(1, packed["all"])
    pool.load(2, packed["mlp"])
    base = pool.base_slot

    assert tail.assign(pool, [base, base]) == 0  # no adapter: nothing to cover, nothing copied
    assert tail.copies == 0
    assert tail.assign(pool, [0, base, 1, 0]) == 2
    assert tail.copies == 2 and tail.slot_block.tolist() == [0, 1, -1, -1]
    assert_block_holds(tail, pool, 0, 0)
    assert_block_holds(tail, pool, 1, 1)
    # the linears' weights are views of the storage's head rows, so the base GEMMs read what they read before
    layer = runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.data_ptr() == tail.storage["qkv"][0].data_ptr()
    assert tail.weight("qkv", 0, 2).shape == (tail.storage["qkv"][0].shape[1], tail.in_dim["qkv"] + 2 * tail.width["qkv"])

    assert tail.assign(pool, [1, 0]) == 2 and tail.copies == 2  # both current: no copy
    assert tail.assign(pool, [1]) == 2  # block 1 used last; slot 0's block 0 is now the least recent
    assert tail.assign(pool, [2]) == 1  # slot 2 takes block 0, slot 0 loses it
    assert tail.copies == 3 and tail.slot_block.tolist() == [-1, 1, 0, -1]
    assert_block_holds(tail, pool, 0, 2)

    pool.load(1, packed["qv"])  # slot 1 now holds another adapter: its block is stale
    assert tail.assign(pool, [1, 2]) == 2 and tail.copies == 4
    assert_block_holds(tail, pool, 1, 1)
    assert tail.assign(pool, [0, 1, 2]) is None  # three adapters, two blocks: the step runs in line
    assert tail.copies == 4 and tail.slot_block.tolist() == [-1, 1, 0, -1]


def test_rank_zero_and_cleared_slots_take_no_block(engine):
    runner, packed = engine
    tail, pool = runner.gemm_tail, runner.lora_pool
    pool.load(0, packed["qv"])
    pool.clear(1)
    assert tail.adapted(pool, [1, pool.base_slot, 0, 0]) == [0]
    assert tail.assign(pool, [1, 0]) == 1 and tail.copies == 1


def test_step_graph_block_variants():
    """A tailed step graph per power of two below the blocks and one for all of them: a step replays the
    smallest that covers its highest block."""
    assert block_variants(1) == (1,)
    assert block_variants(3) == (1, 2, 3)
    assert block_variants(4) == (1, 2, 4)
    assert block_variants(8) == (1, 2, 4, 8)
    assert block_variants(12) == (1, 2, 4, 8, 12)
