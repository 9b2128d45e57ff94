"""What both services share: one server per port (no SO_REUSEPORT), and a taken port is one line."""

from __future__ import annotations

import pytest

from loramux.grpc_server import ServiceHost
from loramux.testing.procs import Service, run_cli


async def test_a_taken_port_is_refused_not_shared():
    first = ServiceHost(["loramux.v1.Registry"])
    port = first.bind("127.0.0.1", 0)
    await first.start()
    try:
        second = ServiceHost(["loramux.v1.Registry"])
        with pytest.raises(OSError) as info:  # with SO_REUSEPORT, this bind succeeded and split traffic
            second.bind("127.0.0.1", port)
        assert f"127.0.0.1:{port}" in str(info.value) and "taken" in str(info.value)
    finally:
        await first.stop(0)


@pytest.mark.slow
def test_a_second_server_on_a_taken_port_exits_with_one_line(tmp_path):
    server = Service(["registry", "serve", "--port", "0", "--data-dir", str(tmp_path / "a")], "registry")
    try:
        port = server.address.rsplit(":", 1)[1]
        second = run_cli("registry", "serve", "--port", port, "--data-dir", str(tmp_path / "b"), check=False)
        assert second.returncode == 1
        errors = [line for line in second.stderr.splitlines() if "error" in line.lower()]
        assert errors == [f"error: cannot listen on 127.0.0.1:{port}: the port is taken"
                          " (another loramux? `loramux down`, or pick another port)"], second.stderr
        assert "Traceback" not in second.stderr
    finally:
        assert server.interrupt() == 0


def test_a_taken_metrics_port_is_one_line_naming_it():
    import socket

    from loramux.metrics import RegistryMetrics, start_metrics_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as info:
            start_metrics_server(RegistryMetrics(), "127.0.0.1", port)
    assert str(info.value) == f"cannot listen on 127.0.0.1:{port} (metrics): the port is taken; pick another --metrics-port"
