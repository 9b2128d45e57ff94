"""Adapter identity (DESIGN section 4): a name, and a reference `name` or `name@N` to one of its versions.

Pure: the registry validates names with it, the engine and the command line parse references with it.
"""

from __future__ import annotations

import re

from loraformat.errors import InvalidArgument, quote

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
MAX_VERSION = (1 << 31) - 1  # a SQL INTEGER column (uint32 on the wire)


def check_name(name: str, field_name: str = "name") -> str:
    if not NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"{field_name} {quote(name, 140)} is invalid: use 1-128 characters of a-z, 0-9, '.', '_', '-',"
            " starting with a letter or digit"
        )
    return name


def parse_ref(ref: str) -> tuple[str, int]:
    """'name' -> (name, 0 = latest); 'name@3' -> (name, 3)."""
    name, sep, version = ref.partition("@")
    check_name(name, "adapter")
    if not sep:
        return name, 0
    # isdigit() alone accepts other scripts' digits ("\u0661" is 1 to int()); versions travel as uint32.
    if not (version.isascii() and version.isdigit()) or not 1 <= int(version) <= MAX_VERSION:
        raise InvalidArgument(
            f"adapter {quote(ref)}: the version after '@' must be an integer from 1 to {MAX_VERSION}"
        )
    return name, int(version)
