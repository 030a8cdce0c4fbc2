"""k8s/: every kustomization renders, validates against Kubernetes' schemas and agrees with elasticd's contracts.

Each directory under k8s/ with a kustomization.yaml is rendered with ``kubectl kustomize`` (offline). The binary is
``$KUBECTL``, else ``kubectl`` on PATH, else Debian's ``kubernetes-client`` package installed once per session
(kubectl 1.20, kustomize v2.0.3: the manifests keep to what both that and kustomize v5 accept); without any of
them the rendering tests skip with the reason printed. Every rendered object is validated strictly (unknown fields
rejected) with kubernetes-validate for Kubernetes 1.30 and for the newest version it knows. The PodMonitor is a
Prometheus Operator CRD whose schema kubernetes-validate does not ship; its fields are checked here by hand.

The semantic checks hold the manifests to elasticd itself: a pod's command line, environment and config file are
resolved by elasticd's own CLI (its daemon replaced by a recorder) into a valid StartConfig; selectors, ports, the
termination grace period against the drain budget, and the Job's exit-code policy against elasticd.errors.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml

from elasticd import cli
from elasticd.config import StartConfig
from elasticd.config_file import load_config_file
from elasticd.endpoints import parse_endpoints
from elasticd.errors import EXIT_USAGE
from elasticd.etcd.access import PASSWORD_ENV
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import find_etcd_binary
from elasticd.keys import RunKeys
from elasticd.membership import Bid, Epoch, Membership
from elasticd.worker.hot.decide import decide
from tests.helpers import ETCD_READY_TIMEOUT_S, free_port, kill_tree, records
from tests.integration.cluster import EXAMPLE, train_args, wait_until

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
ETCD, DAEMONSET, JOB = K8S / "etcd", K8S / "overlays" / "daemonset", K8S / "overlays" / "job"
DEPLOY_DOC = ROOT / "docs" / "deploy-kubernetes.md"
# The oldest Kubernetes the manifests support (podFailurePolicy, podReplacementPolicy: GA or beta by then).
OLDEST_K8S = "1.30"
# Custom resources: kubernetes-validate ships no schema for them, so they are checked by hand below.
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}
POD_OWNERS = {"DaemonSet", "Deployment", "StatefulSet", "Job"}
# Where the Dockerfile puts the repository's examples/ in the image (WORKDIR /opt/elasticd, COPY examples/).
IMAGE_EXAMPLES = "/opt/elasticd/examples/"
# Seconds the pod needs after the drain budget: stopping the workers, leaving the round, closing etcd.
GRACE_MARGIN_S = 30
KUBECTL_INSTALL_TIMEOUT_S = 240


# --- elasticd's side of the contract ---------------------------------------------------------------------------


def start_options() -> dict[str, click.Option]:
    """``elasticd start``'s options by long name without dashes (``min-nodes``)."""
    return {p.opts[0].lstrip("-"): p for p in cli.start.params if isinstance(p, click.Option)}


def option_env_names() -> set[str]:
    """Every environment variable elasticd start reads: each option's, and the etcd password's."""
    names = {str(p.envvar) for p in start_options().values() if p.envvar}
    return names | {PASSWORD_ENV}


def config_converters() -> dict[str, Any]:
    """The converters ``--config`` uses, built the way cli._load_config builds them."""
    ctx = click.Context(cli.start)
    return {
        name: cli._converter(param, ctx)
        for name, param in start_options().items()
        if param.name not in {"config", "help", "version"}
    }


# --- rendering ---------------------------------------------------------------------------------------------------


@functools.cache
def _kubectl() -> tuple[str | None, str]:
    """(binary, "") or (None, why not): $KUBECTL, PATH, or Debian's kubernetes-client installed here."""
    chosen = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if chosen:
        return chosen, ""
    if not shutil.which("apt-get"):
        return None, "kubectl not on PATH and no apt-get to install Debian's kubernetes-client"
    if os.geteuid() != 0:
        return None, "kubectl not on PATH and installing Debian's kubernetes-client needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "kubernetes-client"],
    ):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=KUBECTL_INSTALL_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            return None, f"{' '.join(command)} took over {KUBECTL_INSTALL_TIMEOUT_S}s"
        if done.returncode != 0:
            return None, f"{' '.join(command)} failed: {done.stderr.strip()[-300:]}"
    found = shutil.which("kubectl")
    return (found, "") if found else (None, "kubernetes-client installed but no kubectl on PATH")


