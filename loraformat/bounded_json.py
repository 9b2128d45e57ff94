"""JSON from clients, parsed only when its nesting is shallow.

Python's json parser recurses once per nesting level: `[[[[...` a hundred thousand deep ends in a
RecursionError (an INTERNAL error at the servicer) after burning the stack. The depth is counted on
the brackets outside strings first, in one linear pass done by C code (a regex and str.translate).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from loraformat.errors import InvalidArgument

MAX_JSON_DEPTH = 64
_STRING_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = {c: None for c in range(128) if chr(c) not in "[]{}"}
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text` (0 for a scalar); assumes nothing valid."""
    brackets = _STRING_RE.sub("", text).translate(_NOT_BRACKETS)
    brackets = "".join(c for c in brackets if c in _STEP)  # non-ASCII characters outside strings
    return max(itertools.accumulate(_STEP[c] for c in brackets), default=0)


def loads(raw: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH, **kwargs: Any) -> Any:
    """json.loads, refusing more than `max_depth` levels of nesting with InvalidArgument naming `what`."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
    except UnicodeDecodeError as err:
        raise InvalidArgument(f"{what}: not valid JSON (not UTF-8: {err.reason} at byte {err.start})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise InvalidArgument(f"{what}: JSON nested {depth} levels deep; at most {max_depth}")
    try:
        return json.loads(text, **kwargs)
    except ValueError as err:
        raise InvalidArgument(f"{what}: not valid JSON ({err})") from None
