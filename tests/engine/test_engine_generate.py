"""EngineCore + EngineLoop end to end on the CPU against transformers' greedy generate (the oracle).

Requests go through the owner thread exactly as the servicer sends them (submit, then wait for the
final event); batching, chunked prefill, prefix-cache hits, retraction and page size must not change a
single greedy token. Every test runs twice: with each step planned after the last one's tokens (the
CPU default), and with the overlapped schedule (the CUDA default; engine/engine_loop.py).
"""

import json
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import engine.core as core_module
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.engine_loop import EngineLoop
from engine.request import Failed, Finished, FinishReason, TokenDelta
from engine.sampling import SamplingParams

NUM_NEW = 12
PROMPT_LENS = (3, 9, 17, 33, 64, 120)
WAIT_S = 60.0


class OverlappedLoop(EngineLoop):
    def __init__(self, scheduler, workers, overlap: bool = False):
        super().__init__(scheduler, workers, overlap=True)


@pytest.fixture(autouse=True, params=["plain", "overlap"])
def schedule_mode(request, monkeypatch):
    if request.param == "overlap":
        monkeypatch.setattr(core_module, "EngineLoop", OverlappedLoop)
    return request.param


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [0, *torch.randint(3, 512, (length - 1,), generator=generator).tolist()]  # <s> first, as encode


PROMPTS = [random_prompt(n, seed) for seed, n in enumerate(PROMPT_LENS)]
SHARED = random_prompt(48, 100)
SHARED_PREFIX_PROMPTS = [SHARED + random_prompt(n, 200 + n)[1:] for n in (2, 5, 9, 20)]


def greedy(num_new: int = NUM_NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=num_new, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama_dir: Path):
    """`hf_greedy(prompt_ids, n) -> list[int]`: transformers' greedy tokens, each computed once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    made: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(prompt_ids: list[int], num_new: int = NUM_NEW) -> list[int]:
        key = (tuple(prompt_ids), num_new)
        if key not in made:
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt_ids]), do_sample=False, min_new_tokens=num_new,
                                     max_new_tokens=num_new, pad_token_id=2)
            made[key] = out[0, len(prompt_ids):].tolist()
        return made[key]

    return generate


@dataclass
class Stream:
    """Every event of one request, and an Event set by its final one."""

    events: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event) -> None:
        self.events.append(event)
        if not isinstance(event, TokenDelta):
            self.done.set()

    @property
    def deltas(self) -> list[TokenDelta]:
        return [e for e in self.events if isinstance(e, TokenDelta)]

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def final(self) -> Finished | Failed:
        assert all(isinstance(e, TokenDelta) for e in self.events[:-1])
        return self.events[-1]


class Engine:
    """A built EngineCore whose loop starts after the first batch is queued, so that batch runs together."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.is_started = False

    @property
    def scheduler(self):
        return self.core.loop.scheduler

    def run(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Stream]:
        streams = [Stream() for _ in requests]
        for (prompt, params), stream in zip(requests, streams, strict=True):
            self.core.loop.submit(self.core.new_request(self.core.prompt_ids(None, prompt), params, stream))
        if not self.is_started:
            self.core.loop.start()
            self.is_started = True
        for stream in streams:
            assert stream.done.wait(WAIT_S), "no final event"
        assert self.core.loop.num_active == 0
        return streams

    def run_greedy(self, prompts: list[list[int]], num_new: int = NUM_NEW) -> list[Stream]:
        return self.run([(p, greedy(num_new)) for p in prompts])


@contextmanager
def engine(model_dir: Path, **config):
    core = EngineCore.build(EngineConfig(model_dir=str(model_dir), **config))
    wrapper = Engine(core)
    try:
        yield wrapper
    finally:
        core.loop.stop()


def assert_matches_hf(streams: list[Stream], prompts: list[list[int]], hf_greedy, tokenizer) -> None:
    for stream, prompt in zip(streams, prompts, strict=True):
        assert stream.tokens == hf_greedy(prompt), f"prompt of {len(prompt)} tokens"
        assert [len(d.token_ids) for d in stream.deltas] == [1] * NUM_NEW
        assert stream.text == tokenizer.decode(stream.tokens)
        final = stream.final
        assert isinstance(final, Finished) and final.reason is FinishReason.LENGTH
        assert (final.prompt_tokens, final.completion_tokens) == (len(prompt), NUM_NEW)


