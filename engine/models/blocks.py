"""The blocks every dense decoder family is built from, over a paged KV cache; fused q/k/v and gate/up.

RMSNorm, attention with RoPE over the paged KV cache, the gated MLP, the decoder layer and the causal-LM
body. A family's model file (engine/models/llama.py, qwen3.py) picks or extends them; its spec
(loraformat.architectures) says which checkpoint tensors fill them.

Parameter names are Hugging Face's without the leading "model." and with q/k/v fused into
`self_attn.qkv_proj` (rows: q, then k, then v) and gate/up into `mlp.gate_up_proj` (rows: gate, then up).

Tensor parallelism (engine/parallel.py): q/k/v and gate/up are column-parallel, o and down row-parallel;
a rank holds its heads, KV heads and MLP features (`self.config` is that rank's view, `full_config` the
checkpoint's), and o's and down's partial sums are all-reduced after their LoRA delta is added.
Embeddings and the LM head are replicated on every rank.

LoRA seam: every linear is applied through one `project_*` method of its module (`Attention.project_qkv`,
`Attention.project_o`, `MLP.project_gate_up`, `MLP.project_down`), which returns the output and the LoRA
delta still to add to it (None when added in line). A delta computed beside the base GEMM (CUDA decode
steps, `LoraInputs.project_deferred`) is added by the kernel that reads the output next, as it loads it:
RoPE's KV write, SiLU-mul, or the residual add before the next norm; a path without such a kernel adds it
at once (`_plus`). In a prefill-sized CUDA step gate/up's expand itself is pending (`PendingExpand`): the
SiLU-mul kernel computes and adds it as it loads gate_up; with --lora-decode-fused-expand a decode step's
q/k/v or gate/up expand is pending too, for the RoPE/KV-write or SiLU-mul kernel, and with
--lora-decode-norm-shrink its shrink is done by the RMSNorm kernel before the GEMM. Under tensor
parallelism o's and down's deltas are added before the all-reduce.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_inputs import AttentionInputs, KVBuffers
from engine.lora_inputs import LoraInputs, NormShrink, PendingExpand, tuned_gemm
from engine.model_config import ModelConfig
from engine.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel, local_config
from engine.rope import apply_rope, cos_sin_cache

Pending = torch.Tensor | PendingExpand | None  # a LoRA delta (or its expand) still to add to a projection's output


def _plus(y: torch.Tensor, delta: Pending) -> torch.Tensor:
    if isinstance(delta, PendingExpand):
        return delta.apply(y)
    return y if delta is None else y.add_(delta)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        # Normalise in fp32, scale in the model dtype: the order transformers uses, so bf16 rounds alike.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        delta: Pending = None,
        out: torch.Tensor | None = None,
        shrink: NormShrink | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x, residual: [T, hidden] -> (normed, residual + x)
        """Add x (plus its pending LoRA delta) to the residual stream (None: x starts it) and normalise
        the sum; one kernel on CUDA, rounding where the PyTorch path rounds (lorakernels/rmsnorm.py).
        out: where the normed rows go (the head of a LoRA tail's x_aug, LoraInputs.tail_head), or None.
        shrink: the next projection's LoRA shrink of the normed rows, whose v this fills (LoraInputs.norm_shrink;
        in the same kernel on CUDA, lorakernels/norm_shrink.py), or None."""
        if x.is_cuda:
            from lorakernels.rmsnorm import (  # Triton: imported only where it runs
                add_rmsnorm,
                add_rmsnorm_expand,
            )

            if isinstance(delta, PendingExpand):  # o's or down's expand (a prefill-sized step's), done as x loads
                normed, s = add_rmsnorm_expand(x, residual, self.weight, self.eps, delta.v, delta.b, delta.meta, out=out)
            elif shrink is not None and shrink.counters is not None:
                from lorakernels.norm_shrink import add_rmsnorm_shrink

                normed, s, shrink.v = add_rmsnorm_shrink(
                    x, residual, self.weight, self.eps, shrink.a, shrink.meta, num_stack=shrink.num_stack,
                    counters=shrink.counters, delta=delta, out=out,
                )  # fmt: skip
                return normed, s
            else:
                normed, s = add_rmsnorm(x, residual, self.weight, self.eps, delta, out=out)
        else:
            x = _plus(x, delta)
            s = x if residual is None else residual + x
            normed = self(s)
            normed = normed if out is None else out.copy_(normed)
        if shrink is not None:
            shrink.apply(normed)
        return normed, s


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel = SINGLE, **factory):
        super().__init__()
        self.config, self.layer_id, self.tp = local_config(config, tp), layer_id, tp
        q, kv = config.q_size, config.kv_size
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, (q, kv, kv), config.qkv_bias, tp, **factory)
        self.o_proj = RowParallelLinear(q, config.hidden_size, config.o_bias, tp, **factory)
        self.scale = config.head_dim**-0.5

    def project_qkv(self, x: torch.Tensor, lora: LoraInputs | None) -> tuple[torch.Tensor, Pending]:
        # x: [T, hidden] -> [T, q_size + 2 * kv_size]
        return (tuned_gemm(self.qkv_proj, "qkv", x), None) if lora is None else lora.project_deferred(self.qkv_proj, "qkv", self.layer_id, x)

    def project_o(self, x: torch.Tensor, lora: LoraInputs | None) -> tuple[torch.Tensor, Pending]:
        # x: [T, q_size] -> y: [T, hidden], summed over the ranks
        return _row_parallel(self.o_proj, "o", self.layer_id, self.tp, x, lora)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A family's per-head transform of q and k before RoPE; none in the Llama family."""
        return q, k

    def _can_fuse_rope(self, qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """RoPE and the KV write in one kernel (lorakernels/rope_kv.py): on CUDA, when nothing transforms q
        and k between the projection and RoPE and the cache holds the model dtype."""
        return qkv.is_cuda and type(self).norm_qk is Attention.norm_qk and k_cache.dtype == qkv.dtype

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,  # [max_positions, head_dim]
        attn: AttentionInputs,
        kv: KVBuffers,
        lora: LoraInputs | None = None,
    ) -> tuple[torch.Tensor, Pending]:  # [T, hidden] and its pending LoRA delta
        c = self.config
        qkv, delta = self.project_qkv(x, lora)  # [T, q_size + 2 * kv_size]
        k_cache, v_cache = kv.k[self.layer_id], kv.v[self.layer_id]
        if self._can_fuse_rope(qkv, k_cache):
            from lorakernels.rope_kv import rope_kv_write  # Triton: imported only where it runs

            # a pending expand (a decode step's, engine/lora_inputs.py) is done by the kernel itself
            expand = (delta.v, delta.b, delta.meta) if isinstance(delta, PendingExpand) else None
            q = rope_kv_write(
                qkv, positions, cos_sin, k_cache, v_cache, attn.out_cache_loc,
                num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                delta=None if expand is not None else delta, expand=expand,
            )  # fmt: skip
            o = attn.attend(q, k_cache, v_cache, self.scale, out=self._o_head(lora, q))  # [T, H, D]
            return self.project_o(o.reshape(-1, c.q_size), lora)
        qkv = _plus(qkv, delta)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)  # [T, H, D]
        k = k.view(-1, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        v = v.view(-1, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        q, k = self.norm_qk(q, k)
        q, k = apply_rope(q, k, positions, cos_sin)
        k_cache[attn.out_cache_loc] = k.to(k_cache.dtype)
        v_cache[attn.out_cache_loc] = v.to(v_cache.dtype)
        o = attn.attend(q, k_cache, v_cache, self.scale, out=self._o_head(lora, q))  # [T, H, D]
        return self.project_o(o.reshape(-1, c.q_size), lora)

    def _o_head(self, lora: LoraInputs | None, q: torch.Tensor) -> torch.Tensor | None:
        """Where attention writes its output when o's LoRA runs in its GEMM's tail (LoraInputs.tail_head)."""
        head = None if lora is None else lora.tail_head("o", q.shape[0], q)
        return None if head is None else head.unflatten(1, (self.config.num_heads, self.config.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel = SINGLE, **factory):
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(hidden, (inter, inter), config.mlp_bias, tp, **factory)
        self.down_proj = RowParallelLinear(inter, hidden, config.mlp_bias, tp, **factory)

    def project_gate_up(self, x: torch.Tensor, lora: LoraInputs | None) -> tuple[torch.Tensor, Pending]:
        # x: [T, hidden] -> [T, 2 * inter]
        if lora is None:
            return tuned_gemm(self.gate_up_proj, "gate_up", x), None
        return lora.project_deferred(self.gate_up_proj, "gate_up", self.layer_id, x)

    def project_down(self, x: torch.Tensor, lora: LoraInputs | None) -> tuple[torch.Tensor, Pending]:
        # x: [T, inter] -> y: [T, hidden], summed over the ranks
        return _row_parallel(self.down_proj, "down", self.layer_id, self.tp, x, lora)

    def forward(self, x: torch.Tensor, lora: LoraInputs | None = None) -> tuple[torch.Tensor, Pending]:  # x: [T, hidden]
        gate_up, delta = self.project_gate_up(x, lora)  # [T, 2 * inter]
        if gate_up.is_cuda:
            from lorakernels.silu_mul import silu_mul, silu_mul_expand  # Triton: imported only where it runs

            head = None if lora is None else lora.tail_head("down", gate_up.shape[0], gate_up)  # down's LoRA in its GEMM
            if isinstance(delta, PendingExpand):
                out = silu_mul_expand(gate_up, delta.v, delta.b, delta.meta, output_slices=delta.output_slices, out=head)
            else:
                out = silu_mul(gate_up, delta, out=head)
            return self.project_down(out, lora)
        gate, up = _plus(gate_up, delta).chunk(2, dim=-1)  # each [T, inter]
        if lora is not None:
            lora.tail_head("down", gate_up.shape[0], gate_up)  # down's projection copies its input in
        return self.project_down(F.silu(gate) * up, lora)


def _row_parallel(
    linear: RowParallelLinear, target: str, layer: int, tp: TensorParallel, x: torch.Tensor, lora: LoraInputs | None
) -> tuple[torch.Tensor, Pending]:
    """A row-parallel projection summed over the ranks; each rank's LoRA delta is a partial sum too, so
    under tensor parallelism it is added before the all-reduce."""
    if lora is None:
        return tp.all_reduce(tuned_gemm(linear, target, x)), None
    y, delta = lora.project_deferred(linear, target, layer, x)
    if tp.size > 1:
        y, delta = _plus(y, delta), None
    return tp.all_reduce(y), delta


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, attention: type[Attention] = Attention, tp: TensorParallel = SINGLE, **factory
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = attention(config, layer_id, tp, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = MLP(config, layer_id, tp, **factory)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous sublayer's output (the embeddings in layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before x; None in layer 0
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        attn: AttentionInputs,
        kv: KVBuffers,
        lora: LoraInputs | None = None,
        delta: Pending = None,  # x's pending LoRA delta (the previous layer's down projection)
    ) -> tuple[torch.Tensor, torch.Tensor, Pending]:  # (this layer's MLP output, the residual stream before it, the output's pending delta)
        """`h = h + attn(norm(h)); h = h + mlp(norm(h))`, with each add fused into the following norm:
        the stream h is `residual + x (+ delta)` until the next layer (or the final norm) adds it."""
        head = None if lora is None else lora.tail_head("qkv", x.shape[0], x)  # q/k/v's LoRA in its GEMM
        shrink = None if lora is None else lora.norm_shrink("qkv", self.self_attn.layer_id)  # or its shrink in the norm
        h, residual = self.input_layernorm.add_forward(x, residual, delta, out=head, shrink=shrink)
        x, delta = self.self_attn(h, positions, cos_sin, attn, kv, lora)
        head = None if lora is None else lora.tail_head("gate_up", x.shape[0], x)
        shrink = None if lora is None else lora.norm_shrink("gate_up", self.mlp.layer_id)
        h, residual = self.post_attention_layernorm.add_forward(x, residual, delta, out=head, shrink=shrink)
        x, delta = self.mlp(h, lora)
        return x, residual, delta


class DecoderModel(nn.Module):
    """Base model. `forward` returns the final-normed hidden states; `compute_logits` projects the rows
    that need sampling. With tied embeddings there is no `lm_head` and the embedding matrix is used.
    A family subclasses it to name its attention block."""

    attention: type[Attention] = Attention

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.config, self.full_config, self.tp = local_config(config, tp), config, tp
        factory = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.attention, tp, **factory) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        # A plain attribute, not a buffer, so that `.to(dtype)` never rounds it; `set_rope_device` moves it.
        self.cos_sin = cos_sin_cache(config, device=device)  # [max_positions, head_dim] fp32

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionInputs,
        kv: KVBuffers,
        lora: LoraInputs | None = None,  # None: no LoRA in this step (base-model tokens only)
    ) -> torch.Tensor:  # [T, hidden]
        x, residual, delta = self.embed_tokens(input_ids), None, None  # [T, hidden]
        for layer in self.layers:
            x, residual, delta = layer(x, residual, positions, self.cos_sin, attn, kv, lora, delta)
        return self.norm.add_forward(x, residual, delta)[0]

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model's dtype: `sample` takes greedy rows' argmax from
        them as they are (the same ids as from their fp32 copy, which casting bf16 up leaves exact) and
        makes fp32 copies of the other rows only (a [64, 128256] fp32 copy and its argmax cost a decode
        step about 60 us on an H200)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden_rows, weight)

    def set_rope_device(self, device: torch.device | str) -> None:
        """Rebuild the cos/sin table on `device`: after a model built on "meta" gets real weights there."""
        self.cos_sin = cos_sin_cache(self.config, device=device)
