"""Chat prompts from a checkpoint's `tokenizer_config.json` `chat_template`, rendered the way transformers'
`apply_chat_template` renders them, so a chat request gives the same prompt here as in transformers:

- a sandboxed, immutable Jinja environment with `trim_blocks` and `lstrip_blocks` and the loop-control
  extension;
- the globals templates call: `raise_exception` (a TemplateError), `strftime_now`, and transformers'
  `tojson` filter (plain `json.dumps`, no HTML escaping, keyword options kept);
- the template sees `messages`, `add_generation_prompt`, `tools` / `documents` (None here) and the
  tokenizer's special tokens by name (`bos_token`, `eos_token`, ...), as strings.

The rendered text already holds the template's special tokens, so it is tokenized without adding any.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# tokenizer_config.json keys transformers passes to templates (its special_tokens_map).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed to render it."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class ChatTemplate:
    template: jinja2.Template
    special_tokens: dict[str, str]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model's template, or None when its tokenizer_config.json has none."""
        path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str) or not source:
            return None
        return cls(_environment().from_string(source), _special_tokens(config))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"messages: the model's chat template refused them: {exc}") from None


def _special_tokens(config: dict) -> dict[str, str]:
    tokens = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken serialised as {"content": ..., ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens
