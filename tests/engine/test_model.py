"""The engine's base model against transformers (the numerical oracle), and the paged attention reference
against naive causal attention."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.attention import eager_backend
from engine.forward_inputs import AttentionInputs, KVBuffers
from engine.model_config import ModelConfig
from engine.models.blocks import DecoderModel
from engine.named_shapes import NAMED_SHAPES
from engine.rope import cos_sin_cache
from engine.weights import load_model, random_model, store_linears_in_out
from loraformat.errors import FailedPrecondition
from lorakernels.attention_ref import extend_attention_ref
from loramux.demo_model import LLAMA3_8B_CONFIG, write_llama_checkpoint

ATOL = 1e-4  # fp32 logits of std ~1; observed differences are ~1e-6

LLAMA31_ROPE = {  # original context 64 puts head_dim 16's frequencies in all three bands
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS: dict[str, dict] = {  # name -> write_llama_checkpoint kwargs; "llama" is the shared tiny_llama_dir
    "llama": {},
    "mistral": {"config": {"model_type": "mistral"}},
    "qwen2": {"config": {"model_type": "qwen2"}},
    # head_dim 24 with hidden 64 / 4 heads: Qwen3's head_dim is independent of hidden_size / heads
    "qwen3": {"config": {"model_type": "qwen3", "head_dim": 24, "tie_word_embeddings": True}},
    "llama_bias": {"config": {"attention_bias": True, "mlp_bias": True}},
    "tied": {"config": {"tie_word_embeddings": True}},
    "llama31_rope": {"config": {"rope_scaling": LLAMA31_ROPE, "max_position_embeddings": 1024}},
    "linear_rope": {"config": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}},
    "sharded": {"num_shards": 3},
}
PROMPT_LENS = (7, 19, 12)
BACKENDS = ("ref", "sdpa")  # attention: lorakernels/attention_ref.py, lorakernels/attention_sdpa.py


# ---------------------------------------------------------------- fixtures and the paged-KV harness


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """name -> (our model, transformers model), each variant written and loaded once per module."""
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple[DecoderModel, torch.nn.Module]] = {}

    def get(name: str):
        if name not in made:
            kwargs = VARIANTS[name]
            path = tiny_llama_dir if not kwargs else tmp_path_factory.mktemp(name)
            if kwargs:
                write_llama_checkpoint(path, **kwargs)
            ours, _ = load_model(path)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            made[name] = (ours, hf)
        return made[name]

    return get


@pytest.fixture(params=list(VARIANTS))
def models(request, checkpoints):
    return checkpoints(request.param)


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [[0, *torch.randint(3, vocab_size, (n - 1,), generator=generator).tolist()] for n in PROMPT_LENS]


class PagedKV:
    """Request rows and KV slots for tests. Slots come from a shuffled free list, so every request's KV
    is scattered over the pool (req_to_token is never the identity). backend picks the attention kernel."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int = 256,
        max_reqs: int = 4,
        max_context: int = 64,
        backend: str = "ref",
    ):
        self.backend = backend
        self.kv = KVBuffers.allocate(config, num_slots, torch.float32, "cpu")
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int32)
        self.free = torch.randperm(num_slots, generator=torch.Generator().manual_seed(1)).tolist()
        self.seq_lens = [0] * max_reqs

    def step(self, model: DecoderModel, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over `chunks` = [(request row, new token ids)]; logits [len(ids), vocab] each."""
        ids, positions, locs = [], [], []
        for row, tokens in chunks:
            start = self.seq_lens[row]
            slots = [self.free.pop() for _ in tokens]
            self.req_to_token[row, start : start + len(tokens)] = torch.tensor(slots, dtype=torch.int32)
            ids += tokens
            positions += range(start, start + len(tokens))
            locs += slots
        rows = [row for row, _ in chunks]
        prefix_lens = [self.seq_lens[row] for row in rows]
        extend_lens = [len(tokens) for _, tokens in chunks]
        metadata = eager_backend(self.backend, self.req_to_token).prepare(rows, prefix_lens, extend_lens)
        attn = AttentionInputs(out_cache_loc=torch.tensor(locs), metadata=metadata)
        for row, tokens in chunks:
            self.seq_lens[row] += len(tokens)
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(positions), attn, self.kv)
            logits = model.compute_logits(hidden)
        return list(logits.split([len(tokens) for _, tokens in chunks]))


def _hf_logits(hf, prompt: list[int]) -> torch.Tensor:  # [len(prompt), vocab]
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


# ---------------------------------------------------------------- model vs transformers


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_extend_batch_of_varied_lengths_matches_hf(models, backend):
    ours, hf = models
    prompts = _prompts(ours.config.vocab_size)
    # Rows out of order, so request b's row is not b.
    logits = PagedKV(ours.config, backend=backend).step(ours, list(zip((2, 0, 3), prompts, strict=True)))
    for got, prompt in zip(logits, prompts, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, _hf_logits(hf, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_by_step_decode_matches_hf_full_sequence(models, backend):
    ours, hf = models
    prompts = _prompts(ours.config.vocab_size, seed=1)
    cache = PagedKV(ours.config, backend=backend)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for pos in range(max(PROMPT_LENS)):
        active = [b for b, prompt in enumerate(prompts) if pos < len(prompt)]
        step = cache.step(ours, [(b, [prompts[b][pos]]) for b in active])  # extend_len 1 each
        for b, logits in zip(active, step, strict=True):
            got[b].append(logits[0])
    for rows, prompt in zip(got, prompts, strict=True):
        torch.testing.assert_close(torch.stack(rows), _hf_logits(hf, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_on_top_of_cached_prefix_matches_one_pass(models, backend):
    ours, hf = models
    prompts = _prompts(ours.config.vocab_size, seed=2)
    cache = PagedKV(ours.config, backend=backend)
    split = (3, 18, 1)  # the second request's rest is one token: a decode row inside an extend batch
    cache.step(ours, [(b, prompt[:k]) for b, (prompt, k) in enumerate(zip(prompts, split, strict=True))])
    rest = cache.step(
        ours, [(b, prompt[k:]) for b, (prompt, k) in enumerate(zip(prompts, split, strict=True))]
    )
    for got, prompt, k in zip(rest, prompts, split, strict=True):
        torch.testing.assert_close(got, _hf_logits(hf, prompt)[k:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_matches_hf_generate(models, backend):
    ours, hf = models
    prompts, num_new = _prompts(ours.config.vocab_size, seed=3), 12
    eos = set(ours.config.eos_token_ids)
    cache = PagedKV(ours.config, backend=backend)
    last = [logits[-1] for logits in cache.step(ours, list(enumerate(prompts)))]
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while True:
        for b, logits in zip(active, last, strict=True):
            outputs[b].append(int(logits.argmax()))
        active = [b for b in active if outputs[b][-1] not in eos and len(outputs[b]) < num_new]
        if not active:
            break
        last = [logits[-1] for logits in cache.step(ours, [(b, [outputs[b][-1]]) for b in active])]
    for prompt, got in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False)
        assert got == want[0, len(prompt) :].tolist()


def test_rope_tables_equal_hf_bit_for_bit(checkpoints):
    for name in ("llama", "llama31_rope", "linear_rope"):
        ours, hf = checkpoints(name)
        positions = torch.arange(ours.config.max_position_embeddings)[None]
        cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        half = ours.config.head_dim // 2
        assert torch.equal(ours.cos_sin[:, :half], cos[0, :, :half]), name
        assert torch.equal(ours.cos_sin[:, half:], sin[0, :, :half]), name
    plain = cos_sin_cache(checkpoints("llama")[0].config)
    assert not torch.equal(plain, checkpoints("llama31_rope")[0].cos_sin[:512])  # scaling took effect


# ---------------------------------------------------------------- loading, configs, random models


def test_load_model_fuses_and_ties(checkpoints):
    tied, _ = checkpoints("tied")
    assert tied.lm_head is None and tied.config.tie_word_embeddings
    qwen, _ = checkpoints("qwen2")
    attn = qwen.layers[0].self_attn
    assert attn.qkv_proj.bias.shape == (qwen.config.q_size + 2 * qwen.config.kv_size,)
    assert attn.o_proj.bias is None and qwen.layers[0].mlp.gate_up_proj.weight.shape == (2 * 176, 64)


def test_missing_lm_head_ties_embeddings(tiny_llama_dir: Path, tmp_path: Path):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    model, config = load_model(tmp_path)
    assert model.lm_head is None and config.tie_word_embeddings


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
            "missing: model.layers.1.self_attn.k_proj",
        ),
        (lambda t: t.update({"model.extra.weight": torch.zeros(2)}), "unexpected: model.extra.weight"),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(175, 64)}),
            "misshapen: model.layers.0.mlp.up_proj.weight (175, 64) != (176, 64)",
        ),
    ],
)
def test_bad_checkpoint_errors_name_the_tensor(tiny_llama_dir: Path, tmp_path: Path, edit, message):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(tmp_path)


def test_model_config_from_hf():
    assert NAMED_SHAPES["llama3-8b"].num_kv_heads == 8 and NAMED_SHAPES["llama3-8b"].head_dim == 128
    assert NAMED_SHAPES["tiny"].intermediate_size == 176
    qwen = ModelConfig.from_hf({**LLAMA3_8B_CONFIG, "model_type": "qwen2", "eos_token_id": [1, 2]})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.eos_token_ids == (1, 2)
    # transformers 5 writes rope_parameters (with rope_theta inside) instead of rope_theta + rope_scaling
    v5 = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 5e5, "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0}  # fmt: skip
    config = ModelConfig.from_hf(v5)
    assert config.rope_theta == 5e5 and config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["original_max_position_embeddings"] == 8192
    with pytest.raises(FailedPrecondition, match="model_type 'gpt2'"):
        ModelConfig.from_hf({**LLAMA3_8B_CONFIG, "model_type": "gpt2", "architectures": []})
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_hf({**LLAMA3_8B_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_random_model_runs_a_forward():
    model = random_model("tiny", device="cpu", seed=5)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(random_model("tiny", seed=5).embed_tokens.weight, model.embed_tokens.weight)
    logits = PagedKV(model.config).step(model, [(0, [0, 5, 9, 11]), (1, [0, 7])])
    assert [tuple(x.shape) for x in logits] == [(4, 512), (2, 512)]
    assert all(torch.isfinite(x).all() for x in logits) and 0.2 < logits[0].std() < 5


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_linears_stored_in_out_keep_their_values_and_logits(tied):
    """EngineConfig.linear_weight_layout "in_out": each parallel linear's weight (and an untied LM head)
    is the same logical [out, in] tensor stored transposed, strides (1, out), and the model computes the
    logits it did; a tied LM head is the embedding and keeps its rows."""
    config = dataclasses.replace(NAMED_SHAPES["tiny"], tie_word_embeddings=tied)
    plain, moved = random_model(config, seed=3), random_model(config, seed=3)
    assert store_linears_in_out(moved) == 4 * config.num_layers + (0 if tied else 1)
    linears = {name: p for name, p in moved.named_parameters() if name.endswith("proj.weight") or name == "lm_head.weight"}
    assert len(linears) == 4 * config.num_layers + (0 if tied else 1)
    before = dict(plain.named_parameters())
    for name, weight in linears.items():
        assert weight.stride() == (1, weight.shape[0]) and weight.t().is_contiguous(), name
        assert isinstance(weight, torch.nn.Parameter) and torch.equal(weight, before[name]), name
    assert moved.embed_tokens.weight.is_contiguous()
    prompts = _prompts(config.vocab_size, seed=4)
    expected = PagedKV(config).step(plain, [(row, ids) for row, ids in enumerate(prompts)])
    got = PagedKV(config).step(moved, [(row, ids) for row, ids in enumerate(prompts)])
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- extend_attention_ref vs naive attention


def _naive_causal(q, k, v, scale):  # q: [L, H, D], k/v: [L, Hkv, D] -> [L, H, D]
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))  # [H, L, D]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("scattered", [False, True])
def test_extend_attention_ref_matches_naive_causal(num_heads, num_kv_heads, scattered):
    g = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    head_dim, num_slots, scale = 16, 200, 0.3
    # (row, prefix_len, extend_len): a full prefill, a decode, a prefix + extend, a decode at position 0
    reqs = [(3, 0, 9), (0, 14, 1), (2, 5, 11), (1, 0, 1)]
    slots = torch.randperm(num_slots, generator=g) if scattered else torch.arange(num_slots)
    req_to_token = torch.full((4, 32), -1, dtype=torch.int32)
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    seqs, next_slot = {}, 0
    for row, prefix_len, extend_len in reqs:
        n = prefix_len + extend_len
        req_to_token[row, :n] = slots[next_slot : next_slot + n].int()
        next_slot += n
        seqs[row] = torch.randn(n, num_heads, head_dim, generator=g)  # every position's q
    q = torch.cat([seqs[row][p:] for row, p, _ in reqs])  # [T, H, D]: only the new tokens
    o = extend_attention_ref(
        q, k_cache, v_cache, req_to_token,
        torch.tensor([r[0] for r in reqs]), torch.tensor([r[1] for r in reqs]), torch.tensor([r[2] for r in reqs]),
        scale,
    )  # fmt: skip
    start = 0
    for row, prefix_len, extend_len in reqs:
        kv_slots = req_to_token[row, : prefix_len + extend_len].long()
        want = _naive_causal(seqs[row], k_cache[kv_slots], v_cache[kv_slots], scale)[prefix_len:]
        torch.testing.assert_close(o[start : start + extend_len], want, atol=1e-5, rtol=1e-5)
        start += extend_len


def test_extend_attention_ref_keeps_dtype_and_checks_shapes():
    q = torch.randn(3, 4, 8, dtype=torch.bfloat16)
    cache = torch.randn(10, 2, 8, dtype=torch.bfloat16)
    req_to_token = torch.arange(10, dtype=torch.int32)[None]
    args = (req_to_token, torch.tensor([0]), torch.tensor([2]), torch.tensor([3]), 0.5)
    o = extend_attention_ref(q, cache, cache, *args)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    with pytest.raises(ValueError, match="KV heads"):
        extend_attention_ref(torch.randn(3, 3, 8), cache, cache, *args)
    with pytest.raises(ValueError, match="extend_lens"):
        extend_attention_ref(q[:2], cache, cache, *args)


def test_llama3_8b_shape_reads_as_published():
    """The benchmark shape read from its config.json has Llama 3 8B's published dimensions (an outside
    oracle: a reader that dropped or mixed up a field would not reproduce them)."""
    shape = NAMED_SHAPES["llama3-8b"]
    assert (shape.vocab_size, shape.hidden_size, shape.intermediate_size, shape.num_layers) == (128256, 4096, 14336, 32)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)
    assert (shape.q_size, shape.kv_size) == (4096, 1024)
    assert (shape.rope_theta, shape.max_position_embeddings, shape.rms_norm_eps) == (500000.0, 8192, 1e-5)
    assert (shape.bos_token_id, shape.eos_token_ids, shape.tie_word_embeddings) == (128000, (128001,), False)
    assert ModelConfig.from_hf(json.loads(json.dumps(LLAMA3_8B_CONFIG))) == shape