def kubectl() -> str:
    binary, reason = _kubectl()
    if binary is None:
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return binary


@functools.cache
def _render(directory: Path) -> tuple[dict[str, Any], ...]:
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory.relative_to(ROOT)}:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(directory: Path) -> list[dict[str, Any]]:
    return list(_render(directory))


def the(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(owner, pod template) for every workload in a rendering."""
    for doc in docs:
        if doc["kind"] in POD_OWNERS:
            yield doc, doc["spec"]["template"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container(template: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in template["spec"]["containers"] if c["name"] == name]
    assert len(found) == 1, f"no container {name}"
    return found[0]


def elasticd_pods() -> list[tuple[str, dict[str, Any], dict[str, Any], list[dict[str, Any]]]]:
    """(overlay, owner, pod template, rendering) for the DaemonSet and the Job."""
    out = []
    for overlay, kind in ((DAEMONSET, "DaemonSet"), (JOB, "Job")):
        docs = render(overlay)
        owner = the(docs, kind)
        out.append((overlay.name, owner, owner["spec"]["template"], docs))
    return out


# --- rendering and schema validation -----------------------------------------------------------------------------


def test_kustomizations_cover_etcd_base_and_both_overlays() -> None:
    """k8s/ holds the etcd cluster, its auth Job, the shared base and the DaemonSet and Job overlays."""
    names = {str(p.relative_to(K8S)) for p in KUSTOMIZATIONS}
    assert names == {"etcd", "etcd-auth", "base", "overlays/daemonset", "overlays/job"}


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_kustomization_renders_into_the_elasticd_namespace(directory: Path) -> None:
    """Each kustomization renders offline, and everything lands in one namespace (the docs create it)."""
    docs = render(directory)
    assert docs
    assert {d["metadata"].get("namespace") for d in docs} == {"elasticd"}


@pytest.mark.parametrize("version", [OLDEST_K8S, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_object_validates_strictly(directory: Path, version: str) -> None:
    """kubernetes-validate --strict: every field exists in that Kubernetes version's schema, with the right type."""
    errors = []
    for doc in render(directory):
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:  # its str() quotes the whole schema: keep the gist
            where = ".".join(str(p) for p in exc.path)
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message[:300]}")
    assert not errors, f"Kubernetes {version}:\n" + "\n".join(errors)


def test_strict_validation_rejects_an_unknown_field() -> None:
    """The validator is really strict: a misspelt field fails (so the test above cannot pass vacuously)."""
    spec: dict[str, Any] = {"containers": [{"name": "c"}]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}
    kubernetes_validate.validate(pod, OLDEST_K8S, strict=True)
    spec["terminationGracePeriod"] = 10
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, OLDEST_K8S, strict=True)


def test_podmonitor_has_only_known_fields_and_scrapes_elasticd_pods() -> None:
    """The PodMonitor (no schema shipped) uses Prometheus Operator fields only and selects both pod kinds' port."""
    pm = the(render(K8S / "base"), "PodMonitor")
    assert set(pm) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(pm["spec"]) <= {"jobLabel", "selector", "podMetricsEndpoints", "namespaceSelector", "podTargetLabels"}
    [endpoint] = pm["spec"]["podMetricsEndpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings"}
    assert endpoint["path"] == "/metrics"
    for overlay, _owner, template, _docs in elasticd_pods():
        labels = template["metadata"]["labels"]
        assert matches(pm["spec"]["selector"]["matchLabels"], labels), overlay
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert endpoint["port"] in ports, overlay
        # DESIGN.md: a run is a Prometheus job; the job label comes from the pod's run label.
        assert pm["spec"]["jobLabel"] in labels, overlay


