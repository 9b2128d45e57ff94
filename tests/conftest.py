"""Session fixtures shared by every test package."""

import os

# Before anything imports huggingface_hub: nothing may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

# Without CUDA, Triton kernels run in its CPU interpreter, which Triton reads once, when it is first
# imported; transformers (through Hugging Face's `kernels` package) imports Triton, so any test module
# that imports peft or transformers first would otherwise leave the kernel tests no interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import uuid
from collections.abc import Callable, Iterator
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


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of an S3 server on 127.0.0.1 for the whole session, with test credentials in the environment.

    Every client made during the session (boto3's default chain) talks to it with these credentials;
    tests isolate themselves with their own bucket (`s3_bucket`).
    """
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        # A profile or proxy from the developer's shell must not redirect or break loopback requests.
        env.delenv("AWS_PROFILE", raising=False)
        env.setenv("NO_PROXY", "127.0.0.1,localhost")
        from moto.server import ThreadedMotoServer  # only where S3 is used: the GPU machine lacks moto

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A new, empty bucket on `s3_endpoint`, unique to the test."""
    from registry.store import make_s3_client

    name = f"test-{uuid.uuid4().hex[:16]}"
    make_s3_client(s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def kernel_launches(monkeypatch: pytest.MonkeyPatch) -> Callable[[object, str], list]:
    """count(module, name): from now on each launch of Triton kernel `module.name` (kernel[grid](...))
    appends its grid to the list returned, and still runs."""

    def count(module: object, name: str) -> list:
        real, grids = getattr(module, name), []

        class Counted:
            def __getitem__(self, grid):
                grids.append(grid)
                return real[grid]

        monkeypatch.setattr(module, name, Counted())
        return grids

    return count
