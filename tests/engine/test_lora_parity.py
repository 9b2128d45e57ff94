"""Multi-LoRA serving against peft: one batch mixing the base model and adapters of different
shapes gives peft's tokens and logits, also when slots are fewer than adapters (eviction, reuse)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import threading

import pytest
import torch

from engine import lora_inputs
from engine.adapters import LocalAdapters
from engine.attention import RefBackend
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import FailedPrecondition, Unavailable
from engine.forward_inputs import AttentionInputs, KVBuffers
from engine.lora_inputs import LoraInputs, sgmv_ops
from engine.request import Finished, TokenDelta
from engine.sampling import SamplingParams
from engine.step_plan import StepPlan
from lorakernels.sgmv_ref import SgmvMeta

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], seed=11),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], seed=12),
    "all": dict(r=16, lora_alpha=32, target_modules=ALL, seed=13),
    "patterns": dict(
        r=8,
        lora_alpha=16,
        target_modules=ALL,
        rank_pattern={"model.layers.0.self_attn.q_proj": 4, "down_proj": 12},
        alpha_pattern={"v_proj": 4, "gate_proj": 40},
        seed=14,
    ),
    "rslora": dict(r=64, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True, seed=15),
}
PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog", "café naïve 日本語 and more", "1 2 3 4 5"]
NUM_TOKENS = 10


@pytest.fixture(scope="module")
def adapter_dirs(make_adapter):
    return {name: make_adapter(f"parity-{name}", **kwargs) for name, kwargs in ADAPTERS.items()}


@pytest.fixture(scope="module")
def peft_model(tiny_llama_dir, adapter_dirs):
    from loramux.testing.peft_adapters import load_peft_model

    return load_peft_model(tiny_llama_dir, adapter_dirs)


@pytest.fixture(scope="module")
def oracle(peft_model, tiny_llama_dir):
    """(prompt, adapter name or '') -> peft's greedy tokens, memoized."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    cache: dict[tuple[str, str], list[int]] = {}

    def tokens(prompt: str, adapter: str) -> list[int]:
        if (prompt, adapter) not in cache:
            cache[(prompt, adapter)] = peft_greedy(peft_model, tokenizer, prompt, adapter)
        return cache[(prompt, adapter)]

    return tokens


def peft_greedy(peft_model, tokenizer, prompt: str, adapter: str) -> list[int]:
    """peft's NUM_TOKENS greedy tokens for `prompt` under `adapter` ('' = the base model)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = peft_model.generate(
        input_ids=ids,
        adapter_names=[adapter or "__base__"],
        max_new_tokens=NUM_TOKENS,
        min_new_tokens=NUM_TOKENS,
        do_sample=False,
    )
    return out[0, ids.shape[1] :].tolist()


def make_core(tiny_llama_dir, adapter_dirs, tmp_path, overlap: bool = False, **overrides) -> EngineCore:
    """overlap: the overlapped schedule (the CUDA default) on the CPU, where a launch runs the step."""
    adapters = tuple((name, str(path)) for name, path in adapter_dirs.items())
    config = EngineConfig(model_dir=str(tiny_llama_dir), adapters=adapters, work_dir=str(tmp_path), max_lora_rank=64, **overrides)
    core = EngineCore.build(config)
    core.loop.overlap = overlap
    return core


def run_all(core: EngineCore, jobs: list[tuple[str, str]], start: bool = True) -> list[tuple[list[int], Finished]]:
    """Submit every (prompt, adapter) job at once; returns each job's tokens and final event."""
    results: list[list[int]] = [[] for _ in jobs]
    finals: list[Finished | None] = [None] * len(jobs)
    done = [threading.Event() for _ in jobs]

    def sink_for(i):
        def sink(event):
            if isinstance(event, TokenDelta):
                results[i] += event.token_ids
            else:
                finals[i] = event
                done[i].set()

        return sink

    for i, (prompt, adapter) in enumerate(jobs):
        params = SamplingParams(max_new_tokens=NUM_TOKENS, ignore_eos=True)
        record = core.resolve_adapter(adapter)
        packed = asyncio.run(core.prepare(record)) if record is not None else None  # the one loading path
        core.loop.submit(core.new_request(core.prompt_ids(prompt, None), params, sink_for(i), adapter=record, packed=packed))
    if start:
        core.loop.start()
    assert all(event.wait(120) for event in done)
    return list(zip(results, finals, strict=True))


