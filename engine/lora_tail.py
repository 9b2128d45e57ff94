"""LoRA in the base GEMMs of prefill-sized steps (EngineConfig.lora_gemm_tail_blocks): the weights' tail rows
and which adapter each block holds.

A projection's LoRA expand costs a prefill step a read and a write of the projection's whole output;
done as part of the base GEMM's reduction (lorakernels/gemm_tail.py) it costs that GEMM
blocks x stack x R / in_dim more FLOPs instead. Each fused target's weight of each layer lies in an
allocation [in + C, out] (the [in, out] row-major storage of linear_weight_layout "in_out"), C =
blocks x stack x max_rank tail rows after the in rows, the linear's weight a view of the first in. Block j's rows hold one slot's B^T (projection k's rank rows in its own output columns, zeros
elsewhere), and `a_blocks` the same slot's A, so one cuBLAS GEMM shrinks a step's rows against every
block at once:

    v_all = x @ a_blocks[:n*W]^T              [T, n * W]     W = stack * max_rank
    tail  = place(v_all)                     each row: its slot's block, scaled; zeros elsewhere
    y     = [x | tail] @ [W | tail rows]^T    one GEMM, the LoRA added in its fp32 accumulator

The kernels that produce x (the residual add + RMSNorm, extend attention, SiLU-mul) write it into the
head of x_aug = [x | tail] (LoraInputs.tail_head), so nothing is copied. `assign` maps a step's slots to
blocks, least recently used first out, and copies a slot's A and B^T in only when it takes a block or was
reloaded since (LoraSlotPool.generations). A step with more adapters than blocks, or fewer than
MIN_TOKENS tokens, keeps the in-line path. One GPU (a row-parallel projection's delta would be summed
over the ranks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from engine.lora_pool import FusedTarget, LoraSlotPool

# Steps of fewer tokens keep the in-line path: decode-sized and small mixed steps, whose GEMMs read
# weights rather than compute, would pay the tail's extra weight rows in bytes.
MIN_TOKENS = 256


def block_variants(blocks: int) -> tuple[int, ...]:
    """The block counts a tailed step graph is captured for: powers of two below `blocks`, and blocks."""
    return tuple(sorted({1 << i for i in range(blocks.bit_length()) if 1 << i < blocks} | {blocks}))


def _linears(model: torch.nn.Module, target: str) -> list[torch.nn.Module]:
    """The linear of fused target `target` in every layer, in layer order."""
    pick = {
        "qkv": lambda layer: layer.self_attn.qkv_proj,
        "o": lambda layer: layer.self_attn.o_proj,
        "gate_up": lambda layer: layer.mlp.gate_up_proj,
        "down": lambda layer: layer.mlp.down_proj,
    }[target]
    return [pick(layer) for layer in model.layers]


class GemmTail:
    """Built before the KV pool is sized (its rows take device memory), over a DecoderModel
    (engine/models/blocks.py, not imported: it imports the LoRA seam that reads this) from the slot pool's
    targets and rank capacity; `assign` then reads that pool."""

    def __init__(self, model: torch.nn.Module, targets: Mapping[str, FusedTarget], max_rank: int, num_slots: int, blocks: int):
        if blocks < 1:
            raise ValueError(f"a GEMM tail needs at least one block, got {blocks}")
        if model.tp.size > 1:
            raise ValueError("the LoRA GEMM tail runs on one GPU only (tensor_parallel_size 1)")
        self.targets, self.max_rank, self.blocks = dict(targets), max_rank, blocks
        self.width = {name: t.num_stack * max_rank for name, t in self.targets.items()}
        self.in_dim = {name: t.in_dim for name, t in self.targets.items()}
        # target -> each layer's [in + blocks * W, out]: one allocation a layer, so building the tail holds
        # one layer's weight twice at most, not a whole target's (gate/up: 7.5 GB at Llama-3-8B)
        self.storage: dict[str, list[torch.Tensor]] = {}
        self.a_blocks: dict[str, torch.Tensor] = {}  # target -> [layers, blocks * W, in]
        # target -> projection k -> block j -> each layer's rows of k's B^T in block j, k's columns only
        # (the other columns stay zero from the start), made once for `_copy_in`'s multi-tensor copies
        self._b_views: dict[str, list[list[list[torch.Tensor]]]] = {}
        device = model.embed_tokens.weight.device
        with torch.no_grad():
            for name, target in self.targets.items():
                linears = _linears(model, name)
                in_dim, width = target.in_dim, self.width[name]
                layers = []
                for linear in linears:
                    old = linear.weight
                    storage = torch.zeros(in_dim + blocks * width, target.out_dim, dtype=old.dtype, device=old.device)
                    storage[:in_dim].copy_(old.t())
                    linear.weight = torch.nn.Parameter(storage[:in_dim].t(), requires_grad=old.requires_grad)
                    del old
                    layers.append(storage)
                self.storage[name] = layers
                self.a_blocks[name] = torch.zeros(len(layers), blocks * width, in_dim, dtype=layers[0].dtype, device=device)
                self._b_views[name] = [
                    [
                        [s[in_dim + j * width + k * max_rank : in_dim + j * width + (k + 1) * max_rank, offset : offset + size] for s in layers]
                        for j in range(blocks)
                    ]
                    for k, (offset, size) in enumerate(target.output_slices)
                ]
        # the block each slot owns (-1 none), read by the placement kernel; one address for CUDA graphs
        self.slot_block = torch.full((num_slots + 1,), -1, dtype=torch.int32, device=device)
        self._host_slot_block = [-1] * (num_slots + 1)
        self._block_slot = [-1] * blocks  # the slot each block holds
        self._block_generation = [0] * blocks  # the slot's LoraSlotPool.generations when copied in
        self._last_use = [0] * blocks
        self._steps = 0
        self.copies = 0  # slots copied into a block so far (a test reads it)

    def adapted(self, pool: LoraSlotPool, slots: Iterable[int]) -> list[int]:
        """The distinct slots among `slots` that hold an adapter, in order."""
        return [s for s in dict.fromkeys(slots) if s != pool.base_slot and pool.ranks[s] > 0]

    def assign(self, pool: LoraSlotPool, slots: Iterable[int]) -> int | None:
        """Give each adapted slot among `slots` a block, copying in the slots that lack a current one (on
        the current stream, after the slot loads the caller waited for). Returns the blocks a GEMM must
        cover (the highest block used + 1; 0: no adapter), or None when the slots outnumber the blocks."""
        want = self.adapted(pool, slots)
        if len(want) > self.blocks:
            return None
        self._steps += 1
        wanted = set(want)
        changed = False
        for slot in want:
            block = self._host_slot_block[slot]
            if block < 0 or self._block_generation[block] != pool.generations[slot]:
                if block < 0:
                    block = min(
                        (j for j in range(self.blocks) if self._block_slot[j] not in wanted),
                        key=lambda j: (self._block_slot[j] >= 0, self._last_use[j]),
                    )
                    if self._block_slot[block] >= 0:
                        self._host_slot_block[self._block_slot[block]] = -1
                    self._block_slot[block] = slot
                    self._host_slot_block[slot] = block
                    changed = True
                self._copy_in(pool, block, slot)
                self._block_generation[block] = pool.generations[slot]
            self._last_use[block] = self._steps
        if changed:
            staged = torch.tensor(self._host_slot_block, dtype=torch.int32)
            if self.slot_block.is_cuda:
                staged = staged.pin_memory()
            self.slot_block.copy_(staged, non_blocking=True)
        return max((self._host_slot_block[s] for s in want), default=-1) + 1

    def _copy_in(self, pool: LoraSlotPool, block: int, slot: int) -> None:
        """Block `block`'s weight rows and A rows of every target <- slot `slot`'s B^T and A: per target
        and projection one multi-tensor copy over the layers (the pool keeps B zero past a slot's rank,
        and each projection's rows zero outside its columns were never written)."""
        self.copies += 1
        with torch.no_grad():
            for name, target in self.targets.items():
                width = self.width[name]
                for k, (offset, size) in enumerate(target.output_slices):
                    source = pool.b[name][:, slot, offset : offset + size].transpose(1, 2)  # [layers, R, size]
                    torch._foreach_copy_(self._b_views[name][k][block], list(source.unbind(0)))
                self.a_blocks[name][:, block * width : (block + 1) * width].copy_(pool.a[name][:, slot])

    def weight(self, target: str, layer: int, blocks: int) -> torch.Tensor:
        """The logical [out, in + blocks * W] weight of `target` in `layer` with its first blocks' tail rows."""
        return self.storage[target][layer][: self.in_dim[target] + blocks * self.width[target]].t()

    def shrink_weight(self, target: str, layer: int, blocks: int) -> torch.Tensor:
        """[blocks * W, in]: the first blocks' A, the every-block shrink's weight."""
        return self.a_blocks[target][layer, : blocks * self.width[target]]
