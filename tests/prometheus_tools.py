"""Prometheus and promtool for the tests: found on PATH, or installed from Debian's ``prometheus`` package.

:func:`require_prometheus` installs the package once per test session when a binary is missing (as root, with
``apt-get``, without recommends, so that no node exporter comes along) and never lets the package start its
system service: a ``policy-rc.d`` that forbids service starts is in place during the install. Only when the
install is impossible or fails does the calling test skip, with the reason printed.

:class:`PrometheusServer` is a real Prometheus on 127.0.0.1 (a free port, a temporary data dir) for one test
module, queried through its HTTP API and stopped, with its whole process group, on exit.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import free_port

PACKAGE = "prometheus"
# Seconds per apt-get command (update, then install: ~30 MB); tests that may install allow for two of these.
INSTALL_TIMEOUT_S = 240
# invoke-rc.d asks this script whether a service may start; exit code 101 means "no" (policy-rc.d(8)).
_POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
_DENY_SERVICE_STARTS = "#!/bin/sh\n# elasticd's tests: no service starts while prometheus installs\nexit 101\n"


@dataclass(frozen=True, slots=True)
class PrometheusTools:
    prometheus: Path
    promtool: Path


def require_prometheus() -> PrometheusTools:
    """The two binaries, installed if needed; skips the calling test (reason printed) when that is impossible."""
    tools, reason = _find_or_install()
    if tools is None:
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return tools


@functools.cache
def _find_or_install() -> tuple[PrometheusTools | None, str]:
    tools = _find()
    if tools is not None:
        return tools, ""
    if not shutil.which("apt-get"):
        return None, "prometheus/promtool not on PATH and no apt-get to install Debian's prometheus package"
    if os.geteuid() != 0:
        return None, "prometheus/promtool not on PATH and installing Debian's prometheus package needs root"
    error = _apt_install()
    tools = _find()
    if tools is None:
        return None, f"installing Debian's {PACKAGE} package failed: {error or 'binaries still missing'}"
    return tools, ""


def _find() -> PrometheusTools | None:
    found = [shutil.which(name) for name in ("prometheus", "promtool")]
    if not all(found):
        return None
    return PrometheusTools(Path(str(found[0])), Path(str(found[1])))


def _apt_install() -> str:
    """Runs apt-get with service starts forbidden; returns the tail of the output on failure, else ''."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", RUNLEVEL="1")
    wrote_policy = not _POLICY_RC_D.exists()
    if wrote_policy:
        _POLICY_RC_D.write_text(_DENY_SERVICE_STARTS)
        _POLICY_RC_D.chmod(0o755)
    try:
        for cmd in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", PACKAGE],
        ):
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"{' '.join(cmd)}: {exc}"
            if done.returncode != 0:
                return f"{' '.join(cmd)} exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}"
        return ""
    finally:
        if wrote_policy:
            _POLICY_RC_D.unlink(missing_ok=True)


class PrometheusServer:
    """``prometheus`` scraping ``targets`` every ``scrape_interval_s`` and evaluating ``rule_files``.

    Use as a context manager; the server is ready (``/-/ready``) when ``__enter__`` returns.
    """

    def __init__(
        self,
        binary: Path,
        workdir: Path,
        targets: list[str],
        *,
        job: str,
        rule_files: tuple[Path, ...] = (),
        scrape_interval_s: int = 1,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        interval = f"{scrape_interval_s}s"
        self.config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "rule_files": [str(path.resolve()) for path in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
        }

    def __enter__(self) -> PrometheusServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config))
        cmd = [
            str(self.binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
        ]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self._proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {self._ready_timeout_s}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL if it is still there after 10 s."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def api(self, path: str, **params: str) -> dict[str, Any]:
        """GET /api/v1/<path>; returns the JSON body, errors included (status "error", errorType, error)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:  # 400 for a query that does not parse, 422 for one that fails
            body = exc.read()
        result: dict[str, Any] = json.loads(body)
        return result

    def query(self, expr: str) -> dict[str, Any]:
        """An instant query at the current time."""
        return self.api("query", query=expr)