# ------------------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("page_size", [1, 4])
def test_batch_and_prefix_cache_hits_match_hf(tiny_llama_dir, hf_greedy, page_size):
    with engine(tiny_llama_dir, page_size=page_size) as eng:
        tokenizer = eng.core.tokenizer
        head, *rest = SHARED_PREFIX_PROMPTS  # first, into an empty cache
        (lead,) = eng.run_greedy([head])
        assert lead.final.cached_prompt_tokens == 0
        sharing = eng.run_greedy(rest)
        assert_matches_hf([lead, *sharing], SHARED_PREFIX_PROMPTS, hf_greedy, tokenizer)
        assert [s.final.cached_prompt_tokens for s in sharing] == [len(SHARED)] * len(rest)

        first = eng.run_greedy(PROMPTS)
        assert_matches_hf(first, PROMPTS, hf_greedy, tokenizer)
        # Only the leading <s> is in the cache yet, and only as a whole page when pages are 1 token.
        assert [s.final.cached_prompt_tokens for s in first] == [1 // page_size] * len(PROMPTS)

        again = eng.run_greedy(PROMPTS)  # each prompt is cached but its last token (whole pages)
        assert_matches_hf(again, PROMPTS, hf_greedy, tokenizer)
        assert [s.final.cached_prompt_tokens for s in again] == [(n - 1) // page_size * page_size for n in PROMPT_LENS]

        assert eng.scheduler.num_retractions == 0


def test_chunked_prefill_matches_hf(tiny_llama_dir, hf_greedy):
    with engine(tiny_llama_dir, max_batch_tokens=16, max_running_requests=8) as eng:
        streams = eng.run_greedy(PROMPTS)
        assert_matches_hf(streams, PROMPTS, hf_greedy, eng.core.tokenizer)
        # 246 prompt tokens at 16 a step: prefill alone needs 16 steps.
        assert eng.core.loop.num_steps >= sum(PROMPT_LENS) // 16 + NUM_NEW - 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_a_tiny_kv_pool_matches_hf(tiny_llama_dir, hf_greedy, page_size):
    # 160 slots: the largest request (120 + 11 computed tokens) fits alone; all six (~310) do not.
    with engine(tiny_llama_dir, page_size=page_size, num_kv_slots=160) as eng:
        streams = eng.run_greedy(PROMPTS)
        assert eng.scheduler.num_retractions > 0
        assert_matches_hf(streams, PROMPTS, hf_greedy, eng.core.tokenizer)
        kv = eng.scheduler.kv
        assert kv.radix.protected_size() == 0
        assert kv.allocator.num_used_pages * page_size == kv.radix.total_size()  # nothing leaked


# ------------------------------------------------------------------------------------ text and stops


def test_stop_string_across_token_boundaries(tiny_llama_dir, hf_greedy):
    with engine(tiny_llama_dir) as eng:
        decode = eng.core.tokenizer.decode
        prompt = PROMPTS[2]
        tokens = hf_greedy(prompt)
        head, stop = decode(tokens[:3]), decode(tokens[:6])
        assert stop.startswith(head)
        stop = stop[len(head):]  # the text of greedy tokens 3..5
        full = decode(tokens)
        num_tokens = next(n for n in range(1, NUM_NEW + 1) if stop in decode(tokens[:n]))
        assert num_tokens <= 6 and stop not in decode(tokens[num_tokens - 1: num_tokens])  # spans tokens

        (stream,) = eng.run([(prompt, SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True, stop=[stop]))])
        assert stream.final == Finished(FinishReason.STOP_SEQUENCE, stop, len(prompt), num_tokens, 0)
        assert stream.tokens == tokens[:num_tokens]
        assert stream.text == full[: full.index(stop)]
        assert stop not in stream.text


# ---------------------------------------------------------------------------------------- sampling


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llama_dir, hf_greedy):
    seeded = SamplingParams(temperature=0.8, seed=7, max_new_tokens=NUM_NEW, ignore_eos=True)
    others = [(random_prompt(5 + 11 * i, 50 + i), SamplingParams(temperature=1.0, top_k=50 * i, max_new_tokens=8 + i))
              for i in range(5)]
    prompt = PROMPTS[3]
    with engine(tiny_llama_dir) as eng:
        (alone,) = eng.run([(prompt, seeded)])
    with engine(tiny_llama_dir, max_batch_tokens=32, max_running_requests=8) as eng:
        together = eng.run([others[0], others[1], (prompt, seeded), *others[2:]])
        (other_seed,) = eng.run([(prompt, SamplingParams(temperature=0.8, seed=8, max_new_tokens=NUM_NEW, ignore_eos=True))])
    assert len(alone.tokens) == NUM_NEW
    assert together[2].tokens == alone.tokens
    assert alone.tokens != hf_greedy(prompt) and other_seed.tokens != alone.tokens  # the seed is used
    assert all(isinstance(s.final, Finished) for s in together)