@pytest.fixture
def running(request):
    cores = []
    yield cores.append
    for core in cores:
        core.close()


def test_mixed_batch_matches_peft(tiny_llama_dir, adapter_dirs, oracle, tmp_path, running):
    core = make_core(tiny_llama_dir, adapter_dirs, tmp_path, max_loras_per_batch=len(ADAPTERS))
    running(core)
    jobs = [(p, a) for p in PROMPTS[:2] for a in ["", *ADAPTERS]]
    for (tokens, final), (prompt, adapter) in zip(run_all(core, jobs), jobs, strict=True):
        assert tokens == oracle(prompt, adapter), (prompt, adapter)
        assert final.completion_tokens == NUM_TOKENS
    assert core.lora.slots.num_evictions == 0
    for prompt in PROMPTS[:2]:  # every adapter really changes the output, or this test proves nothing
        assert all(oracle(prompt, a) != oracle(prompt, "") for a in ADAPTERS)


@pytest.mark.parametrize("overlap", [False, True])
def test_fewer_slots_than_adapters_evicts_and_reuses_slots(tiny_llama_dir, adapter_dirs, oracle, tmp_path, running, overlap):
    core = make_core(tiny_llama_dir, adapter_dirs, tmp_path, overlap, max_loras_per_batch=2)
    running(core)
    jobs = [(PROMPTS[i % len(PROMPTS)], a) for i, a in enumerate(["", *ADAPTERS] * 2)]
    for (tokens, _), (prompt, adapter) in zip(run_all(core, jobs), jobs, strict=True):
        assert tokens == oracle(prompt, adapter), (prompt, adapter)
    assert core.lora.slots.num_evictions > 0


def test_one_slot_reused_by_adapters_with_fewer_modules(tiny_llama_dir, adapter_dirs, oracle, tmp_path, running):
    """The residue bug: a tenant lacking modules or rank its slot's previous tenant had must see zeros
    there. The reference backend reads only each slot's own rank, so the tokens alone cannot see residue
    past it; the slot buffers are read whole too, as a kernel that reads the full rank capacity would."""
    core = make_core(tiny_llama_dir, adapter_dirs, tmp_path, max_loras_per_batch=1)
    running(core)
    core.loop.start()
    for adapter in ("all", "mlp", "attn", "patterns"):
        [(tokens, _)] = run_all(core, [(PROMPTS[0], adapter)], start=False)
        assert tokens == oracle(PROMPTS[0], adapter), adapter
        assert_no_rows_past_rank(core.workers.local.runner.lora_pool, slot=0)


def assert_no_rows_past_rank(pool, slot: int) -> None:
    rank, capacity = pool.ranks[slot], pool.max_rank
    assert rank > 0
    for name, target in pool.targets.items():
        a, b = pool.a[name][:, slot], pool.b[name][:, slot]  # a: [L, stack * R, in]; b: [L, out, R]
        for k in range(target.num_stack):
            assert not a[:, k * capacity + rank : (k + 1) * capacity].any(), (name, k)
        assert not b[:, :, rank:].any(), name


def test_prefix_cache_never_shares_kv_across_adapters(tiny_llama_dir, adapter_dirs, oracle, tmp_path, running):
    core = make_core(tiny_llama_dir, adapter_dirs, tmp_path, max_loras_per_batch=2)
    running(core)
    core.loop.start()
    prompt = PROMPTS[1]
    seen = {}
    for adapter in ("attn", "", "all", "attn"):  # attn changes K/V: shared KV would change tokens
        [(tokens, final)] = run_all(core, [(prompt, adapter)], start=False)
        assert tokens == oracle(prompt, adapter), adapter
        seen.setdefault(adapter, []).append(final.cached_prompt_tokens)
    assert seen["attn"][0] == 0 and seen[""][0] <= 1 and seen["all"][0] == 0  # base may share only a warm BOS
    assert seen["attn"][1] == final.prompt_tokens - 1  # the same adapter again hits its own prefix


