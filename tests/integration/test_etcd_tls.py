"""elasticd against an etcd that requires TLS client certificates and a password (certificates made here).

The etcd 3.5 server runs with ``--client-cert-auth`` over https on 127.0.0.1 and auth enabled (root user). A real
``elasticd start`` trains through it (rendezvous, store, registry, the workers' fence), ``elasticd status`` reads
it, and a wrong password or a CA that did not sign the server's certificate ends in one clear line and exit 2.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from elasticd.etcd.server import find_etcd_binary
from tests.helpers import free_port, kill_tree
from tests.integration.cluster import EXAMPLE, read_json_lines, train_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PASSWORD = "s3cret-pw"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing etcd presents


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(name: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, server: bool) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usage = (
        [x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]
        if server
        else [x509.ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    )
    if server:
        san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    d = tmp_path / "pki"
    d.mkdir()
    ca, ca_key = _ca("elasticd-test-ca")
    other, _ = _ca("someone-else")
    files = {
        "ca.pem": ca.public_bytes(serialization.Encoding.PEM),
        "other-ca.pem": other.public_bytes(serialization.Encoding.PEM),
    }
    files["server.pem"], files["server-key.pem"] = _leaf("etcd", ca, ca_key, server=True)
    files["client.pem"], files["client-key.pem"] = _leaf("elasticd", ca, ca_key, server=False)
    for name, data in files.items():
        (d / name).write_bytes(data)
        (d / name).chmod(0o600)
    return Pki(
        d / "ca.pem", d / "server.pem", d / "server-key.pem", d / "client.pem", d / "client-key.pem", d / "other-ca.pem"
    )


@pytest.fixture
def secure_etcd(tmp_path: Path, pki: Pki) -> Iterator[str]:
    """An etcd with TLS, client-certificate auth and user/password auth; yields HOST:PORT."""
    binary = find_etcd_binary()
    client_port, peer_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{client_port}"
    log = (tmp_path / "etcd.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            "--name",
            "tls",
            "--data-dir",
            str(tmp_path / "etcd-data"),
            "--listen-client-urls",
            f"https://{endpoint}",
            "--advertise-client-urls",
            f"https://{endpoint}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-cluster",
            f"tls=http://127.0.0.1:{peer_port}",
            "--cert-file",
            str(pki.server_cert),
            "--key-file",
            str(pki.server_key),
            "--trusted-ca-file",
            str(pki.ca),
            "--client-cert-auth",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    etcdctl = str(Path(binary).with_name("etcdctl"))
    tls = [
        "--endpoints",
        f"https://{endpoint}",
        "--cacert",
        str(pki.ca),
        "--cert",
        str(pki.client_cert),
        "--key",
        str(pki.client_key),
    ]
    try:
        deadline = time.monotonic() + 20
        while subprocess.run([etcdctl, *tls, "endpoint", "health"], capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, (tmp_path / "etcd.log").read_text()
            time.sleep(0.2)
        for args in (["user", "add", f"root:{PASSWORD}"], ["auth", "enable"]):
            done = subprocess.run([etcdctl, *tls, *args], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
        yield endpoint
    finally:
        kill_tree(proc)
        proc.wait(timeout=10)
        log.close()


def _flags(endpoint: str, pki: Pki, password_file: Path, *, ca: Path | None = None) -> list[str]:
    return [
        "--etcd",
        endpoint,
        "--etcd-cacert",
        str(ca or pki.ca),
        "--etcd-cert",
        str(pki.client_cert),
        "--etcd-key",
        str(pki.client_key),
        "--etcd-user",
        "root",
        "--etcd-password-file",
        str(password_file),
        "--etcd-connect-timeout",
        "10",
    ]


def _elasticd(*args: str, cwd: Path, timeout_s: float = 150) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    import os

    return subprocess.run(
        [sys.executable, "-m", "elasticd", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **env},
        timeout=timeout_s,
    )


def test_training_and_status_work_through_tls_and_password_auth(secure_etcd: str, pki: Pki, tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    flags = _flags(secure_etcd, pki, secret)
    run = _elasticd(
        "start",
        *flags,
        "--run-id",
        "tls",
        "--node-id",
        "tls-a",
        "--nproc-per-node",
        "2",
        "--metrics-port",
        "0",
        "--local-addr",
        "127.0.0.1",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every-steps",
        "10",
        "--log-format",
        "json",
        str(EXAMPLE),
        *train_args(20, 0.02),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    events = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    assert any(e.get("event") == "rendezvous_done" and e.get("world_size") == 2 for e in events)
    steps = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"event": "step"')]
    assert steps and steps[-1]["step"] == 20
    # the workers' fence committed through the same TLS + password access
    assert (tmp_path / "ckpt" / "tls" / "step-000000000020" / "elasticd.json").exists()

    status = _elasticd("status", *flags, "--run-id", "tls", "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["run_id"] == "tls"
    assert not list(read_json_lines(tmp_path / "nothing"))


@pytest.mark.parametrize("mistake", ["password", "ca"])
def test_wrong_password_or_ca_is_one_clear_line_and_exit_2(
    secure_etcd: str, pki: Pki, tmp_path: Path, mistake: str
) -> None:
    secret = tmp_path / "password"
    secret.write_text(PASSWORD if mistake != "password" else "not-the-password")
    flags = _flags(secure_etcd, pki, secret, ca=pki.other_ca if mistake == "ca" else None)
    for command in (["status", *flags, "--run-id", "tls"], ["start", *flags, "--metrics-port", "0", str(EXAMPLE)]):
        started = time.monotonic()
        done = _elasticd(*command, cwd=tmp_path, timeout_s=60)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and lines[0].startswith("elasticd: error: "), done.stderr
        assert "Traceback" not in done.stderr
        expected = "password" if mistake == "password" else "--etcd-cacert"
        assert expected in lines[0] and secure_etcd in lines[0], lines[0]
        assert time.monotonic() - started < 9, "a refused login must not wait for the connect timeout"