def test_eos_and_max_new_tokens_finish_reasons(tiny_llama_dir, hf_greedy, tmp_path):
    prompt = PROMPTS[1]
    tokens = hf_greedy(prompt)
    eos_at = next(i for i in range(3, NUM_NEW) if tokens[i] not in tokens[:i])
    model_dir = tmp_path / "eos"
    shutil.copytree(tiny_llama_dir, model_dir)
    for name in ("config.json", "generation_config.json"):  # same weights, another eos token
        config = json.loads((model_dir / name).read_text())
        config["eos_token_id"] = tokens[eos_at]
        (model_dir / name).write_text(json.dumps(config))

    with engine(model_dir) as eng:
        stops, ignores, short = eng.run([
            (prompt, SamplingParams(max_new_tokens=NUM_NEW)),
            (prompt, greedy()),
            (prompt, SamplingParams(max_new_tokens=2)),
        ])
    assert stops.tokens == tokens[: eos_at + 1]
    assert stops.final == Finished(FinishReason.EOS, "", len(prompt), eos_at + 1, 0)
    assert ignores.tokens == tokens and ignores.final.reason is FinishReason.LENGTH
    assert short.tokens == tokens[:2]
    assert short.final == Finished(FinishReason.LENGTH, "", len(prompt), 2, 0)


def test_held_back_stop_prefix_is_flushed_when_the_stream_ends_otherwise(tiny_llama_dir, hf_greedy, tmp_path):
    """Guards: the tail held back as a partial stop-string match is sent when the stream ends by LENGTH or
    EOS. Each stop string is the last characters of the request's own output followed by text that never
    comes, so the matcher holds those characters back until the end; dropping them at the end would
    shorten the final text."""
    prompt = PROMPTS[1]
    tokens = hf_greedy(prompt)
    eos_at = next(i for i in range(3, NUM_NEW) if tokens[i] not in tokens[:i])
    model_dir = tmp_path / "eos"
    shutil.copytree(tiny_llama_dir, model_dir)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model_dir / name).read_text())
        config["eos_token_id"] = tokens[eos_at]
        (model_dir / name).write_text(json.dumps(config))
    by_eos, by_length = SamplingParams(max_new_tokens=NUM_NEW), greedy()
    with engine(model_dir) as eng:
        plain = eng.run([(prompt, by_eos), (prompt, by_length)])
        never = "\x00never"
        stops = [s.text[-3:] + never for s in plain]
        assert all(len(s) == 3 + len(never) and s not in p.text for s, p in zip(stops, plain, strict=True))
        held = eng.run([(prompt, SamplingParams(max_new_tokens=NUM_NEW, stop=[stops[0]])),
                        (prompt, SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True, stop=[stops[1]]))])
    assert [s.final.reason for s in held] == [FinishReason.EOS, FinishReason.LENGTH]
    for stream, reference in zip(held, plain, strict=True):
        assert stream.tokens == reference.tokens and stream.final.matched_stop == ""
        assert stream.text == reference.text
        assert stream.deltas[-1].text.endswith(reference.text[-3:])  # held back until the last delta