@pytest.mark.parametrize("deferred", [False, True, "expand", "norm"], ids=["in-line", "deferred", "pending-expand", "norm-shrink"])
def test_logits_match_peft_for_a_mixed_batch(tiny_llama_dir, adapter_dirs, peft_model, tmp_path, monkeypatch, deferred):
    """deferred: every projection hands its LoRA delta back apart, as the side stream of CUDA decode
    steps does, so the model's blocks must add each one exactly once (in the kernel or op that reads the
    projection's output next). pending-expand: gate/up hands back its expand not yet run, as prefill-sized
    CUDA steps do for the SiLU-mul kernel; on the CPU the MLP runs it before its activation. norm-shrink:
    q/k/v's and gate/up's shrink is done by the norm before them (decode_norm_shrink, as CUDA decode steps
    with --lora-decode-norm-shrink do in one kernel) and the expand handed back for the next op."""
    from transformers import AutoTokenizer

    if deferred == "expand":
        handed = []
        real = LoraInputs.project_deferred

        def project_deferred(self, linear, target, layer, x):
            y, delta = real(dataclasses.replace(self, fused_expand=frozenset({"gate_up"})), linear, target, layer, x)
            handed.append((target, type(delta).__name__))
            return y, delta

        monkeypatch.setattr(LoraInputs, "project_deferred", project_deferred)
        monkeypatch.setattr(lora_inputs, "_fuses_expand", lambda meta, num_tokens, max_rank: True)
    elif deferred == "norm":
        handed = []
        real, real_norm = LoraInputs.project_deferred, LoraInputs.norm_shrink

        def norm_shrink(self, target, layer):
            self.decode_norm_shrink = frozenset({"qkv", "gate_up"})
            return real_norm(self, target, layer)

        def project_deferred(self, linear, target, layer, x):
            y, delta = real(self, linear, target, layer, x)
            handed.append((target, type(delta).__name__))
            return y, delta

        monkeypatch.setattr(LoraInputs, "norm_shrink", norm_shrink)
        monkeypatch.setattr(LoraInputs, "project_deferred", project_deferred)
    elif deferred:
        handed = []

        def project_deferred(self, linear, target, layer, x):  # the side stream's work, on one stream
            if target in self.idle:
                return linear(x), None
            t, meta = self.pool.targets[target], self.by_target.get(target, self.meta)
            v = self.shrink(x, self.pool.a[target][layer], meta, num_stack=t.num_stack)
            handed.append(target)
            return linear(x), self.delta(v, self.pool.b[target][layer], meta, output_slices=t.output_slices)

        monkeypatch.setattr(LoraInputs, "project_deferred", project_deferred)

    core = make_core(tiny_llama_dir, adapter_dirs, tmp_path, max_loras_per_batch=len(ADAPTERS))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    names = ["", "attn", "patterns", "rslora", "mlp", "all"]
    prompts = [tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(len(names))]
    assert_mixed_batch_logits_match(core, peft_model, names, prompts)
    if deferred == "expand":
        assert {kind for target, kind in handed if target == "gate_up"} == {"PendingExpand"}
        assert {kind for target, kind in handed if target != "gate_up"} == {"NoneType"}
    elif deferred == "norm":
        assert {kind for target, kind in handed if target in ("qkv", "gate_up")} == {"PendingExpand"}
        assert {kind for target, kind in handed if target in ("o", "down")} == {"NoneType"}
    elif deferred:
        assert sorted(set(handed)) == ["down", "gate_up", "o", "qkv"]


