"""The sampler against argmax and softmax, per-request seeds under batching, and SamplingParams checks."""

import dataclasses
import math

import pytest
import torch

from engine.sampling import (
    DEFAULT_MAX_NEW_TOKENS,
    InvalidSampling,
    SamplingParams,
    make_generator,
    sample,
)
from engine.weights import random_model

VOCAB_SIZE = 64


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))  # [B, V]


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int) -> torch.Tensor:
    num_rows = logits.shape[0]
    return sample(logits, [params] * num_rows, [make_generator(seed + i, "cpu") for i in range(num_rows)])


# --- sample ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = _logits(8)
    next_ids = sample(logits, [SamplingParams(temperature=0.0)] * 8, [None] * 8)
    assert next_ids.dtype == torch.int64
    assert torch.equal(next_ids, logits.argmax(dim=-1))


def test_logits_come_in_the_models_dtype():
    """A bf16 model's LM head hands `sample` bf16 logits (no fp32 copy of every row); an fp32 model's
    stay fp32."""
    for dtype in (torch.bfloat16, torch.float32):
        model = random_model("tiny", dtype=dtype, seed=0)
        logits = model.compute_logits(torch.randn(3, model.config.hidden_size).to(dtype))
        assert logits.dtype == dtype and logits.shape == (3, model.config.vocab_size)


def test_bf16_logits_sample_as_their_fp32_copy():
    """The model hands `sample` its logits in bf16: greedy rows (ties included: the first of equal
    maxima) and seeded rows draw exactly the ids their fp32 copy draws."""
    logits = _logits(12, seed=3).bfloat16()
    logits[0, 7] = logits[0, 50] = logits[0].max() + 1  # a tie in a greedy row: id 7 wins
    params = [SamplingParams(temperature=0.0)] * 6 + [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(6)]
    draws = [sample(x, params, [make_generator(i, "cpu") for i in range(12)]) for x in (logits, logits.float())]
    assert torch.equal(draws[0], draws[1])
    assert draws[0][0].item() == 7


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_is_greedy_even_at_temperature_1(seed):
    logits = _logits(16, seed)
    assert torch.equal(_draw(logits, SamplingParams(temperature=1.0, top_k=1), seed), logits.argmax(dim=-1))


@pytest.mark.parametrize("seed", range(5))
def test_tiny_top_p_keeps_only_the_top_token(seed):
    logits = _logits(16, seed)
    assert torch.equal(
        _draw(logits, SamplingParams(temperature=2.0, top_p=1e-6), seed), logits.argmax(dim=-1)
    )


def test_high_temperature_is_not_greedy():
    logits = _logits(16)
    assert not torch.equal(_draw(logits, SamplingParams(temperature=5.0), 0), logits.argmax(dim=-1))


