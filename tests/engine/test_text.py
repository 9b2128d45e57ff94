"""Tokenizer against transformers, the incremental detokenizer's invariant, and stop-string matching."""

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest

from engine.text import IncrementalDetokenizer, StopMatcher, Tokenizer

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "The quick brown fox jumps over the lazy dog.",
    "café crème brûlée, naïve piña colada, Zoë",
    "日本語 (にほんご) こんにちは ありがとう",
    "Привет, мир; Γειά σου κόσμε",
    "emoji 😀 🎉 🚀 ❤️ 👍🏽 🇯🇵 🤖 and unseen ones 🦀🧬",
    "def f(x):\n\treturn x * 2\n\n",
    "special tokens in text: <s> </s> <pad> stay what they are",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


# A SentencePiece-style vocabulary: "▁" marks a word's leading space, which the Metaspace decoder drops
# from the first token of a decode. Scores favour whole words over letters.
_METASPACE_WORDS = ("▁", "▁The", "▁the", "▁fox", "▁jumps", "▁over", "▁dog", "▁Hello", "▁world", "▁a", "s", "ed")
_METASPACE_PIECES = ("<s>", "</s>", "<unk>", *_METASPACE_WORDS, ",", ".", "!", *"abcdefghijklmnopqrstuvwxyzTHW")
# Added after the base vocabulary, as chat models add their turn markers: ids past the model's own pieces.
_ADDED_TOKENS = ("<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer directory like a SentencePiece (Llama 2, Mistral) checkpoint's, built here: a Unigram
    model with a Metaspace pre-tokenizer and decoder, <s> prepended, and two special tokens added past
    the base vocabulary."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = [(piece, -1.0 if len(piece) > 1 else -10.0) for piece in _METASPACE_PIECES]
    backend = Backend(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.add_special_tokens(["<s>", "</s>", "<unk>", *_ADDED_TOKENS])
    model_dir = tmp_path_factory.mktemp("metaspace")
    backend.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return model_dir


@pytest.fixture(scope="module")
def metaspace(metaspace_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(metaspace_dir)


# --- Tokenizer ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(
        text, add_special_tokens=False
    )


def test_encode_prepends_bos_once(tokenizer):
    ids = tokenizer.encode("hi")
    assert ids[0] == tokenizer.bos_token_id == 0
    assert ids[1:] == tokenizer.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers_and_round_trips(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    if "<" not in text:  # text naming special tokens loses them when they are skipped
        assert tokenizer.decode(ids) == text


def test_special_ids_and_vocab_size(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer) == 512
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 0
    assert tokenizer.eos_token_ids == frozenset({hf_tokenizer.eos_token_id}) == frozenset({1})


def test_vocab_size_counts_tokens_added_past_the_base_vocabulary(metaspace_dir, metaspace):
    """The sampler's and the stop-id check's bound must cover every id encode returns, added tokens too."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(metaspace_dir / "tokenizer.json"))
    assert metaspace.vocab_size == len(hf) == len(_METASPACE_PIECES) + len(_ADDED_TOKENS)
    ids = metaspace.encode("Hello<|im_end|>", add_special_tokens=False)
    assert ids[-1] == metaspace.vocab_size - 1 > max(ids[:-1])
    assert (metaspace.bos_token_id, metaspace.eos_token_ids) == (0, frozenset({1}))


def _copy_tokenizer_only(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_eos_list_from_generation_config_wins(tiny_llama_dir, tmp_path):
    model_dir = _copy_tokenizer_only(tiny_llama_dir, tmp_path / "m")
    (model_dir / "config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 2}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.eos_token_ids == frozenset({1, 2})
    assert tokenizer.bos_token_id == 2  # generation_config names no bos: config.json's


def test_special_tokens_fall_back_to_tokenizer_config(tiny_llama_dir, tmp_path):
    model_dir = _copy_tokenizer_only(tiny_llama_dir, tmp_path / "m")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<pad>", "special": True}  # AddedToken form
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.bos_token_id == 0
    assert tokenizer.eos_token_ids == frozenset({2})


# --- IncrementalDetokenizer -----------------------------------------------------------------------------


def _stream(tokenizer: Tokenizer, prompt_ids: list[int], generated: list[int]) -> tuple[list[str], str]:
    """(delta of each push, final flush)."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.push(token_id) for token_id in generated]
    return deltas, detokenizer.flush()


@pytest.mark.parametrize("text", [t for t in TEXTS if "<" not in t])  # special tokens are skipped
@pytest.mark.parametrize("prompt", ["", "A prompt: ", "日本語 😀"])
def test_deltas_of_real_text_are_clean_and_add_up(tokenizer, text, prompt):
    generated = tokenizer.encode(text, add_special_tokens=False)
    deltas, tail = _stream(tokenizer, tokenizer.encode(prompt), generated)
    assert "".join(deltas) == text
    assert tail == ""
    assert not any("\ufffd" in delta for delta in deltas)


def test_partial_characters_are_held_back(tokenizer):
    # An emoji the corpus never saw is split into byte tokens: nothing comes out until its last byte.
    generated = tokenizer.encode("🦀", add_special_tokens=False)
    assert len(generated) >= 2
    deltas, _ = _stream(tokenizer, tokenizer.encode("x"), generated)
    assert deltas == [""] * (len(generated) - 1) + ["🦀"]


def test_leading_space_after_prompt_is_kept(tokenizer):
    deltas, _ = _stream(
        tokenizer, tokenizer.encode("Hello"), tokenizer.encode(" world", add_special_tokens=False)
    )
    assert "".join(deltas) == " world"


@pytest.mark.parametrize("prompt", ["", "café 日本"])
def test_random_token_sequences_add_up_to_decode(tokenizer, prompt):
    rng = random.Random(0)
    prompt_ids = tokenizer.encode(prompt)
    for _ in range(300):
        generated = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas, tail = _stream(tokenizer, prompt_ids, generated)
        assert "".join(deltas) + tail == tokenizer.decode(generated)
        # A delta ends on a whole character: U+FFFD only ever stands for bytes that no later token completes.
        assert not any(delta.endswith("\ufffd") for delta in deltas)


class _RefusingStream:
    """A DecodeStream that refuses its `refuse_at`-th step, as tokenizers' does when a window's text no
    longer starts with its context's (a decoder that rewrites earlier text)."""

    def __init__(self, ids, skip_special_tokens, refuse_at):
        from tokenizers.decoders import DecodeStream

        self._real = DecodeStream(ids, skip_special_tokens=skip_special_tokens)
        self._steps_left = refuse_at

    def step(self, backend, token_id):
        if self._steps_left == 0:
            raise Exception("Invalid prefix encountered")
        self._steps_left -= 1
        return self._real.step(backend, token_id)


@pytest.mark.parametrize("refuse_at", [0, 1, 3, 7])
def test_a_refused_stream_step_falls_back_to_decoding_the_window(tokenizer, monkeypatch, refuse_at):
    """The deltas still add up to the full decode when the stream refuses a step: from that token on the
    window it mirrors is decoded here, and the stream is not asked again."""
    import engine.text

    calls = []

    def refusing(ids, skip_special_tokens):
        calls.append(ids)
        return _RefusingStream(ids, skip_special_tokens, refuse_at)

    rng = random.Random(refuse_at)
    prompt_ids = tokenizer.encode("café 日本")
    cases = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(100)]
    expected = [_stream(tokenizer, prompt_ids, generated) for generated in cases]
    monkeypatch.setattr(engine.text, "DecodeStream", refusing)
    for generated, (expected_deltas, expected_tail) in zip(cases, expected, strict=True):
        deltas, tail = _stream(tokenizer, prompt_ids, generated)
        assert "".join(deltas) + tail == tokenizer.decode(generated)
        assert (deltas, tail) == (expected_deltas, expected_tail)  # nothing held back for the flush
    assert calls and all(ids == prompt_ids[-5:] for ids in calls)  # the stream starts on the prompt's tail


def test_a_prompt_ending_inside_a_character_gives_none_of_its_text_back(tokenizer):
    """DecodeStream would return such a prompt tail's text with the first token: the detokenizer decodes
    that request's window itself, and the deltas are the generated text alone."""
    ids = tokenizer.encode("日本語", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    prompt = tokenizer.encode("A prompt: ") + ids[:cut]
    generated = tokenizer.encode(" and then some text", add_special_tokens=False)
    deltas, tail = _stream(tokenizer, prompt, generated)
    assert "".join(deltas) + tail == " and then some text"
    assert tokenizer.decode(prompt + generated) == tokenizer.decode(prompt) + " and then some text"


@pytest.mark.parametrize("prompt_len", [0, 1, 4, 5, 6, 30])
def test_the_stream_starts_on_the_prompts_last_five_tokens_or_all_of_a_shorter_one(
    tokenizer, monkeypatch, prompt_len
):
    import engine.text

    calls = []
    real = engine.text.DecodeStream

    def recording(ids, skip_special_tokens):
        calls.append(list(ids))
        return real(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(engine.text, "DecodeStream", recording)
    prompt_ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 8, add_special_tokens=False)[:prompt_len]
    assert len(prompt_ids) == prompt_len  # ASCII: every token ends on a character boundary
    IncrementalDetokenizer(tokenizer, prompt_ids)
    assert calls == [prompt_ids[-5:] if prompt_len >= 5 else prompt_ids]


def test_metaspace_first_delta_has_the_space_a_full_decode_has(metaspace):
    """The first generated word after a prompt keeps its leading space, as in decoding prompt and output
    together; decoded alone, SentencePiece's first token would lose it."""
    for prompt in ("The", "The fox jumps over"):  # 1 and 4 tokens, without <s>
        deltas, _ = _stream(metaspace, metaspace.encode(prompt, add_special_tokens=False),
                            metaspace.encode("the dog", add_special_tokens=False))
        assert "".join(deltas) == " the dog", prompt
    deltas, _ = _stream(metaspace, [], metaspace.encode("the dog", add_special_tokens=False))
    assert "".join(deltas) == "the dog"  # nothing before it: no space, as a full decode has none either


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_metaspace_deltas_add_up_to_the_full_decode_for_every_prompt_length(metaspace, add_special_tokens):
    """decode(prompt) + deltas == decode(prompt + generated) for prompts of 0 to 8 tokens: the first decode
    sees prompt context exactly when the full decode has text before the output."""
    rng = random.Random(1)
    sentence = metaspace.encode("The fox jumps over the dog, Hello world!", add_special_tokens=add_special_tokens)
    base_ids = range(3, len(_METASPACE_PIECES))  # ordinary pieces (special ones are skipped in both decodes)
    for prompt_len in range(9):
        prompt_ids = sentence[:prompt_len]
        for _ in range(40):
            generated = [rng.choice(base_ids) for _ in range(rng.randint(1, 6))]
            deltas, tail = _stream(metaspace, prompt_ids, generated)
            assert metaspace.decode(prompt_ids) + "".join(deltas) + tail == metaspace.decode(prompt_ids + generated)


# --- StopMatcher ----------------------------------------------------------------------------------------


def _run_stops(stops: list[str], deltas: list[str]) -> tuple[list[str], str | None]:
    """(each safe piece returned, including the flush when nothing matched; the matched stop string)."""
    matcher = StopMatcher(stops)
    pieces = []
    for delta in deltas:
        safe, matched = matcher.push(delta)
        pieces.append(safe)
        if matched is not None:
            return pieces, matched
    return [*pieces, matcher.flush()], None


def _reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """Character by character: stop at the first position where some stop string ends (longest wins)."""
    for end in range(len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


def test_stop_split_across_deltas_is_never_emitted():
    pieces, matched = _run_stops(["STOP"], ["abc ST", "O", "P and more"])
    assert pieces == ["abc ", "", ""]
    assert matched == "STOP"


def test_stop_split_across_many_single_character_deltas():
    pieces, matched = _run_stops(["</answer>"], list("42</answer> junk"))
    assert "".join(pieces) == "42"
    assert matched == "</answer>"


def test_held_tail_is_released_when_it_stops_matching():
    matcher = StopMatcher(["STOP"])
    assert matcher.push("a ST") == ("a ", None)
    assert matcher.push("AR") == ("STAR", None)


def test_overlapping_candidates():
    # "abc" may start "abcd", then "bce" completes first.
    assert _run_stops(["abcd", "bce"], ["ab", "c", "e!"]) == (["", "", "a"], "bce")
    assert _run_stops(["aab"], ["a", "a", "a", "b"]) == (["", "", "a", ""], "aab")


@pytest.mark.parametrize("stops", [["ab", "abc"], ["abc", "ab"]])
def test_stop_that_is_a_prefix_of_another_matches_first(stops):
    assert _run_stops(stops, ["xa", "bc"]) == (["x", ""], "ab")
    assert _run_stops(stops, ["xabc"]) == (["x"], "ab")


def test_same_end_prefers_the_earlier_start():
    assert _run_stops(["bc", "abc"], ["xabcy"]) == (["x"], "abc")


def test_unicode_stops():
    assert _run_stops(["日本", "😀!"], ["今日は", "日", "本です"]) == (["今日は", "", ""], "日本")
    assert _run_stops(["日本", "😀!"], ["hi 😀", "!"]) == (["hi ", ""], "😀!")
    assert _run_stops(["é"], ["caf", "é"]) == (["caf", ""], "é")


def test_no_match_flushes_held_tail():
    assert _run_stops(["END"], ["hello E", "N"]) == (["hello ", "", "EN"], None)
    assert _run_stops([], ["a", "b"]) == (["a", "b", ""], None)


def test_push_after_match_and_empty_stop_are_errors():
    matcher = StopMatcher(["x"])
    assert matcher.push("axb") == ("a", "x")
    with pytest.raises(RuntimeError, match='push after stop string'):
        matcher.push("more")
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["ok", ""])


def test_result_does_not_depend_on_how_text_is_split():
    rng = random.Random(1)
    alphabet = "ab😀é "
    for _ in range(500):
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        pieces, matched = _run_stops(stops, deltas)
        emitted = "".join(pieces)
        assert (emitted, matched) == _reference(stops, text), (stops, deltas)
        # Nothing from a stop string leaks out: what was emitted is exactly the text before the match.
        if matched is not None:
            assert matched not in emitted


def test_tokenizer_reads_a_directory_given_as_text(tiny_llama_dir: Path, tokenizer: Tokenizer):
    from_text = Tokenizer.from_dir(str(tiny_llama_dir))  # the CLI hands over plain strings
    assert from_text.encode("Hello world") == tokenizer.encode("Hello world")
    assert (from_text.bos_token_id, from_text.eos_token_ids) == (tokenizer.bos_token_id, tokenizer.eos_token_ids)


def test_a_match_leaves_nothing_held_back(tokenizer: Tokenizer):
    matcher = StopMatcher(["bc"])
    assert matcher.push("ab") == ("a", None)  # "b" may start "bc": held back
    assert matcher.push("cd") == ("", "bc")
    assert matcher.flush() == ""  # the held "b" was part of the match, not text to send
    with pytest.raises(dataclasses.FrozenInstanceError):
        tokenizer.bos_token_id = 5
