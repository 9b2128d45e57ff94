"""The whole system as separate processes: a registry on PostgreSQL + S3 (moto on loopback) and an
engine on the CPU, driven by the CLI and concurrent gRPC clients, checked against peft."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from loramux.engine_client import EngineClient, generate_request
from loramux.registry_client import RegistryClient
from loramux.testing.procs import Service, run_cli
from loramux.v1 import engine_pb2 as engine_pb
from tests.registry.backends import fresh_postgres_database

pytestmark = pytest.mark.slow
NUM_TOKENS = 8
LONG = 480  # tokens of the stream that outlives a delete: most of the tiny model's 512-token context
PROMPTS = ["Hello world, this is", "The quick brown fox", "café naïve 日本語", "1 2 3 4 5"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir, make_adapter):
    """(prompt, adapter dir or None) -> peft's greedy tokens."""
    from transformers import AutoTokenizer

    from loramux.testing.peft_adapters import load_peft_model

    dirs = {name: make_adapter(f"stack-{name}", **kwargs) for name, kwargs in ADAPTERS.items()}
    model = load_peft_model(tiny_llama_dir, dirs)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    def tokens(prompt: str, adapter: str) -> list[int]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(
            input_ids=ids, adapter_names=[adapter or "__base__"], max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS, do_sample=False,
        )
        return out[0, ids.shape[1] :].tolist()

    return dirs, tokens


ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=71),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], seed=72),
    "all": dict(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=73),
    "qv-new": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"], seed=74),  # qv's next weights
}
SERVED = ("qv", "mlp", "all")


def generate(engine: str, prompt: str, adapter: str = "", max_new_tokens: int = NUM_TOKENS):
    with EngineClient(engine) as client:
        return client.generate(generate_request(prompt, adapter=adapter, max_new_tokens=max_new_tokens, ignore_eos=True))


def test_registry_and_engine_processes(tmp_path, tiny_llama_dir, oracle, s3_endpoint, s3_bucket):
    dirs, expected = oracle
    port = free_port()
    with fresh_postgres_database() as db_url:
        registry_args = [
            "registry", "serve", "--port", str(port), "--data-dir", str(tmp_path / "registry"), "--database-url", db_url,
            "--object-store", f"s3://{s3_bucket}?endpoint_url={s3_endpoint}",
        ]
        registry = Service(registry_args, "registry")
        engine = Service(
            ["engine", "serve", "--model", str(tiny_llama_dir), "--port", "0", "--registry", registry.address,
             "--base-model-name", "tiny", "--max-loras-per-batch", "2"],
            "engine",
        )
        reg, eng = ("--registry", registry.address), engine.address
        try:
            for name in SERVED:
                run_cli("adapters", "register", str(dirs[name]), "--name", name, *reg)

            # several concurrent clients, mixed adapters and the base model, 2 GPU slots for 3 adapters
            jobs = [(p, a) for p in PROMPTS for a in ["", *SERVED]] * 2
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda job: generate(eng, *job), jobs))
            for (prompt, adapter), result in zip(jobs, results, strict=True):
                assert result.token_ids == expected(prompt, adapter), (prompt, adapter)
                assert result.complete.adapter == (f"{adapter}@1" if adapter else "")

            # a name re-registered with new weights: the next request uses version 2, not v1's KV or slot
            run_cli("adapters", "register", str(dirs["qv-new"]), "--name", "qv", *reg)
            renamed = generate(eng, PROMPTS[0], "qv")
            assert renamed.complete.adapter == "qv@2"
            assert renamed.token_ids == expected(PROMPTS[0], "qv-new")
            assert renamed.complete.usage.cached_prompt_tokens == 0  # qv@1 served this prompt before

            # delete while streaming: the stream finishes, the next request is refused. The delete goes
            # through the client library (milliseconds, the CLI takes seconds to start) and the engine's
            # own listing proves the stream was still running once the delete had taken effect.
            with EngineClient(eng) as client, RegistryClient(registry.address) as registry_client:
                stream = client.stream(generate_request(PROMPTS[1], adapter="all", max_new_tokens=LONG, ignore_eos=True))
                first = next(stream)
                (deleted,) = registry_client.delete("all")
                with pytest.raises(grpc.RpcError) as info:
                    generate(eng, PROMPTS[0], "all")
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                listed = client.stub.ListAdapters(engine_pb.ListLoadedRequest()).adapters
                assert [a.running_requests for a in listed if a.digest == deleted.digest] == [1], listed
                rest = list(stream)
            tokens = list(first.chunk.token_ids) + [t for r in rest if r.WhichOneof("event") == "chunk" for t in r.chunk.token_ids]
            assert len(tokens) == LONG and rest[-1].complete.usage.completion_tokens == LONG

            # the registry is killed mid-run: cached adapters keep serving; restarted, nothing is lost
            stop = threading.Event()
            served: list = []
            flow_errors: list[BaseException] = []

            def steady_flow():
                try:
                    while not stop.is_set():
                        served.append(generate(eng, PROMPTS[2], "mlp").token_ids)
                except BaseException as exc:  # the main thread asserts on it: a thread's exception is lost
                    flow_errors.append(exc)

            flow = threading.Thread(target=steady_flow)
            flow.start()
            registry.kill()
            try:
                during = generate(eng, PROMPTS[3], "mlp")
                assert during.token_ids == expected(PROMPTS[3], "mlp")
                registry = Service(registry_args, "registry")
                listed = run_cli("adapters", "list", "--all-versions", *reg).stdout
                assert all(ref in listed for ref in ("qv@1", "qv@2", "mlp@1")) and "all@1" not in listed
                run_cli("adapters", "register", str(dirs["all"]), "--name", "back", *reg)
                back = _retry(lambda: generate(eng, PROMPTS[0], "back"))
                assert back.token_ids == expected(PROMPTS[0], "all") and back.complete.adapter == "back@1"
            finally:
                stop.set()
                flow.join(60)
            assert not flow.is_alive() and not flow_errors, flow_errors
            assert served and all(t == expected(PROMPTS[2], "mlp") for t in served)
        finally:
            engine.interrupt()
            registry.interrupt()


def _retry(fn, hang_s: float = 120.0):
    """The engine reconnects to a restarted registry with backoff; retry UNAVAILABLE until it has (hang_s
    only turns a hang into a failure: how fast it reconnects is not what this test checks)."""
    import time

    deadline = time.monotonic() + hang_s
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
