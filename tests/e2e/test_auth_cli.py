"""`loramux up --auth` as a real process, driven by the CLI (`keys`, `audit`, `adapters`, `generate` with
--api-key) and by the official `openai` package over HTTP: the first admin key in a 0600 file, keys
printed once as the last line, tenants' adapters hidden from each other, refusals with their codes."""

from __future__ import annotations

import os
import stat

import openai
import pytest

from loramux.demo_model import write_demo_adapter
from loramux.testing.procs import Service, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("up-auth")
    args = ["up", "--auth", "--data-dir", str(data), "--registry-port", "0", "--engine-port", "0", "--http-port", "0"]
    up = Service(args, "registry", also=("engine", "http"))
    try:
        yield up, data
    finally:
        assert up.interrupt() == 0, "".join(up.stderr)[-3000:]


def test_keys_tenants_and_refusals_through_the_cli_and_http(stack):
    up, data = stack
    key_file = data / "admin.key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    admin = ("--api-key", key_file.read_text().strip())
    reg = ("--registry", up.addresses["registry"])

    def new_key(tenant: str, role: str) -> tuple[str, ...]:
        out = run_cli("keys", "create", "--tenant", tenant, "--role", role, *reg, *admin).stdout
        key = out.strip().splitlines()[-1]  # the last line is the key
        assert key.startswith("lmx_")
        return ("--api-key", key)

    pub_a, user_b = new_key("team-a", "publisher"), new_key("team-b", "user")
    run_cli("adapters", "register", str(data / "demo-adapter"), "--name", "demo", *reg, *pub_a)
    other = write_demo_adapter(data / "other-adapter", data / "models" / "loramux-demo", rank=4, seed=7)
    run_cli("adapters", "register", str(other), "--name", "shared", "--public", *reg, *pub_a)

    refused = run_cli("adapters", "list", *reg, check=False)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    assert "demo@1" not in run_cli("adapters", "list", *reg, *user_b).stdout
    assert "shared@1" in run_cli("adapters", "list", *reg, *user_b).stdout
    assert "NOT_FOUND" in run_cli("adapters", "show", "demo", *reg, *user_b, check=False).stderr
    assert "PERMISSION_DENIED" in run_cli("adapters", "delete", "shared", *reg, *user_b, check=False).stderr
    assert "PERMISSION_DENIED" in run_cli("keys", "list", *reg, *pub_a, check=False).stderr

    engine = ("--engine", up.addresses["engine"])
    run_cli("generate", "Once upon a time", "--adapter", "demo", "--max-new-tokens", "4", *engine, *pub_a)
    hidden = run_cli("generate", "Once upon a time", "--adapter", "demo", "--max-new-tokens", "4", *engine, *user_b, check=False)
    assert hidden.returncode == 1 and "NOT_FOUND" in hidden.stderr

    base_url = f"http://{up.addresses['http']}/v1"
    client = openai.OpenAI(base_url=base_url, api_key=user_b[1], max_retries=0, timeout=120)
    reply = client.completions.create(model="shared", prompt="Once upon a time", max_tokens=4)
    assert reply.choices[0].text is not None
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="demo", prompt="Once upon a time", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).completions.create(model="shared", prompt="x", max_tokens=2)

    listed = run_cli("keys", "list", *reg, *admin).stdout
    user_b_id = user_b[1].split("_")[1]
    assert user_b_id in listed and user_b[1] not in listed  # ids, never secrets
    run_cli("keys", "revoke", user_b_id, *reg, *admin)
    assert "UNAUTHENTICATED" in run_cli("adapters", "list", *reg, *user_b, check=False).stderr
    audit = run_cli("audit", "list", "--limit", "50", *reg, *admin).stdout
    for needle in ("key_create", "key_revoke", "register", "UNAUTHENTICATED", "PERMISSION_DENIED"):
        assert needle in audit, audit
