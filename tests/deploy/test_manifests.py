"""deploy/'s Kustomize tree: every overlay renders (tests/deploy/kustomize.py, checked against
`kubectl kustomize` where kubectl is installed), every object is valid against Kubernetes'
own schemas (kubernetes-validate's bundled JSON schemas, strict: an unknown field is an
error), and the parts kvconnect reads are what kvconnect accepts: the router's flags parse
with its own parser and name every vLLM pod, the connector and event configs load, secret
files are owner-only, the event and peer ports stay inside the deployment."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvconnect.cli import build_parser
from kvconnect.config import KVEventsConfig, KVTransferConfig
from kvconnect.connector.offload.common import OffloadConfig
from kvconnect.router.instances import Instance
from tests.deploy.kustomize import render

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TREES = ["base", "overlays/peers", "overlays/cpu"]
KUBERNETES = "1.30.0"
"""The oldest Kubernetes the manifests are checked against (its schemas, bundled)."""

Obj = dict[str, Any]


def rendered(tree: str) -> list[Obj]:
    return render(DEPLOY / tree)


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def container(obj: Obj, name: str) -> Obj:
    (found,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def env_of(c: Obj, pod_name: str = "vllm-0", pod_ip: str = "10.0.0.7") -> dict[str, str]:
    """The container's environment as the kubelet makes it: in order, each value's `$(VAR)`
    expanded where VAR is defined above it (else left as it is); the pod's name and IP as
    given, values from ConfigMaps and Secrets as `<from NAME>`."""
    fields = {"metadata.name": pod_name, "status.podIP": pod_ip}
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            expand = lambda m: env.get(m.group(1), m.group(0))  # noqa: E731
            env[e["name"]] = REFERENCE.sub(expand, e["value"])
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = f"<from {e['name']}>"
    return env


@pytest.mark.parametrize("tree", TREES)
def test_every_object_is_valid_against_the_kubernetes_schemas(tree: str) -> None:
    objects = rendered(tree)
    assert {o["kind"] for o in objects} == {
        "ConfigMap", "Service", "StatefulSet", "Deployment", "NetworkPolicy"
    }  # fmt: skip
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_a_misspelt_field_or_a_wrong_type_is_refused() -> None:
    """The validator is strict: what a typo in a manifest looks like fails the test above."""
    stateful = one(rendered("base"), "StatefulSet", "vllm")
    misspelt = copy.deepcopy(stateful)
    port = container(misspelt, "vllm")["ports"][0]
    port["containerPrt"] = port.pop("containerPort")
    with pytest.raises(kubernetes_validate.ValidationError, match="containerPrt"):
        kubernetes_validate.validate(misspelt, KUBERNETES, strict=True)
    wrong = copy.deepcopy(stateful)
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError, match="'two'"):
        kubernetes_validate.validate(wrong, KUBERNETES, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("tree", TREES)
def test_the_python_rendering_is_kubectl_kustomizes(tree: str) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / tree)], capture_output=True, text=True, check=True
    ).stdout
    theirs = [o for o in yaml.safe_load_all(out) if o]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731 (kubectl sorts by kind)
    assert sorted(theirs, key=key) == sorted(rendered(tree), key=key)


@pytest.mark.parametrize("tree", TREES)
def test_the_router_names_every_vllm_pod_with_flags_kvconnect_accepts(tree: str) -> None:
    objects = rendered(tree)
    replicas = one(objects, "StatefulSet", "vllm")["spec"]["replicas"]
    router = container(one(objects, "Deployment", "kvconnect-router"), "router")
    assert router["command"] == ["kvconnect"]
    args = build_parser().parse_args(router["args"])
    assert args.command == "router" and args.port == 9000
    instances = [Instance.parse(spec) for spec in args.instance]
    hosts = [f"vllm-{i}.vllm" for i in range(replicas)]
    assert [i.url for i in instances] == [f"http://{h}:8000" for h in hosts]
    assert [i.events_endpoint for i in instances] == [f"tcp://{h}:5557" for h in hosts]
    assert [i.replay_endpoint for i in instances] == [f"tcp://{h}:5558" for h in hosts]
    vllm = container(one(objects, "StatefulSet", "vllm"), "vllm")
    extra = json.loads(env_of(vllm)["KV_TRANSFER_CONFIG"])["kv_connector_extra_config"]
    if "peer" in extra:  # the router names each peer as the instances' sources list them
        peer = extra["peer"]
        assert [i.peer for i in instances] == [(h, peer["port"]) for h in hosts]
        assert peer["sources"] == [f"{h}:{peer['port']}" for h in hosts]
    else:
        assert [i.peer for i in instances] == [None] * replicas


@pytest.mark.parametrize("tree", TREES)
def test_the_connector_and_event_configs_load_as_vllm_is_given_them(tree: str) -> None:
    objects = rendered(tree)
    vllm = container(one(objects, "StatefulSet", "vllm"), "vllm")
    assert vllm["args"][1:] == [
        "--port=8000",
        "--kv-transfer-config=$(KV_TRANSFER_CONFIG)",
        "--kv-events-config=$(KV_EVENTS_CONFIG)",
    ]
    env = env_of(vllm, "vllm-1", "10.0.0.8")
    transfer = KVTransferConfig.from_json(env["KV_TRANSFER_CONFIG"])
    assert transfer.kv_connector == "OffloadConnector"
    assert transfer.kv_load_failure_policy == "recompute"
    for block_size in (16, 128):  # vLLM's default on GPU and on CPU
        offload = OffloadConfig.from_extra_config(transfer.kv_connector_extra_config, block_size)
        assert offload.chunk_size % block_size == 0
    if offload.peer is not None:
        assert (offload.peer.host, offload.peer.reachable_host) == ("10.0.0.8", "vllm-1.vllm")
        mounts = {m["mountPath"] for m in vllm["volumeMounts"]}
        assert str(Path(offload.peer.hmac_key_file).parent) in mounts
    events = KVEventsConfig.from_json(env["KV_EVENTS_CONFIG"])
    assert events.enable_kv_cache_events
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    assert events.endpoint == f"tcp://*:{ports['kv-events']}"
    assert events.replay_endpoint == f"tcp://*:{ports['kv-replay']}"


@pytest.mark.parametrize("tree", TREES)
def test_every_variable_a_container_refers_to_is_defined_before_it(tree: str) -> None:
    """The kubelet expands `$(VAR)` in an env value only from the variables above it, and
    leaves an unknown one as it is: a patch that reorders env would hand vLLM a literal
    "$(POD_IP)"."""
    for obj in rendered(tree):
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        for c in [] if pod is None else pod["containers"] + pod.get("initContainers", []):
            env = env_of(c)
            for name, value in env.items():
                assert REFERENCE.findall(value) == [], (c["name"], name, value)
            for arg in [*c.get("command", []), *c.get("args", [])]:  # they see every variable
                assert set(REFERENCE.findall(arg)) <= set(env), (c["name"], arg)


@pytest.mark.parametrize("tree", TREES)
def test_secret_files_are_owner_only_and_no_pod_sets_an_fs_group(tree: str) -> None:
    """kvconnect refuses a key file that group or others may read; an fsGroup would make
    the kubelet add group read to every Secret file."""
    for obj in rendered(tree):
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        assert "fsGroup" not in pod.get("securityContext", {})
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] & 0o077 == 0, volume


@pytest.mark.parametrize("tree", TREES)
def test_every_container_has_probes_and_resource_requests(tree: str) -> None:
    for obj in rendered(tree):
        if obj["kind"] not in ("StatefulSet", "Deployment"):
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            assert {"readinessProbe", "livenessProbe"} <= set(c), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]


@pytest.mark.parametrize("tree", TREES)
def test_event_replay_and_peer_ports_are_reachable_from_the_deployments_pods_only(
    tree: str,
) -> None:
    objects = rendered(tree)
    policy = one(objects, "NetworkPolicy", "vllm")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "vllm"}
    private = {5557, 5558, 7100}
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])} or private  # none: every port
        if ports & private:
            peers = rule["from"]
            assert peers and all(set(p) == {"podSelector"} for p in peers), rule
    service_ports = {p["port"] for p in one(objects, "Service", "vllm")["spec"]["ports"]}
    assert private <= service_ports
