"""Session fixtures shared by every test package."""

import os

# Before anything imports huggingface_hub: nothing may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Callable
from pathlib import Path

import pytest

from loramux.demo_model import write_llama_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama checkpoint (TINY_LLAMA_CONFIG, seed 0), written once per session.

    Shared by every test: read it, never write into it.
    """
    return write_llama_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def make_adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make_adapter(name, **kwargs) -> Path`: a PEFT adapter of tiny_llama_dir, made once per name.

    kwargs go to `loramux.testing.peft_adapters.make_peft_adapter`; asking again for a name with other
    kwargs is an error, so a cached adapter is always the one the caller described.
    """
    from loramux.testing.peft_adapters import make_peft_adapter  # peft is slow to import: only when used

    root = tmp_path_factory.mktemp("adapters")
    made: dict[str, tuple[dict, Path]] = {}

    def make(name: str, **kwargs) -> Path:
        if name not in made:
            made[name] = (kwargs, make_peft_adapter(tiny_llama_dir, root / name, **kwargs))
        made_kwargs, path = made[name]
        if made_kwargs != kwargs:
            raise ValueError(f"adapter {name!r} was made with {made_kwargs}, not {kwargs}")
        return path

    return make