def _draw_many(logits_row: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    """Token counts [V] of num_draws draws from one row, all from one seeded generator."""
    generator = make_generator(0, "cpu")
    logits = logits_row.expand(num_draws, -1).contiguous()  # [N, V]
    next_ids = sample(logits, [params] * num_draws, [generator] * num_draws)
    return torch.bincount(next_ids, minlength=logits_row.numel())


def test_top_k_draws_only_the_k_best():
    logits = _logits(1)[0]
    counts = _draw_many(logits, SamplingParams(temperature=10.0, top_k=3), 3000)
    top3 = set(logits.topk(3).indices.tolist())
    assert set(counts.nonzero().flatten().tolist()) == top3


def test_top_p_keeps_the_smallest_set_holding_top_p():
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()  # sorted mass above: 0, 0.5, 0.8, 0.95
    counts = _draw_many(logits, SamplingParams(temperature=1.0, top_p=0.75), 4000)
    assert set(counts.nonzero().flatten().tolist()) == {1, 3}
    assert abs(counts[1].item() / 4000 - 0.5 / 0.8) < 0.03  # renormalised over the kept tokens


def test_tied_logits_rank_by_id_as_argmax_does():
    """top_k 1 over a row of equal logits is the greedy token (the lowest id), and top_k 3 keeps ids 0-2."""
    for top_k, kept in ((1, {0}), (3, {0, 1, 2})):
        counts = _draw_many(torch.zeros(VOCAB_SIZE), SamplingParams(temperature=1.0, top_k=top_k), 500)
        assert set(counts.nonzero().flatten().tolist()) == kept


def test_top_p_drops_a_token_once_the_tokens_above_it_hold_exactly_top_p():
    """Four equal tokens, top_p 0.5: the first two hold exactly half the mass, so the smallest set
    holding top_p is those two (equal logits rank by id, as in argmax)."""
    counts = _draw_many(torch.zeros(4), SamplingParams(temperature=1.0, top_p=0.5), 2000)
    assert set(counts.nonzero().flatten().tolist()) == {0, 1}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    num_draws = 20_000
    counts = _draw_many(logits, SamplingParams(temperature=temperature), num_draws).double()
    expected = num_draws * (logits.double() / temperature).softmax(dim=-1)
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 20.5  # 5 degrees of freedom, p = 0.001


def _random_other_params(rng: torch.Generator) -> SamplingParams:
    temperature = [0.0, 0.5, 1.0, 1.5][int(torch.randint(4, (1,), generator=rng))]
    top_k = int(torch.randint(0, 10, (1,), generator=rng))
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=0.9)


@pytest.mark.parametrize("position", [0, 3, 5])
def test_seeded_request_draws_the_same_tokens_alone_and_batched(position):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, seed=1234)
    num_steps = 30
    step_logits = [_logits(1, seed=100 + step) for step in range(num_steps)]  # the seeded request's [1, V]
    generator = make_generator(seeded.seed, "cpu")
    alone = [sample(logits, [seeded], [generator]).item() for logits in step_logits]

    rng = torch.Generator().manual_seed(position)
    others = [_random_other_params(rng) for _ in range(5)]
    other_generators = [
        make_generator(7, "cpu"),
        None,
        make_generator(None, "cpu"),
        None,
        make_generator(9, "cpu"),
    ]
    params = [*others[:position], seeded, *others[position:]]
    generator = make_generator(seeded.seed, "cpu")
    generators = [*other_generators[:position], generator, *other_generators[position:]]
    batched = []
    for step, logits in enumerate(step_logits):
        batch = _logits(6, seed=step).clone()  # [6, V]
        batch[position] = logits[0]
        batched.append(sample(batch, params, generators)[position].item())
    assert batched == alone
    assert len(set(alone)) > 5  # it really sampled


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = _logits(32)
    params = SamplingParams(temperature=1.0)

    def draw(seed):
        return sample(logits, [params] * 32, [make_generator(seed, "cpu")] * 32)

    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(5), draw(6))


def test_unseeded_generators_differ():
    first, second = make_generator(None, "cpu"), make_generator(None, "cpu")
    assert first.initial_seed() != second.initial_seed()


# --- SamplingParams -------------------------------------------------------------------------------------

MAX_CONTEXT = 512


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_new_tokens": -5}, "max_new_tokens"),
        ({"max_new_tokens": MAX_CONTEXT}, "max_new_tokens"),  # with a 1-token prompt: over the context
        ({"stop": ("a",) * 17}, "stop"),
        ({"stop": ("ok", "")}, "stop"),
        ({"stop": ("x" * 257,)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": (3, VOCAB_SIZE)}, "stop_token_ids"),
        ({"stop_token_ids": tuple(i % VOCAB_SIZE for i in range(65))}, "stop_token_ids"),  # in range, 65 of them
    ],
)
def test_every_invalid_field_is_named(fields, field):
    params = SamplingParams(**fields).resolve(prompt_len=1, max_context=MAX_CONTEXT)
    with pytest.raises(InvalidSampling, match=field) as excinfo:
        params.validate(VOCAB_SIZE, MAX_CONTEXT, prompt_len=1)
    assert excinfo.value.field == field
    assert isinstance(excinfo.value, ValueError)


