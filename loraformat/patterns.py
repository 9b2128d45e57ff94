"""PEFT's regex keys matched by RE2, in time linear in the input.

`target_modules` as a string, `exclude_modules`, `layers_pattern`, `rank_pattern` and
`alpha_pattern` come from an uploaded `adapter_config.json`. A backtracking engine lets one key such
as `(?:.|.){0,30}Z` hold a worker (and the GIL) for minutes; RE2 has no backtracking, so constructs
that need it (backreferences, lookarounds) are refused with the field named, and so is a pattern
whose compiled program would pass RE2's memory budget.
"""

from __future__ import annotations

import functools

import re2

from loraformat.errors import InvalidArgument, quote

MAX_PATTERN_CHARS = 1024
_MAX_PROGRAM_BYTES = 1 << 20  # RE2's budget for one compiled pattern (its default is 8 MiB)


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # the error reaches the client; nothing for stderr
    options.max_mem = _MAX_PROGRAM_BYTES
    return options


@functools.lru_cache(maxsize=512)
def _compile(pattern: str) -> re2._Regexp:
    return re2.compile(pattern, _options())


def check_pattern(pattern: str, field: str) -> str:
    """Return `pattern` once RE2 compiles it; InvalidArgument naming `field` otherwise."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidArgument(f"{field}: regex of {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    try:
        _compile(pattern)
    except re2.error as err:
        reason = err.args[0].decode(errors="replace") if err.args and isinstance(err.args[0], bytes) else str(err)
        raise InvalidArgument(
            f"{field}: regex {quote(pattern)} cannot be matched in linear time or is malformed ({reason})"
        ) from None
    return pattern


def fullmatch(pattern: str, text: str) -> bool:
    return _compile(pattern).fullmatch(text) is not None


def match(pattern: str, text: str) -> re2._Match | None:
    """A match anchored at the start of `text` (Python's re.match)."""
    return _compile(pattern).match(text)
