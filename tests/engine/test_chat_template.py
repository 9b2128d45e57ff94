"""Chat prompts rendered by engine/chat_template.py equal transformers' apply_chat_template."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from engine.chat_template import ChatTemplate, ChatTemplateError
from loramux.demo_model import write_llama_checkpoint

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, with ünïcode and \"quotes\" <b>tags</b>"},
    ],
]

# A template that leans on what transformers adds to Jinja: tojson without HTML escaping, loop controls,
# namespace, and the whitespace control of trim_blocks / lstrip_blocks.
TOJSON_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
[{{ ns.n }}] {{ message | tojson }}
{% endfor %}
{% if add_generation_prompt %}{{ eos_token }}>{% endif %}"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("chat"))


def _with_template(model_dir, tmp_path, template):
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if template is None:
        config.pop("chat_template")
    else:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_demo_template_renders_as_transformers_does(model_dir, messages, add_generation_prompt):
    ours = ChatTemplate.from_dir(model_dir).render(messages, add_generation_prompt=add_generation_prompt)
    hf = AutoTokenizer.from_pretrained(model_dir)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<s>") and "<|user|>" in ours
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert hf(ours, add_special_tokens=False).input_ids == list(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_tojson_namespace_and_loop_controls_render_as_transformers_does(model_dir, tmp_path, messages):
    directory = _with_template(model_dir, tmp_path, TOJSON_TEMPLATE)
    ours = ChatTemplate.from_dir(directory).render(messages)
    theirs = AutoTokenizer.from_pretrained(directory).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    if len(messages) > 1:  # transformers' tojson: no HTML escaping, no ASCII escaping, system skipped
        assert "ünïcode" in ours and "<b>tags</b>" in ours and "terse" not in ours


def test_raise_exception_becomes_a_chat_template_error(model_dir):
    with pytest.raises(ChatTemplateError, match="not tool"):
        ChatTemplate.from_dir(model_dir).render([{"role": "tool", "content": "x"}])


def test_a_model_without_a_template_has_none(model_dir, tmp_path):
    assert ChatTemplate.from_dir(_with_template(model_dir, tmp_path, None)) is None