def assert_mixed_batch_logits_match(core: EngineCore, peft_model, names: list[str], prompts: list[list[int]]) -> None:
    """One prefill forward of `prompts` (row i under adapter names[i], '' = base) through the engine's
    model and slots (adapters loaded straight into rank 0's pool); each row's logits equal peft's."""
    runner = core.workers.local.runner
    model, pool = runner.model, runner.lora_pool
    adapters = [n for n in dict.fromkeys(names) if n]
    for slot, name in enumerate(adapters):
        pool.load(slot, asyncio.run(core.prepare(core.adapters.resolve(name))))
    slots = [adapters.index(n) if n else pool.base_slot for n in names]
    lens = [len(p) for p in prompts]
    kv = KVBuffers.allocate(model.config, sum(lens) + 1, torch.float32, "cpu")
    table = torch.zeros(len(names), max(lens), dtype=torch.int64)
    start = 1
    for row, n in enumerate(lens):
        table[row, :n] = torch.arange(start, start + n)
        start += n
    metadata = RefBackend(table).prepare(list(range(len(names))), [0] * len(names), lens)
    attn = AttentionInputs(out_cache_loc=torch.arange(1, start), metadata=metadata)
    lora = LoraInputs(pool, SgmvMeta.from_lists(lens, slots, pool.ranks, pool.scalings), *sgmv_ops("ref"))
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, attn, kv, lora))
    offset = 0
    for name, prompt in zip(names, prompts, strict=True):
        with torch.inference_mode():
            expected = peft_model(torch.tensor([prompt]), adapter_names=[name or "__base__"]).logits[0]
        torch.testing.assert_close(logits[offset : offset + len(prompt)], expected, atol=1e-4, rtol=0)
        offset += len(prompt)