def test_defaults_are_the_wires_zero_values():
    """An unset field on the wire is greedy, unfiltered, unseeded, the default length, and stops at EOS."""
    params = SamplingParams()
    assert params.is_greedy and (params.top_p, params.top_k, params.seed, params.max_new_tokens) == (1.0, 0, None, 0)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == ((), (), False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.5}, "sampling.temperature: must be finite and >= 0, got -0.5"),
        ({"top_k": -2}, "sampling.top_k: must be >= 0 (0 disables it), got -2"),
        ({"max_new_tokens": -5}, "sampling.max_new_tokens: must be > 0, got -5 (511 of 512 context tokens left)"),
        ({"stop": ("ok", "")}, "sampling.stop: stop[1] is empty"),
        ({"stop_token_ids": (3, 70)}, "sampling.stop_token_ids: stop_token_ids[1] = 70 is outside [0, 64)"),
    ],
)
def test_error_message_names_the_field_and_the_value(fields, message):
    """The message is what a client reads (INVALID_ARGUMENT): the field's wire name, the rule, the value."""
    with pytest.raises(InvalidSampling) as excinfo:
        SamplingParams(**fields).resolve(prompt_len=1, max_context=MAX_CONTEXT).validate(VOCAB_SIZE, MAX_CONTEXT, 1)
    assert str(excinfo.value) == message


def test_limits_themselves_are_valid():
    params = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=2**64 - 1,
        max_new_tokens=MAX_CONTEXT - 1,
        stop=["x" * 256] * 16,
        stop_token_ids=[0, *range(2, 64), VOCAB_SIZE - 1],  # 64 ids, the most allowed
        ignore_eos=True,
    )
    params.validate(VOCAB_SIZE, MAX_CONTEXT, prompt_len=1)
    for lowest in ({"seed": 0}, {"max_new_tokens": 1}):
        dataclasses.replace(params, **lowest).validate(VOCAB_SIZE, MAX_CONTEXT, prompt_len=1)
    dataclasses.replace(params, max_new_tokens=MAX_CONTEXT).validate(VOCAB_SIZE, MAX_CONTEXT)  # no prompt: all of it
    assert params.stop == ("x" * 256,) * 16  # lists from the wire become tuples
    assert len(params.stop_token_ids) == 64
    hash(params)


def test_resolve_fills_the_default_capped_by_the_context_left():
    assert DEFAULT_MAX_NEW_TOKENS == 256  # the default the README documents for clients
    assert SamplingParams().resolve(prompt_len=10, max_context=MAX_CONTEXT).max_new_tokens == 256
    assert SamplingParams().resolve(prompt_len=500, max_context=MAX_CONTEXT).max_new_tokens == 12
    for asked in (1, 7):  # a value the request set is kept, even the smallest
        assert (
            SamplingParams(max_new_tokens=asked).resolve(prompt_len=500, max_context=MAX_CONTEXT).max_new_tokens
            == asked
        )


def test_prompt_filling_the_context_leaves_no_new_tokens():
    params = SamplingParams().resolve(prompt_len=MAX_CONTEXT, max_context=MAX_CONTEXT)
    with pytest.raises(InvalidSampling, match="max_new_tokens"):
        params.validate(VOCAB_SIZE, MAX_CONTEXT, prompt_len=MAX_CONTEXT)


def test_temperature_below_the_greedy_threshold_is_argmax():
    logits = _logits(16)
    assert SamplingParams(temperature=1e-7).is_greedy
    assert torch.equal(_draw(logits, SamplingParams(temperature=1e-7), 0), logits.argmax(dim=-1))


def test_temperature_at_the_greedy_threshold_still_samples():
    """Only temperatures below 1e-5 are greedy: at 1e-5 itself, logits 5e-6 apart are 0.5 apart once
    scaled, so both tokens are drawn."""
    params = SamplingParams(temperature=1e-5)
    assert not params.is_greedy
    counts = _draw_many(torch.tensor([0.0, 5e-6]), params, 2000)
    assert counts[0] > 0 and counts[1] > counts[0]
