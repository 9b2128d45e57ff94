"""deploy/kubernetes/, checked without a cluster.

- The kustomization is built by the few kustomize rules it uses, written out here (`build`): resources
  in order, `namespace` on namespaced objects and on RoleBinding subjects of kind ServiceAccount,
  `labels` (pairs, includeSelectors false: metadata labels only), `images` (name -> newName:newTag).
  Where a kustomize is installed (`kustomize` or `kubectl kustomize`), its output must equal ours.
- Core kinds are validated by kubernetes-validate (strict: unknown fields are errors).
- The InferencePool and the endpoint picker's configuration are checked field by field against their
  published API as read in kubernetes-sigs/gateway-api-inference-extension: api/v1/inferencepool_types.go
  and api/v1/shared_types.go (InferencePool, inference.networking.k8s.io/v1), and
  apix/config/v1alpha1/endpointpickerconfig_types.go (EndpointPickerConfig,
  inference.networking.x-k8s.io/v1alpha1). The field sets below are written from those types.
- The wiring: what selects what, which port serves what, and every loramux command line through the CLI's
  own parser with the Secret's LORAMUX_* variables.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from loramux.shell.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZE_DIR = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.33"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume"}
CORE_API_VERSIONS = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1"}

# api/v1/inferencepool_types.go, shared_types.go
POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_SPEC_FIELDS = {"selector", "targetPorts", "endpointPickerRef"}  # all required
SELECTOR_FIELDS = {"matchLabels"}  # required, at most 64 entries
PORT_FIELDS = {"number"}  # targetPorts: exactly one item
PICKER_REF_FIELDS = {"group", "kind", "name", "portNumber", "failureMode"}  # name required
FAILURE_MODES = {"FailOpen", "FailClose"}
GROUP = re.compile(r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

# apix/config/v1alpha1/endpointpickerconfig_types.go
PICKER_API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
PICKER_FIELDS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "saturationDetector", "data", "flowControl", "parser"}
PLUGIN_FIELDS = {"name", "type", "parameters"}  # type required
PROFILE_FIELDS = {"name", "plugins"}  # both required
PROFILE_PLUGIN_FIELDS = {"pluginRef", "weight"}  # pluginRef required
# In-tree plugin types of the picker, and the prefix scorer's parameters, as its docs list them.
PLUGIN_TYPES = {
    "single-profile-handler", "queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer",
    "prefix-cache-scorer", "max-score-picker", "random-picker", "running-requests-size-scorer",
}
PREFIX_SCORER_PARAMETERS = {"blockSize", "maxPrefixBlocksToMatch", "lruCapacityPerServer"}


# ---- a kustomize build of the rules this kustomization uses ---------------------------------------


def _load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _image(image: str, rules: list[dict]) -> str:
    for rule in rules:
        if image == rule["name"]:
            return f"{rule.get('newName', rule['name'])}:{rule['newTag']}" if "newTag" in rule else rule.get("newName", image)
    return image


def _set_images(obj: dict, rules: list[dict]) -> None:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        container["image"] = _image(container["image"], rules)


def build(directory: Path = KUSTOMIZE_DIR) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "namespace", "labels", "images", "resources"}, "a kustomize rule this test does not implement"
    objects = [doc for name in kustomization["resources"] for doc in _load_all(directory / name)]
    namespace = kustomization.get("namespace")
    for obj in objects:
        metadata = obj.setdefault("metadata", {})
        if namespace and obj["kind"] not in CLUSTER_SCOPED:
            metadata["namespace"] = namespace
        for subject in obj.get("subjects", []) if obj["kind"] == "RoleBinding" else []:
            if subject["kind"] == "ServiceAccount" and namespace:
                subject["namespace"] = namespace
        for entry in kustomization.get("labels", []):
            assert entry.get("includeSelectors") is False and not entry.get("includeTemplates")
            metadata.setdefault("labels", {}).update(entry["pairs"])
        _set_images(obj, kustomization.get("images", []))
    return objects


def _key(obj: dict) -> tuple[str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str, str], dict]:
    built = build()
    keyed = {_key(o): o for o in built}
    assert len(keyed) == len(built), "two objects share apiVersion, kind and name"
    return keyed


def _one(objects: dict, kind: str, name: str | None = None) -> dict:
    found = [o for (_, k, n), o in objects.items() if k == kind and (name is None or n == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.skipif(_kustomize_command() is None, reason="no kustomize or kubectl installed")
def test_our_build_equals_kustomize(objects):
    out = subprocess.run([*_kustomize_command(), str(KUSTOMIZE_DIR)], capture_output=True, text=True, timeout=120, check=True).stdout
    theirs = {_key(o): o for o in yaml.safe_load_all(out) if o}
    assert theirs == objects


def test_core_kinds_pass_kubernetes_validate(objects):
    core = [o for o in objects.values() if o["apiVersion"] in CORE_API_VERSIONS]
    assert {o["kind"] for o in core} >= {"Namespace", "Secret", "Deployment", "Service", "ConfigMap", "PersistentVolumeClaim", "Role", "RoleBinding", "ServiceAccount"}
    for obj in core:
        kubernetes_validate.validate(copy.deepcopy(obj), K8S_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):  # the validator does refuse a bad manifest
        bad = copy.deepcopy(_one(objects, "Deployment", "loramux-engine"))
        bad["spec"]["replica"] = 2
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


# ---- the InferencePool against its published API ------------------------------------------------


def check_inference_pool(pool: dict) -> None:
    assert pool["apiVersion"] == POOL_API_VERSION and pool["kind"] == "InferencePool"
    assert set(pool) <= {"apiVersion", "kind", "metadata", "spec"}
    spec = pool["spec"]
    assert set(spec) == POOL_SPEC_FIELDS
    assert set(spec["selector"]) == SELECTOR_FIELDS and 0 < len(spec["selector"]["matchLabels"]) <= 64
    for key, value in spec["selector"]["matchLabels"].items():
        assert LABEL_KEY.match(key) and LABEL_VALUE.match(value) and len(value) <= 63
    assert len(spec["targetPorts"]) == 1
    for port in spec["targetPorts"]:
        assert set(port) == PORT_FIELDS and isinstance(port["number"], int) and 1 <= port["number"] <= 65535
    ref = spec["endpointPickerRef"]
    assert set(ref) <= PICKER_REF_FIELDS and 1 <= len(ref["name"]) <= 253
    assert GROUP.match(ref.get("group", "")) and KIND.match(ref.get("kind", "Service"))
    assert 1 <= ref.get("portNumber", 9002) <= 65535 and ref.get("failureMode", "FailClose") in FAILURE_MODES


def test_inference_pool_fields(objects):
    check_inference_pool(_one(objects, "InferencePool"))
    broken = copy.deepcopy(_one(objects, "InferencePool"))
    broken["spec"]["targetPortNumber"] = 8000  # the v1alpha2 field name: not in v1
    with pytest.raises(AssertionError):
        check_inference_pool(broken)


def test_inference_pool_selects_the_engines_and_points_at_the_picker(objects):
    pool = _one(objects, "InferencePool")
    engine = _one(objects, "Deployment", "loramux-engine")
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    http_port = next(p["containerPort"] for p in engine["spec"]["template"]["spec"]["containers"][0]["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http_port}]  # the picker scrapes /metrics there too
    ref = pool["spec"]["endpointPickerRef"]
    service = _one(objects, "Service", ref["name"])
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["portNumber"] in {p["port"] for p in service["spec"]["ports"]}
    picker = _one(objects, "Deployment", "loramux-endpoint-picker")
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert args[args.index("--pool-namespace") + 1] == pool["metadata"]["namespace"]


# ---- the endpoint picker's configuration against its published API ------------------------------


def picker_config(objects) -> dict:
    picker = _one(objects, "Deployment", "loramux-endpoint-picker")
    pod = picker["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    path = Path(args[args.index("--config-file") + 1])
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if path.is_relative_to(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = _one(objects, "ConfigMap", volume["configMap"]["name"])
    return yaml.safe_load(config_map["data"][str(path.relative_to(mount["mountPath"]))])


def check_picker_config(config: dict) -> None:
    assert config["apiVersion"] == PICKER_API_VERSION and config["kind"] == "EndpointPickerConfig"
    assert set(config) <= PICKER_FIELDS and config["plugins"] and config["schedulingProfiles"]
    names = set()
    for plugin in config["plugins"]:
        assert set(plugin) <= PLUGIN_FIELDS and plugin["type"] in PLUGIN_TYPES
        names.add(plugin.get("name", plugin["type"]))  # the name defaults to the type
        if plugin["type"] == "prefix-cache-scorer":
            assert set(plugin.get("parameters", {})) <= PREFIX_SCORER_PARAMETERS
    assert len(names) == len(config["plugins"]), "two plugins share a name"
    for profile in config["schedulingProfiles"]:
        assert set(profile) == PROFILE_FIELDS and profile["name"] and profile["plugins"]
        for entry in profile["plugins"]:
            assert set(entry) <= PROFILE_PLUGIN_FIELDS and entry["pluginRef"] in names
            assert isinstance(entry.get("weight", 1), int | float)


def test_picker_config_fields_and_scorers(objects):
    config = picker_config(objects)
    check_picker_config(config)
    types = {p.get("name", p["type"]): p["type"] for p in config["plugins"]}
    scorers = {types[e["pluginRef"]]: e.get("weight") for e in config["schedulingProfiles"][0]["plugins"]}
    for scorer in ("lora-affinity-scorer", "queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"):
        assert scorers.get(scorer, 0) > 0, f"{scorer} is not weighted in the profile"
    assert "max-score-picker" in scorers
    broken = copy.deepcopy(config)
    broken["schedulingProfiles"][0]["plugins"].append({"pluginRef": "lora-affinty-scorer"})  # a typo
    with pytest.raises(AssertionError):
        check_picker_config(broken)


def test_route_sends_openai_paths_to_the_pool_through_the_gateway(objects):
    route, gateway = _one(objects, "HTTPRoute"), _one(objects, "Gateway")
    assert route["apiVersion"] == gateway["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "loramux-engine"}]
    assert any(m["path"]["value"] == "/v1" for m in rule["matches"])


# ---- loramux's own pods -------------------------------------------------------------------------


def _parse(container: dict, env: dict[str, str]):
    return build_parser(env).parse_args(container["args"])


def _secret_env(objects) -> dict[str, str]:
    return _one(objects, "Secret", "loramux-registry")["stringData"]


def test_registry_replicas_share_postgres_and_s3_from_the_secret(objects):
    registry = _one(objects, "Deployment", "loramux-registry")
    assert registry["spec"]["replicas"] >= 2
    pod = registry["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": "loramux-registry"}}]
    args = _parse(container, _secret_env(objects))
    assert args.database_url.startswith("postgresql+psycopg://") and args.object_store.startswith("s3://")
    assert args.host == "0.0.0.0" and container["readinessProbe"]["grpc"] == {"port": args.port, "service": "loramux.v1.Registry"}
    assert args.auth or args.allow_unauthenticated  # beyond loopback a service refuses to start otherwise
    service = _one(objects, "Service", "loramux-registry")
    assert {"name": "grpc", "port": args.port, "targetPort": "grpc", "appProtocol": "grpc"} in service["spec"]["ports"]


def test_engines_request_a_gpu_and_are_probed_over_grpc_and_http(objects):
    engine = _one(objects, "Deployment", "loramux-engine")
    [container] = engine["spec"]["template"]["spec"]["containers"]
    args = _parse(container, {})
    assert args.device == "cuda" and args.host == "0.0.0.0" and args.http_port == 8000
    assert args.auth or args.allow_unauthenticated
    for section in ("requests", "limits"):
        assert container["resources"][section]["nvidia.com/gpu"] == "1"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "http": args.http_port}
    assert container["readinessProbe"]["grpc"] == {"port": args.port, "service": "loramux.v1.Engine"}
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    registry_host, registry_port = args.registry.split(":")
    service = _one(objects, "Service", registry_host)
    assert int(registry_port) in {p["port"] for p in service["spec"]["ports"]}
    claim = next(v for v in engine["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
    _one(objects, "PersistentVolumeClaim", claim["persistentVolumeClaim"]["claimName"])


def test_images_are_set_by_the_kustomization(objects):
    images = {c["image"] for o in objects.values() if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]}
    assert "ghcr.io/your-org/loramux:cuda" in images and "ghcr.io/your-org/loramux:cpu" in images
    assert not {"loramux", "loramux-cpu"} & images


def _secret_mount(pod: dict, container: dict) -> tuple[str, dict]:
    """(mount path, secret volume) of the container's Secret volume."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if "secret" in volumes[m["name"]]]
    assert mount.get("readOnly")
    return mount["mountPath"], volumes[mount["name"]]["secret"]


def test_both_services_require_keys_from_the_keys_secret(objects):
    keys = _one(objects, "Secret", "loramux-keys")["stringData"]
    registry_pod = _one(objects, "Deployment", "loramux-registry")["spec"]["template"]["spec"]
    [registry] = registry_pod["containers"]
    args = _parse(registry, _secret_env(objects))
    assert args.auth and not args.allow_unauthenticated
    path, secret = _secret_mount(registry_pod, registry)
    assert secret["secretName"] == "loramux-keys"
    assert {Path(args.admin_key_file).name, Path(args.engine_key_file).name} == set(keys)
    assert Path(args.admin_key_file).parent == Path(args.engine_key_file).parent == Path(path)
    engine_pod = _one(objects, "Deployment", "loramux-engine")["spec"]["template"]["spec"]
    [engine] = engine_pod["containers"]
    engine_args = _parse(engine, {})
    assert engine_args.auth and not engine_args.allow_unauthenticated and engine_args.api_key == ""
    path, secret = _secret_mount(engine_pod, engine)
    assert secret["secretName"] == "loramux-keys" and [i["key"] for i in secret["items"]] == ["engine.key"]
    assert Path(engine_args.api_key_file) == Path(path) / "engine.key"
