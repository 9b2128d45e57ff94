"""Text in and out of the engine: the tokenizer, incremental detokenization and stop strings.

The tokenizer is the checkpoint's tokenizer.json run by the `tokenizers` library (transformers is a test
oracle only). Output text is produced as deltas, one per generated token at most:

    token ids -> IncrementalDetokenizer.push -> text delta -> StopMatcher.push -> text safe to send

Both stages may hold text back; both have a `flush()` for the end of the stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers.decoders import DecodeStream

# Where a checkpoint names its special tokens, in the order they win: generation_config is what
# transformers' generate() stops on, config.json is the model's own, tokenizer_config names tokens by text.
_ID_SOURCES = ("generation_config.json", "config.json")

# Tokens of the prompt re-decoded with the first generated token, so that decoders which drop or add a
# leading space at the start of a decode (SentencePiece's metaspace) see the same context as a full decode.
_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class Tokenizer:
    """A checkpoint's tokenizer; `encode` adds special tokens exactly as tokenizer.json's post-processor does.

    `vocab_size` counts added tokens too, so it bounds every id `encode` can return (the model's
    embedding may be larger). `eos_token_ids` is never empty for a checkpoint that names an eos token.
    """

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: frozenset[int]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        metadata = _read_json_files(model_dir, (*_ID_SOURCES, "tokenizer_config.json"))
        return cls(
            backend=backend,
            bos_token_id=_first_or_none(_special_ids(backend, metadata, "bos")),
            eos_token_ids=frozenset(_special_ids(backend, metadata, "eos")),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _read_json_files(model_dir: Path, names: Iterable[str]) -> dict[str, dict]:
    """name -> parsed JSON object, for the files that exist."""
    return {
        name: json.loads((model_dir / name).read_text()) for name in names if (model_dir / name).is_file()
    }


def _special_ids(backend: tokenizers.Tokenizer, metadata: dict[str, dict], kind: str) -> list[int]:
    """Ids of the `kind` ("bos" or "eos") token(s) from the first file that names them; [] if none does."""
    for name in _ID_SOURCES:
        value = metadata.get(name, {}).get(f"{kind}_token_id")
        if value is not None:
            return [value] if isinstance(value, int) else list(value)
    token = metadata.get("tokenizer_config.json", {}).get(f"{kind}_token")
    if isinstance(token, dict):  # AddedToken serialised as {"content": ..., ...}
        token = token.get("content")
    token_id = backend.token_to_id(token) if token else None
    return [] if token_id is None else [token_id]


def _first_or_none(ids: list[int]) -> int | None:
    return ids[0] if ids else None


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that never end inside a multi-byte character.

    Invariant: the concatenation of every `push` result and the final `flush` equals
    `tokenizer.decode(generated ids)` (special tokens skipped), provided the prompt ends on a character
    boundary. The state is a window of ids, `_window`: `_window[:_read]` is text already emitted (context,
    so leading spaces come out as in a full decode; at first the prompt's last few tokens) and the rest is
    new. A delta is emitted only when the window's text does not end in U+FFFD, i.e. when the bytes so far
    end on a complete character; the window then starts where the new text started.

    `tokenizers`' DecodeStream runs that algorithm in one call a token, keeping the emitted context's text
    between calls (this detokenizer runs for every request on every step, on the engine loop's thread).
    The window is mirrored here for `flush`, and for the two-decode path taken if DecodeStream refuses a
    step (it raises when a longer window's text no longer starts with its context's, which a decoder
    that rewrites earlier text can do; the slicing below carries on by length as a full decode would).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]):
        self._backend = tokenizer.backend
        self._decode = tokenizer.decode
        self._window = list(prompt_ids[max(len(prompt_ids) - _PROMPT_CONTEXT_TOKENS, 0) :])
        self._read = len(self._window)
        # DecodeStream reads a prompt tail whose text ends in an incomplete character as text not yet
        # emitted (its first step would return the tail's text too): such a request decodes its window here.
        self._stream: DecodeStream | None = None
        if not self._decode(self._window).endswith(_REPLACEMENT_CHAR):
            self._stream = DecodeStream(list(self._window), skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" while a character is incomplete)."""
        window = self._window
        window.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._backend, token_id)
            except Exception:
                self._stream = None  # the window above is whole: decode it here from now on
            else:
                if delta is None:
                    return ""
                return self._advance(delta)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._advance(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """The text still held back at the end of the stream (it may end in U+FFFD for cut-off bytes)."""
        self._stream = None  # the window moves past what the stream holds
        prefix_text, new_text = self._decode_window()
        return self._advance(new_text[len(prefix_text) :]) if len(new_text) > len(prefix_text) else ""

    def _decode_window(self) -> tuple[str, str]:
        """(text of the emitted context, text of the whole window)."""
        return self._decode(self._window[: self._read]), self._decode(self._window)

    def _advance(self, delta: str) -> str:
        del self._window[: self._read]
        self._read = len(self._window)
        return delta


class StopMatcher:
    """Finds stop strings in a stream of text deltas; text that could start a stop string is held back.

    `push(delta) -> (safe_text, matched)`. Until a match, `safe_text` is everything except the longest tail
    that is a proper prefix of some stop string. On a match, `safe_text` is the text before the stop
    string and `matched` names it; the stop string and anything after it are never returned. The match is
    the stop string that completes first in the stream (on a tie, the one that starts first), so the
    result does not depend on how the text was split into deltas. After a match, pushes are an error.
    """

    def __init__(self, stop_strings: Iterable[str]):
        self._stops = tuple(stop_strings)
        if any(not s for s in self._stops):
            raise ValueError("stop strings must not be empty")
        self._held = ""
        self.matched: str | None = None

    def push(self, delta: str) -> tuple[str, str | None]:
        if self.matched is not None:
            raise RuntimeError(f"push after stop string {self.matched!r} matched")
        text = self._held + delta
        match = _first_match(text, self._stops)
        if match is not None:
            start, self.matched = match
            self._held = ""
            return text[:start], self.matched
        num_held = _longest_partial_match(text, self._stops)
        self._held = text[len(text) - num_held :]
        return text[: len(text) - num_held], None

    def flush(self) -> str:
        """At the end of the stream: the held-back tail, which no stop string completed."""
        held, self._held = self._held, ""
        return held


def _first_match(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop) of the occurrence that ends first, ties to the earliest start; None if none occurs."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[1], best[2])


def _longest_partial_match(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