# --- selectors and ports -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_selectors_match_their_pods_and_ports(directory: Path) -> None:
    """Workload selectors match their templates; Services and PDBs select pods of the same rendering, by port name."""
    docs = render(directory)
    templates = [t for _owner, t in pod_templates(docs)]
    for owner, template in pod_templates(docs):
        selector = owner["spec"].get("selector", {}).get("matchLabels")
        if owner["kind"] != "Job":  # a Job's selector is generated from its own uid
            assert matches(selector, template["metadata"]["labels"]), owner["metadata"]["name"]
    for doc in docs:
        if doc["kind"] == "Service":
            selected = [t for t in templates if matches(doc["spec"]["selector"], t["metadata"]["labels"])]
            assert selected, f"Service {doc['metadata']['name']} selects no pod"
            for port in doc["spec"]["ports"]:
                for t in selected:
                    names = {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
                    assert port["targetPort"] in names, (doc["metadata"]["name"], port)
        if doc["kind"] == "PodDisruptionBudget":
            assert any(matches(doc["spec"]["selector"]["matchLabels"], t["metadata"]["labels"]) for t in templates)


# --- etcd --------------------------------------------------------------------------------------------------------


def _etcd() -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    docs = render(ETCD)
    sts = the(docs, "StatefulSet", "etcd")
    c = container(sts["spec"]["template"], "etcd")
    return sts, c, c.get("command", []) + c.get("args", [])


def test_etcd_image_is_pinned_to_a_3_5_release() -> None:
    """The etcd image names an exact 3.5.x release (no floating tag, no 3.4 with its v2 defaults, no 3.6)."""
    _sts, c, _args = _etcd()
    assert re.fullmatch(r"(quay\.io/coreos/etcd|registry\.k8s\.io/etcd):v?3\.5\.\d+(-\d+)?", c["image"]), c["image"]


def test_etcd_serves_v3_only_over_mutual_tls() -> None:
    """No v2 API; clients and peers speak https and must present a certificate signed by the CA."""
    _sts, c, args = _etcd()
    flags = dict(a.partition("=")[::2] for a in args if a.startswith("--"))
    assert not any(a.startswith("--enable-v2") for a in args)
    assert not any(e["name"].startswith("ETCD_ENABLE_V2") for e in c.get("env", []))
    for flag in ("--client-cert-auth", "--peer-client-cert-auth"):
        assert flag in flags and flags[flag] in {"", "true"}, flag
    for flag in ("--trusted-ca-file", "--cert-file", "--key-file", "--peer-trusted-ca-file", "--peer-cert-file"):
        assert flags[flag].startswith("/etc/etcd/tls/"), flag
    for flag in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls", "--initial-cluster"):
        urls = re.findall(r"(\w+)://", flags[flag])
        assert urls and set(urls) == {"https"}, flag
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/etc/etcd/tls"] == "tls"


def test_etcd_cluster_is_three_members_that_find_each_other() -> None:
    """3 replicas started in parallel; --initial-cluster names exactly them at the headless Service's DNS names."""
    docs = render(ETCD)
    sts, c, args = _etcd()
    replicas = sts["spec"]["replicas"]
    assert replicas == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    peers = the(docs, "Service", sts["spec"]["serviceName"])
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    [cluster] = [a.split("=", 1)[1] for a in args if a.startswith("--initial-cluster=")]
    name, svc = sts["metadata"]["name"], peers["metadata"]["name"]
    expected = [f"{name}-{i}=https://{name}-{i}.{svc}.$(POD_NAMESPACE).svc:2380" for i in range(replicas)]
    assert cluster.split(",") == expected
    assert {e["name"] for e in c["env"]} >= {"POD_NAME", "POD_NAMESPACE"}


def test_etcd_pdb_keeps_a_quorum() -> None:
    """Voluntary disruptions leave a majority of the members up."""
    docs = render(ETCD)
    sts, _c, _args = _etcd()
    pdb = the(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == sts["spec"]["replicas"] // 2 + 1
    assert matches(pdb["spec"]["selector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])


def test_elasticd_lists_every_etcd_member_by_its_stable_name() -> None:
    """ELASTICD_ETCD names each StatefulSet member through the headless Service, on the client port."""
    sts, _c, _args = _etcd()
    svc, ns = sts["spec"]["serviceName"], sts["metadata"]["namespace"]
    expected = [f"{sts['metadata']['name']}-{i}.{svc}.{ns}.svc:2379" for i in range(sts["spec"]["replicas"])]
    assert _etcd_access(render(K8S / "base"))["ELASTICD_ETCD"].split(",") == expected


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of k8s/etcd/make-certs.sh (openssl only), made once for this module."""
    if not shutil.which("openssl") or not shutil.which("bash"):
        pytest.skip("make-certs.sh needs bash and openssl")
    out = tmp_path_factory.mktemp("etcd-certs")
    done = subprocess.run(["bash", str(ETCD / "make-certs.sh"), str(out), "elasticd"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


def _dns_match(pattern: str, host: str) -> bool:
    """TLS hostname matching: a leading '*' stands for exactly one label."""
    if pattern.startswith("*."):
        return "." in host and host.split(".", 1)[1] == pattern[2:]
    return pattern == host


def test_certificates_name_every_address_their_clients_use(certs: Path) -> None:
    """Server cert: every name elasticd and the auth Job dial, server and peer use; client cert: CN = etcd-user."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    server = x509.load_pem_x509_certificate((certs / "server.crt").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    access = _etcd_access(render(K8S / "base"))
    hosts = [e.rsplit(":", 1)[0] for e in access["ELASTICD_ETCD"].split(",")] + ["etcd.elasticd.svc"]
    for host in hosts:
        assert any(_dns_match(n, host) for n in names), (host, names)
    usage = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    client = x509.load_pem_x509_certificate((certs / "client.crt").read_bytes())
    # With --client-cert-auth, etcd takes the CN as the user when no password is given: never more than elasticd.
    [cn] = client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert cn.value == access["ELASTICD_ETCD_USER"]
    assert not (certs / "elasticd-password").read_text().endswith("\n")


# --- elasticd pods -----------------------------------------------------------------------------------------------


def _config_map_with(docs: list[dict[str, Any]], key: str) -> dict[str, str]:
    """The data of the one ConfigMap that has ``key``."""
    found = [d["data"] for d in docs if d["kind"] == "ConfigMap" and key in d.get("data", {})]
    assert len(found) == 1, f"{len(found)} ConfigMaps with {key}"
    return dict(found[0])


def _elasticd_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The elasticd --config file the pods mount, parsed."""
    data = yaml.safe_load(_config_map_with(docs, "elasticd.yaml")["elasticd.yaml"])
    assert isinstance(data, dict)
    return data


def _etcd_access(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The ELASTICD_ETCD* variables the pods take from a ConfigMap (envFrom)."""
    return _config_map_with(docs, "ELASTICD_ETCD")


def _env_names(docs: list[dict[str, Any]], c: dict[str, Any]) -> set[str]:
    """A container's variables: its env list and the keys of the ConfigMaps it takes whole (envFrom)."""
    names = {e["name"] for e in c.get("env", [])}
    for source in c.get("envFrom", []):
        names |= set(the(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    return names


def test_config_file_keys_are_options_and_pass_elasticds_loader(tmp_path: Path) -> None:
    """The ConfigMap's elasticd.yaml is accepted by elasticd's own --config loader (keys and values)."""
    docs = render(K8S / "base")
    path = tmp_path / "elasticd.yaml"
    path.write_text(_config_map_with(docs, "elasticd.yaml")["elasticd.yaml"])
    loaded = load_config_file(path, config_converters())
    assert set(loaded) == set(_elasticd_config(docs))


@pytest.mark.parametrize("overlay", [DAEMONSET, JOB], ids=lambda p: p.name)
def test_pod_env_names_and_args_are_elasticd_options(overlay: Path) -> None:
    """Every ELASTICD_* variable is one elasticd reads; every option before the script is a start option."""
    docs = render(overlay)
    known_env, known_flags = option_env_names(), set(start_options())
    for _owner, template in pod_templates(docs):
        for c in template["spec"]["containers"]:
            assert {n for n in _env_names(docs, c) if n.startswith("ELASTICD_")} <= known_env
            args = c.get("args", [])
            assert args[0] == "start"
            options, _script = split_start_args(args)
            assert set(options) <= known_flags


def split_start_args(args: list[str]) -> tuple[dict[str, str], int]:
    """``start`` [--option VALUE | --option=VALUE]... SCRIPT [script args]: ({option: value}, index of SCRIPT).

    Every start option takes a value; what follows SCRIPT belongs to the script.
    """
    assert args and args[0] == "start", args
    options, i = {}, 1
    while i < len(args) and args[i].startswith("--"):
        name, sep, value = args[i][2:].partition("=")
        options[name] = value if sep else args[i + 1]
        i += 1 if sep else 2
    assert i < len(args), "no SCRIPT in the container's args"
    return options, i


@dataclass
class Pod:
    """One overlay's elasticd pod: its rendering, owner and template, and the StartConfig elasticd resolves for it."""

    docs: list[dict[str, Any]]
    owner: dict[str, Any]
    template: dict[str, Any]
    cfg: StartConfig
    root: Path  # stands for the container's filesystem root

    @property
    def container(self) -> dict[str, Any]:
        return container(self.template, "elasticd")


# Values the kubelet would put into downward-API variables.
_FIELDS = {"spec.nodeName": "gpu-node-7", "status.podIP": "10.0.3.7"}


@pytest.fixture(params=[DAEMONSET, JOB], ids=lambda p: p.name)
def pod(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Pod:
    """Lay out the pod's files under tmp_path, set its environment, and run its command line through elasticd's
    CLI with the daemon replaced by a recorder: the StartConfig that pod would run with."""
    docs = render(request.param)
    [(owner, template)] = list(pod_templates(docs))
    c = container(template, "elasticd")
    root = tmp_path / "pod"

    def inside(value: str) -> str:
        return str(root) + value if value.startswith("/") else value

    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    for mount in c["volumeMounts"]:
        where = root / mount["mountPath"].lstrip("/")
        where.mkdir(parents=True, exist_ok=True)
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            for file, text in the(docs, "ConfigMap", volume["configMap"]["name"])["data"].items():
                data = {k: inside(v) if isinstance(v, str) else v for k, v in yaml.safe_load(text).items()}
                (where / file).write_text(yaml.safe_dump(data))
        elif "secret" in volume:
            for key in secret_keys(volume["secret"]["secretName"]):
                (where / key).write_text(f"{key} of {volume['secret']['secretName']}\n")
    script = c["args"][split_start_args(c["args"])[1]]
    assert script.startswith(IMAGE_EXAMPLES), script
    (root / script.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "examples" / script.removeprefix(IMAGE_EXAMPLES), root / script.lstrip("/"))

    for name in [n for n in os.environ if n.startswith("ELASTICD_")]:
        monkeypatch.delenv(name)
    pod_name = f"{owner['metadata']['name']}-0-x7k2p" if owner["kind"] == "Job" else "elasticd-x7k2p"
    fields = {**_FIELDS, "metadata.name": pod_name, "metadata.namespace": owner["metadata"]["namespace"]}
    for source in c.get("envFrom", []):  # before env: the kubelet lets env override envFrom
        for name, value in the(docs, "ConfigMap", source["configMapRef"]["name"])["data"].items():
            monkeypatch.setenv(name, inside(value))
    for var in c.get("env", []):
        if "value" in var:
            monkeypatch.setenv(var["name"], inside(var["value"]))
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
        monkeypatch.setenv(var["name"], template["metadata"]["labels"][label[1]] if label else fields[path])

    seen: list[StartConfig] = []
    monkeypatch.setattr("elasticd.agent.daemon.run_daemon", records(seen, result=0))
    code = cli.main([inside(a) for a in c["args"]])
    assert code == 0, capsys.readouterr().err
    return Pod(docs, owner, template, seen[0], root)


@functools.cache
def secret_keys(name: str) -> tuple[str, ...]:
    """The keys of a Secret as make-certs.sh tells the user to create it (``--from-file=KEY[=FILE]``)."""
    text = (ETCD / "make-certs.sh").read_text()
    match = re.search(rf"create secret generic {name} (.*?)(?=create secret|\nNEXT)", text, re.S)
    assert match, f"make-certs.sh does not say how to create Secret {name}"
    keys = re.findall(r"--from-file=([\w.-]+)", match[1])
    assert keys
    return tuple(keys)


def test_pod_resolves_to_a_valid_elasticd_config(pod: Pod) -> None:
    """Args, env and the mounted config and Secret make elasticd start with external TLS etcd and a password."""
    assert pod.cfg.etcd and not pod.cfg.embedded_etcd
    access = pod.cfg.etcd_access
    assert access.ca_cert and access.cert and access.key and access.user == "elasticd"
    assert access.password == "password of elasticd-etcd"
    assert pod.cfg.local_addr == _FIELDS["status.podIP"]
    assert pod.cfg.metrics_addr == "0.0.0.0"
    assert pod.cfg.log_format == "json"
    assert pod.cfg.checkpoint_dir.is_relative_to(pod.root)


def test_grace_period_outlasts_the_drain_budget(pod: Pod) -> None:
    """terminationGracePeriodSeconds exceeds, with margin, the drain timeout elasticd resolves, and every value the
    pod declares anywhere (args, env, config file, default), whichever one elasticd ends up taking."""
    grace = pod.template["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pod.cfg.drain_timeout_s + GRACE_MARGIN_S, (grace, pod.cfg.drain_timeout_s)
    c, config = pod.container, _elasticd_config(pod.docs)
    declared: list[Any] = [cli_default("drain-timeout")]
    declared += [v for k, v in config.items() if k.lstrip("-").replace("_", "-") == "drain-timeout"]
    declared += [e["value"] for e in c.get("env", []) if e["name"] == "ELASTICD_DRAIN_TIMEOUT"]
    declared += [v for k, v in split_start_args(c["args"])[0].items() if k == "drain-timeout"]
    assert grace >= max(float(v) for v in declared) + GRACE_MARGIN_S, (grace, declared)


def test_pod_identity_and_metrics_port_match_elasticd(pod: Pod) -> None:
    """Node id: the node (DaemonSet) or the pod (Job); run id: the pod's run label; probes and port: metrics-port."""
    if pod.owner["kind"] == "DaemonSet":
        assert pod.cfg.node_id == _FIELDS["spec.nodeName"]
    else:
        assert pod.cfg.node_id.startswith(pod.owner["metadata"]["name"] + "-0-")
    assert pod.cfg.run_id == pod.template["metadata"]["labels"]["app.kubernetes.io/instance"]
    c = pod.container
    [port] = [p for p in c["ports"] if p["name"] == "metrics"]
    assert port["containerPort"] == pod.cfg.metrics_port == cli_default("metrics-port")
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe


def test_status_and_stop_in_the_pod_need_no_flags(pod: Pod) -> None:
    """`kubectl exec POD -- elasticd status` (or stop) finds etcd, its credentials and the run in the environment."""
    for command in (cli.status, cli.stop):
        params = command.make_context(str(command.name), []).params
        assert params["etcd"] == pod.cfg.etcd_text and params["run_id"] == pod.cfg.run_id, command.name
        files = (params["etcd_cacert"], params["etcd_cert"], params["etcd_key"], params["etcd_password_file"])
        assert params["etcd_user"] == pod.cfg.etcd_access.user and all(files), command.name


def cli_default(name: str) -> Any:
    return start_options()[name].default


@pytest.mark.parametrize("overlay", [DAEMONSET, JOB], ids=lambda p: p.name)
def test_pod_runs_on_gpu_nodes_on_the_host_network_with_shared_memory(overlay: Path) -> None:
    """GPU node selector, hostNetwork with cluster DNS, /dev/shm in memory, the checkpoint PVC, a non-root user."""
    docs = render(overlay)
    [(_owner, template)] = list(pod_templates(docs))
    spec = template["spec"]
    assert spec["nodeSelector"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["securityContext"]["runAsNonRoot"] is True
    c = container(template, "elasticd")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    claim = mounts[_elasticd_config(docs)["checkpoint-dir"]]["persistentVolumeClaim"]["claimName"]
    assert "ReadWriteMany" in the(docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"]
    assert "nvidia.com/gpu" in c["resources"]["limits"]


# --- the Job -----------------------------------------------------------------------------------------------------


def test_job_fails_at_once_on_a_usage_error_and_ignores_disruptions() -> None:
    """podFailurePolicy: elasticd's usage exit code fails the Job; a DisruptionTarget pod is replaced uncounted."""
    job = the(render(JOB), "Job")
    spec = job["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail == [
        {"action": "FailJob", "onExitCodes": {"containerName": "elasticd", "operator": "In", "values": [EXIT_USAGE]}}
    ]
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert ignore == [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # required by podFailurePolicy
    assert spec["podReplacementPolicy"] == "Failed"


def test_job_is_indexed_with_one_pod_per_node_up_to_max_nodes() -> None:
    """Indexed completions = parallelism = max-nodes >= min-nodes; pods named through the headless Service."""
    docs = render(JOB)
    job, config = the(docs, "Job"), _elasticd_config(docs)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == config["max-nodes"] >= config["min-nodes"]
    service = the(docs, "Service", spec["template"]["spec"]["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    assert matches(service["spec"]["selector"], spec["template"]["metadata"]["labels"])


# --- etcd auth Job and documentation -----------------------------------------------------------------------------


def test_enable_auth_job_reaches_etcd_with_the_elasticd_client_secret() -> None:
    """The auth Job talks TLS to the etcd Service with files from the Secrets it mounts, and runs its script."""
    docs = render(K8S / "etcd-auth")
    template = the(docs, "Job")["spec"]["template"]
    c = container(template, "enable-auth")
    env = {e["name"]: e.get("value", "") for e in c["env"]}
    assert env["ETCDCTL_ENDPOINTS"] == "https://etcd.$(POD_NAMESPACE).svc:2379"
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounted: set[str] = set()
    for m in c["volumeMounts"]:
        v = volumes[m["name"]]
        if "secret" in v:
            mounted |= {f"{m['mountPath']}/{k}" for k in secret_keys(v["secret"]["secretName"])}
        else:
            cm = the(docs, "ConfigMap", v["configMap"]["name"])
            mounted |= {f"{m['mountPath']}/{k}" for k in cm["data"]}
    files = [v for k, v in env.items() if k.endswith(("_CACERT", "_CERT", "_KEY", "_FILE"))]
    assert set(files) <= mounted and len(files) == 5
    assert f"{c['command'][-1]}" in mounted


def test_deploy_doc_names_existing_paths() -> None:
    """Every k8s/, deploy/ and grafana/ path that docs/deploy-kubernetes.md names exists."""
    text = DEPLOY_DOC.read_text()
    paths = set(re.findall(r"(?<![\w/.-])((?:k8s|deploy|grafana)/[\w./-]*\w)", text))
    assert {"k8s/etcd", "k8s/etcd-auth", "k8s/overlays/daemonset", "k8s/overlays/job"} <= paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing


# --- etcd's flags, the auth Job's script and elasticd's config, run for real -------------------------------------


@pytest.fixture
def secured_etcd(certs: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    """One etcd member started with the StatefulSet's own flags (addresses and files mapped to this machine),
    after enable-auth.sh ran on it; yields the environment etcdctl and the script use."""
    binary = find_etcd_binary()
    client, peer, metrics = free_port(), free_port(), free_port()
    local = {
        "--name": "etcd-0",
        "--data-dir": str(tmp_path / "etcd"),
        "--listen-client-urls": f"https://127.0.0.1:{client}",
        "--advertise-client-urls": f"https://127.0.0.1:{client}",
        "--listen-peer-urls": f"https://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls": f"https://127.0.0.1:{peer}",
        "--initial-cluster": f"etcd-0=https://127.0.0.1:{peer}",
        "--listen-metrics-urls": f"http://127.0.0.1:{metrics}",
    }
    files = {
        "/etc/etcd/tls/ca.crt": "ca.crt",
        "/etc/etcd/tls/tls.crt": "server.crt",
        "/etc/etcd/tls/tls.key": "server.key",
    }
    [sts] = yaml.safe_load_all((ETCD / "statefulset.yaml").read_text())
    args = []
    for arg in container(sts["spec"]["template"], "etcd")["args"]:
        flag, sep, value = arg.partition("=")
        value = local.get(flag, str(certs / files[value]) if value in files else value)
        assert "$(" not in value, arg
        args.append(f"{flag}={value}" if sep else flag)
    log = (tmp_path / "etcd.log").open("wb")
    proc = subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    env = {
        **os.environ,
        "PATH": f"{Path(binary).parent}{os.pathsep}{os.environ['PATH']}",  # etcdctl ships next to etcd
        "ETCDCTL_ENDPOINTS": f"https://127.0.0.1:{client}",
        "ETCDCTL_CACERT": str(certs / "ca.crt"),
        "ETCDCTL_CERT": str(certs / "client.crt"),
        "ETCDCTL_KEY": str(certs / "client.key"),
        "ROOT_PASSWORD_FILE": str(certs / "root-password"),
        "USER_PASSWORD_FILE": str(certs / "elasticd-password"),
    }
    try:
        wait_until(lambda: _healthy(metrics), ETCD_READY_TIMEOUT_S, "etcd with the StatefulSet's flags")
        yield env
    finally:
        kill_tree(proc)
        log.close()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return b'"health":"true"' in response.read()
    except OSError:
        return False


def _enable_auth(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = K8S / "etcd-auth" / "enable-auth.sh"
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_auth_script_is_idempotent_and_elasticd_trains_as_its_least_privileged_user(
    secured_etcd: dict[str, str], certs: Path, tmp_path: Path
) -> None:
    """enable-auth.sh turns auth on once; the elasticd user may write /elasticd/ only, and that is enough for a
    real elasticd start with k8s/base's config and etcd access (TLS, user, password file) to train and commit."""
    first, again = _enable_auth(secured_etcd), _enable_auth(secured_etcd)
    assert first.returncode == 0 and "enabled" in first.stdout, first.stderr
    assert again.returncode == 0 and "already enabled" in again.stdout, again.stderr

    user = f"--user=elasticd:{(certs / 'elasticd-password').read_text()}"
    outside = subprocess.run(["etcdctl", user, "put", "/not-elasticd", "x"], env=secured_etcd, capture_output=True)
    assert outside.returncode != 0 and b"permission denied" in outside.stderr

    docs = render(K8S / "base")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    mapped = {"ca.crt": "ca.crt", "tls.crt": "client.crt", "tls.key": "client.key", "password": "elasticd-password"}
    for name, value in _etcd_access(docs).items():
        env[name] = str(certs / mapped[Path(value).name]) if value.startswith("/") else value
    env["ELASTICD_ETCD"] = secured_etcd["ETCDCTL_ENDPOINTS"].removeprefix("https://")
    config = _elasticd_config(docs) | {
        "checkpoint-dir": str(tmp_path / "checkpoints"),
        "checkpoint-every-steps": 10,
        "min-nodes": 1,
        "max-nodes": 1,
        "nproc-per-node": 1,
        "metrics-port": 0,
    }
    (tmp_path / "elasticd.yaml").write_text(yaml.safe_dump(config))
    env |= {"ELASTICD_CONFIG": str(tmp_path / "elasticd.yaml"), "ELASTICD_RUN_ID": "k8s", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "elasticd", "start", "--local-addr", "127.0.0.1", str(EXAMPLE), *train_args(10)]
    run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "k8s" / "step-000000000010" / "elasticd.json").exists()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_least_privileged_user_decides_a_change_in_place(secured_etcd: dict[str, str], certs: Path) -> None:
    """A change in place as the elasticd user: the members bid and their decider decides, on the run's keys alone.
    At f7f9a29 the decider asked the store's revision through a read of key "\\0", outside the user's prefix:
    etcd refused it, and every change in place of a least-privileged deployment would have failed (the single-node
    run above never makes one)."""
    assert _enable_auth(secured_etcd).returncode == 0
    client = EtcdClient.connect(
        parse_endpoints(secured_etcd["ETCDCTL_ENDPOINTS"].removeprefix("https://")),
        ca_cert=str(certs / "ca.crt"),
        cert=str(certs / "client.crt"),
        key=str(certs / "client.key"),
        user="elasticd",
        password=(certs / "elasticd-password").read_text(),
    )
    try:
        membership = Membership(client, RunKeys("least-privileged"))
        members = ["m0", "m1"]
        for rank, member in enumerate(members):
            membership.bid(1, Bid(member, rank, 5))

        def attempt() -> Epoch | None:
            return membership.try_decide(1, members, lambda _m: False, min_members=2, round_=0, reason="failure")

        epoch = decide(membership, 1, members, "m0", lambda _m: False, attempt, timeout_s=30)
        assert epoch.members == ("m0", "m1") and epoch.step == 5
    finally:
        client.close()
