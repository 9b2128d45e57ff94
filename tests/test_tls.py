"""TLS and mutual TLS with certificates the test makes: the registry and the engine serve TLS, the
engine links to the registry with its own client certificate when a CA is given, the CLI speaks TLS,
and a certificate from another CA, or no TLS at all, is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.config import EngineConfig
from engine.server import start_engine
from loramux.engine_client import generate_request
from loramux.security import TlsFiles, open_channel
from loramux.testing.certs import TestCA
from loramux.testing.procs import run_cli
from loramux.v1 import engine_pb2_grpc as epb_grpc
from loramux.v1 import registry_pb2 as pb
from loramux.v1 import registry_pb2_grpc as pb_grpc
from tests.registry.harness import running_registry


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, wrong = TestCA(root / "ca"), TestCA(root / "wrong", name="another CA")
    return ca, ca.issue("registry"), ca.issue("engine"), ca.issue("client"), wrong, wrong.issue("intruder")


async def _list(address: str, tls: TlsFiles | None) -> list:
    async with open_channel(address, tls, aio=True) as channel:
        response = await pb_grpc.RegistryStub(channel).ListAdapters(pb.ListAdaptersRequest(), timeout=10)
        return list(response.adapters)


async def _refused(address: str, tls: TlsFiles | None) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _list(address, tls)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_tls_registry_trusts_only_its_ca(tmp_path, pki):
    ca, registry_cert, _engine, _client, wrong, _intruder = pki
    server_tls = TlsFiles(str(registry_cert.cert), str(registry_cert.key))
    async with running_registry(tmp_path / "r", tls=server_tls) as registry:
        address = registry.server.address
        assert await _list(address, TlsFiles(ca=str(ca.cert))) == []
        await _refused(address, None)  # plaintext to a TLS port
        await _refused(address, TlsFiles(ca=str(wrong.cert)))  # the server's certificate is not from this CA


async def test_mutual_tls_needs_a_client_certificate_from_the_ca(tmp_path, pki):
    ca, registry_cert, _engine, client, _wrong, intruder = pki
    server_tls = TlsFiles(str(registry_cert.cert), str(registry_cert.key), str(ca.cert))
    async with running_registry(tmp_path / "r", tls=server_tls) as registry:
        address = registry.server.address
        assert await _list(address, TlsFiles(str(client.cert), str(client.key), str(ca.cert))) == []
        await _refused(address, TlsFiles(ca=str(ca.cert)))  # no client certificate
        await _refused(address, TlsFiles(str(intruder.cert), str(intruder.key), str(ca.cert)))  # signed by another CA
        # the CLI speaks TLS with the same files
        ok = await asyncio.to_thread(
            run_cli, "adapters", "list", "--registry", address,
            "--tls-ca", str(ca.cert), "--tls-cert", str(client.cert), "--tls-key", str(client.key),
        )
        assert "ADAPTER" in ok.stdout
        refused = await asyncio.to_thread(run_cli, "adapters", "list", "--registry", address, "--tls-ca", str(ca.cert), check=False)
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr


async def test_engine_links_to_the_registry_over_mutual_tls(tmp_path, pki, tiny_llama_dir, make_adapter):
    ca, registry_cert, engine_cert, client, _wrong, _intruder = pki
    registry_tls = TlsFiles(str(registry_cert.cert), str(registry_cert.key), str(ca.cert))
    async with running_registry(tmp_path / "r", tls=registry_tls) as registry:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), port=0, registry=registry.server.address, base_model_name="tiny",
            max_loras_per_batch=2, tls=TlsFiles(str(engine_cert.cert), str(engine_cert.key), str(ca.cert)),
        )
        engine = await start_engine(config)  # registers its base model over mTLS
        try:
            await registry.register("secure", make_adapter("tls-qv", r=4, lora_alpha=8, seed=111))
            client_tls = TlsFiles(str(client.cert), str(client.key), str(ca.cert))
            async with open_channel(engine.address, client_tls, aio=True) as channel:
                request = generate_request("TLS all the way", adapter="secure", max_new_tokens=4, ignore_eos=True)
                responses = [r async for r in epb_grpc.EngineStub(channel).Generate(request, timeout=60)]
            assert responses[-1].complete.adapter == "secure@1"  # fetched from the registry over mTLS
            async with open_channel(engine.address, TlsFiles(ca=str(ca.cert)), aio=True) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [r async for r in epb_grpc.EngineStub(channel).Generate(request, timeout=10)]
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await engine.stop(grace=0.5)