@pytest.mark.parametrize("overlap", [False, True])
def test_two_slots_eight_adapters_forty_concurrent_requests(tiny_llama_dir, make_adapter, tmp_path, running, overlap):
    from loramux.testing.peft_adapters import load_peft_model

    dirs = {f"a{i}": make_adapter(f"admission-{i}", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=40 + i) for i in range(8)}
    core = make_core(tiny_llama_dir, dirs, tmp_path, overlap, max_loras_per_batch=2, max_running_requests=16)
    running(core)
    jobs = [(PROMPTS[i % len(PROMPTS)], f"a{i % 8}") for i in range(40)]
    results = run_all(core, jobs)
    peft = load_peft_model(tiny_llama_dir, dirs)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for (tokens, final), (prompt, adapter) in zip(results, jobs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = peft.generate(input_ids=ids, adapter_names=[adapter], max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False)
        assert tokens == out[0, ids.shape[1] :].tolist(), (prompt, adapter)
        assert final.completion_tokens == NUM_TOKENS
    assert core.lora.slots.num_loads >= 8


@pytest.mark.parametrize("overlap", [False, True])
def test_tensor_parallel_two_ranks_match_peft_with_evictions(tiny_llama_dir, adapter_dirs, oracle, tmp_path, running, overlap):
    """TP=2 on the CPU (gloo, a spawned rank): base and every adapter kind, fewer slots than adapters;
    each rank holds its S-LoRA shard of every slot, and the tokens are peft's (and so TP=1's)."""
    core = make_core(tiny_llama_dir, adapter_dirs, tmp_path, overlap, max_loras_per_batch=2, tensor_parallel_size=2)
    running(core)
    assert len(core.workers.pids) == 1 and core.workers.local.runner.model.config.num_heads == 2  # half the heads here
    jobs = [(PROMPTS[i % len(PROMPTS)], a) for i, a in enumerate(["", *ADAPTERS] * 2)]
    for (tokens, final), (prompt, adapter) in zip(run_all(core, jobs), jobs, strict=True):
        assert tokens == oracle(prompt, adapter), (prompt, adapter)
        assert final.completion_tokens == NUM_TOKENS
    assert core.lora.slots.num_evictions > 0


def test_slots_for_some_targets_serve_the_adapters_within_them(tiny_llama_dir, adapter_dirs, oracle, tmp_path, running, caplog):
    """--lora-target-modules q_proj o_proj: slots with q/k/v and o buffers only (no MLP) serve the
    attention adapter with peft's tokens beside base-model requests. An adapter of MLP projections met
    at request time (an artifact as a registry sends it) is refused, FAILED_PRECONDITION, and not cached."""
    core = make_core(
        tiny_llama_dir, {"attn": adapter_dirs["attn"]}, tmp_path / "engine", max_loras_per_batch=2,
        lora_target_modules=("q_proj", "o_proj"),
    )  # fmt: skip
    running(core)
    assert set(core.workers.local.runner.lora_pool.targets) == {"qkv", "o"}
    jobs = [(p, a) for p in PROMPTS[:3] for a in ["", "attn"]]
    for (tokens, _), (prompt, adapter) in zip(run_all(core, jobs), jobs, strict=True):
        assert tokens == oracle(prompt, adapter), (prompt, adapter)
    elsewhere = LocalAdapters.compile_all([("all", adapter_dirs["all"])], tiny_llama_dir, "tiny", 64, tmp_path / "elsewhere")
    record = elsewhere.resolve("all")
    message = (
        r"adapter 'all@1': adapts gate_proj, up_proj, down_proj, which this engine's slots hold no LoRA for"
        r" \(--lora-target-modules: k_proj, o_proj, q_proj, v_proj\)"
    )
    with pytest.raises(FailedPrecondition, match=message):
        asyncio.run(core.prepare(record))  # the artifact's own check
    assert core.lora.host_cache.get(record.digest) is None
    # a registry's record names its projections: refused before any fetch (this core has no registry link)
    remote = dataclasses.replace(record, path=None, target_modules=("q_proj", "down_proj"))
    with pytest.raises(FailedPrecondition, match=r"adapter 'all@1': adapts down_proj, which this engine"):
        asyncio.run(core.prepare(remote))
    with caplog.at_level(logging.WARNING, logger="engine.core"):
        asyncio.run(core.on_registry_event("PINNED", record))  # a registry's pin of it: a warning, not a failure
    assert f"cannot pin {record.ref}" in caplog.text and re.search(message, caplog.text)
    assert core.lora.slots.slot_of(record.digest) is None


def test_a_closed_engine_loads_no_more_adapters(tiny_llama_dir, adapter_dirs, tmp_path):
    """After close() (the server's stop), an adapter not yet in the host cache is refused UNAVAILABLE,
    and no packing thread is started for it; one packed before stays served from the cache."""
    core = make_core(tiny_llama_dir, {"attn": adapter_dirs["attn"], "mlp": adapter_dirs["mlp"]}, tmp_path, max_loras_per_batch=2)
    before = asyncio.run(core.prepare(core.adapters.resolve("attn")))
    core.close()
    assert "_prep" in core.__dict__ and core._prep._shutdown
    with pytest.raises(Unavailable, match="the engine is stopping"):
        asyncio.run(core.prepare(core.adapters.resolve("mlp")))
    assert core.lora.host_cache.get(core.adapters.resolve("mlp").digest) is None
    assert asyncio.run(core.prepare(core.adapters.resolve("attn"))) is before


def test_a_local_adapter_beyond_the_target_modules_is_refused_at_start(tiny_llama_dir, adapter_dirs, tmp_path):
    message = r"adapter 'mlp': adapts gate_proj, up_proj, down_proj, which this engine's slots hold no LoRA for \(--lora-target-modules: k_proj, q_proj, v_proj\)"
    with pytest.raises(FailedPrecondition, match=message):
        make_core(tiny_llama_dir, {"mlp": adapter_dirs["mlp"]}, tmp_path, lora_target_modules=("q_proj",))
    assert not [p.name for p in tmp_path.iterdir()]  # its compiled artifact is not left behind
    with pytest.raises(ValueError, match=r"LoRA target modules \['qproj'\] are not projections of llama models"):
        make_core(tiny_llama_dir, {}, tmp_path, lora_target_modules=("qproj",))


def test_tensor_parallel_size_that_does_not_divide_is_refused_at_start(tiny_llama_dir, tmp_path):
    config = EngineConfig(model_dir=str(tiny_llama_dir), tensor_parallel_size=3, work_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 does not divide the attention heads \(4\)"):
        EngineCore.build(config)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_queued_adapters_load_ahead_and_match_peft(tiny_llama_dir, adapter_dirs, oracle, tmp_path, running, tensor_parallel_size):
    """One request runs at a time, so the others queue: an earlier step's plan loads the next adapters
    into free slots (every rank copies them from the plan), the step that first runs one of them loads
    nothing into its slot, and no forward waits for a copy into a slot it does not read. Tokens are peft's."""
    core = make_core(
        tiny_llama_dir, adapter_dirs, tmp_path, max_loras_per_batch=2, max_running_requests=1,
        tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip
    running(core)
    plans, waited = [], []
    launch, pool = core.workers.launch, core.workers.local.runner.lora_pool
    wait_for_loads = pool.wait_for_loads

    def record_plan(plan, adapters):
        plans.append(plan)
        waited.append(set())
        return launch(plan, adapters)

    def record_wait(slots=None):
        waited[-1] |= set(range(pool.num_slots) if slots is None else slots)
        wait_for_loads(slots)

    core.workers.launch, pool.wait_for_loads = record_plan, record_wait
    jobs = [(PROMPTS[i % len(PROMPTS)], a) for i, a in enumerate(["attn", "mlp", "all", "", "patterns", "attn"])]
    for (tokens, _), (prompt, adapter) in zip(run_all(core, jobs), jobs, strict=True):
        assert tokens == oracle(prompt, adapter), (prompt, adapter)
    assert num_loads_ahead_used(plans, waited) >= 2
    assert core.lora.slots.num_loads_ahead >= num_loads_ahead_used(plans, waited)


def num_loads_ahead_used(plans, waited: list[set[int]]) -> int:
    """Loads into a slot that their own step does not read (ahead), whose slot a later step reads with no
    load into it in between: the copy that step would otherwise have waited for. Checks on the way that
    no step's forward waited for a load ahead."""
    def reads(plan, slot: int) -> bool:
        return slot in (plan.lora_slots or ())

    def loads_into(plan, slot: int) -> bool:
        return any(load.slot == slot for load in plan.loads)

    num_used = 0
    for i, plan in enumerate(plans):
        for load in (load for load in plan.loads if not reads(plan, load.slot)):
            assert load.slot not in waited[i], (i, load)  # the step's forward ran beside the copy
            later = (p for p in plans[i + 1 :] if reads(p, load.slot) or loads_into(p, load.slot))
            first = next(later, None)
            num_used += first is not None and not loads_into(first, load.slot)
    return num_used


def test_eager_steps_skip_the_targets_no_row_adapts(tiny_llama_dir, make_adapter, tmp_path):
    """A step whose rows use a q/v adapter and a down-only adapter runs LoRA kernels for qkv and down
    alone (o and gate_up are idle: each slot's rank there is 0), with per-target ranks in each target's
    metadata; a step of the q/v adapter alone leaves down idle too. The skipped work is exactly zero,
    so the tokens stay peft's (the parity tests above)."""
    dirs = {
        "qv": make_adapter("idle-qv", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=71),
        "down": make_adapter("idle-down", r=8, lora_alpha=8, target_modules=["down_proj"], seed=72),
    }
    core = make_core(tiny_llama_dir, dirs, tmp_path)
    try:
        runner = core.workers.local.runner
        pool = runner.lora_pool
        for slot, name in enumerate(dirs):
            pool.load(slot, asyncio.run(core.prepare(core.adapters.resolve(name))))

        def lora_inputs(slots):
            n = len(slots)
            plan = StepPlan(
                input_ids=(5,) * n, positions=(0,) * n, out_cache_loc=tuple(range(1, n + 1)), req_rows=tuple(range(n)),
                prefix_lens=(0,) * n, extend_lens=(1,) * n, samples=(None,) * n, lora_slots=tuple(slots),
            )  # fmt: skip
            return runner._lora_inputs(plan)

        lora = lora_inputs([0, -1, 1, 0])
        assert lora.idle == {"o", "gate_up"}
        assert lora.by_target["qkv"].lora_ranks[:2].tolist() == [4, 0]
        assert lora.by_target["down"].lora_ranks[:2].tolist() == [0, 8]
        assert lora_inputs([0, -1]).idle == {"o", "gate_up", "down"}
        calls = []
        lora.shrink = lambda x, a, meta, **kw: calls.append(a) or sgmv_ops("ref")[0](x, a, meta, **kw)
        x = torch.randn(4, pool.targets["o"].in_dim)
        linear = torch.nn.Linear(x.shape[1], pool.targets["o"].out_dim, bias=False)
        with torch.inference_mode():
            y, delta = lora.project_deferred(linear, "o", 0, x)
            assert delta is None and torch.equal(y, linear(x))  # idle: the base projection alone
            down = torch.nn.Linear(pool.targets["down"].in_dim, pool.targets["down"].out_dim, bias=False)
            lora.project_deferred(down, "down", 0, torch.randn(4, pool.targets["down"].in_dim))
        assert len(calls) == 1 and calls[0].data_ptr() == pool.a["down"][0].data_ptr()
    finally:
        core.close()
