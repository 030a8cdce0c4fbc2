"""A small typed etcd v3 client over pyetcd, safe to share between threads.

This module owns how elasticd talks to etcd: connecting (with TLS/auth, a bounded retry until the cluster
answers), the handful of key/lease/watch operations the daemon needs, and error translation. Every failed call
is reported to ``on_error`` (the daemon counts them) and raised as :class:`EtcdError` naming the endpoint and
the gRPC status; no raw gRPC exception escapes. Keys are ``str`` (UTF-8 in etcd), values ``bytes`` (etcd v3
stores binary as is).
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pyetcd
import pyetcd.exceptions
import pyetcd.utils
import tenacity

from elasticd import options as o
from elasticd.endpoints import Endpoint, format_endpoints
from elasticd.envvars import ETCD_PASSWORD
from elasticd.errors import ConfigError, EtcdAccessError, EtcdUnavailableError
from elasticd.etcd.errors import REFUSED_CODES, EtcdError, EtcdLeaseNotFoundError
from elasticd.etcd.keepalive import KeepAliveStream, StreamBroken, keepalive_request
from elasticd.etcd.ranges import RangeReads, check_prefix
from elasticd.etcd.watches import Watches

T = TypeVar("T")
ErrorHook = Callable[[Exception], None]

# etcd rejects a transaction with more operations than --max-txn-ops (default 128); bigger batches are split.
MAX_TXN_OPS = 128
# After a failure pyetcd skips an endpoint for this long and fails over to another one (seconds). It must
# exceed the usual gap between calls (keep-alives every ~1 s), or pyetcd would retry the dead endpoint
# forever.
_FAILOVER_BACKOFF_S = 10.0
# Connect retries back off from 0.1 s to 1 s: quick while etcd starts, gentle on a dead address.
_CONNECT_WAIT = tenacity.wait_exponential(multiplier=0.1, min=0.1, max=1.0)
# gRPC channel options. A call made while etcd is briefly away (restart, leader change) waits for the
# connection within its own deadline instead of failing at once, and reconnect attempts back off from 0.1 s to
# at most 1 s (gRPC's default grows to 120 s, which would keep a restarted etcd unreachable for minutes).
_CHANNEL_OPTIONS = [
    ("grpc.service_config", json.dumps({"methodConfig": [{"name": [{}], "waitForReady": True}]})),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # A stream on a member that went silent (its link down: no reset, no error) is found dead by pings within
    # ~KEEPALIVE_TIME + KEEPALIVE_TIMEOUT: a watch on it would otherwise wait for events that never come (seen in the
    # suite: a joiner unseen for 40 s by a group whose watches were on a member cut off). etcd refuses pings closer
    # than 5 s apart (--grpc-keepalive-min-time), and gRPC stops pinging a stream without data after 2 pings unless
    # told otherwise (an idle watch sends none).
    ("grpc.keepalive_time_ms", 6000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.http2.max_pings_without_data", 0),
]
_RPC_ERRORS = (pyetcd.exceptions.Etcd3Exception, grpc.RpcError)
# etcd's answers to a token it no longer takes: forgotten (a restart, expiry), or checked against an auth revision
# that moved before the request was applied (a user or role changed meanwhile: any permission granted or revoked).
# Logging in again and retrying once is the cure for both.
_STALE_TOKEN = ("invalid auth token", "auth: revision in header is old")
# Answers that no retry will change: a refused login or a certificate that does not verify. Connecting fails at
# once with one clear line instead of retrying until the connect timeout.
_ACCESS_DENIED = (
    "authentication failed",
    "invalid user id or password",
    "user name is empty",
    "user name not found",
    "permission denied",
    "certificate_verify_failed",
    "certificate verify failed",
    "ssl handshake failed",
    "handshake failed",
)


_READS = frozenset({"get", "get_prefix", "count", "revision", "lease_ttl"})  # safe to ask twice
# Between two attempts within the grace (seconds): about an etcd heartbeat, at most a few.
_ELECTION_RETRY_WAIT = tenacity.wait_exponential(multiplier=0.05, min=0.05, max=0.5)


@dataclass(frozen=True, slots=True)
class PutIfResult:
    """Outcome of :meth:`EtcdClient.put_if`: whether it wrote, and the key's (value, mod_revision) after."""

    succeeded: bool
    current: tuple[bytes, int] | None


class EtcdClient(RangeReads, Watches):
    """Typed etcd operations; all calls are serialised through one lock (pyetcd's failover state is not
    thread-safe), and each is bounded by the request timeout."""

    def __init__(
        self,
        raw: pyetcd.MultiEndpointEtcd3Client,
        endpoints: Sequence[Endpoint],
        on_error: ErrorHook | None = None,
        *,
        login: tuple[str, str] | None = None,
        reconnect: Callable[..., EtcdClient],
        election_grace_s: float = 0.0,
    ) -> None:
        self._raw = raw
        self._endpoints = tuple(endpoints)
        self._on_error = on_error
        self._login = login  # (user, password): to get a new token when etcd forgot ours
        self._reconnect = reconnect  # connect() again with the arguments that made this client
        self._election_grace_s = election_grace_s
        self._lock = threading.RLock()
        # lease refreshes: one long-lived stream for all of this client's leases (keepalive.py)
        self._keepalive = KeepAliveStream(self._open_keepalive, keepalive_request)

    @classmethod
    def connect(
        cls,
        endpoints: Sequence[Endpoint],
        *,
        connect_timeout_s: float = o.ETCD_CONNECT_TIMEOUT.default,
        request_timeout_s: float = 5.0,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        on_error: ErrorHook | None = None,
        election_grace_s: float = 0.0,
    ) -> EtcdClient:
        """Connect and check that the cluster answers, retrying until ``connect_timeout_s``.

        ``election_grace_s`` > 0: a call that fails while etcd elects a leader or on a member that went away is tried
        again (on another member: pyetcd fails over) for up to that long (a retried write may have been applied).

        Raises ConfigError for inconsistent TLS/auth options and EtcdUnavailableError when nobody answered.
        """
        if not endpoints:
            raise ConfigError(o.ETCD.flag, "no etcd endpoint given")
        if (user is None) != (password is None):
            raise ConfigError("etcd user/password", "give both the user and the password, or neither")
        creds = _tls_credentials(ca_cert, cert, key)
        text = format_endpoints(list(endpoints))
        if ca_cert is not None:
            _check_tls(endpoints, ca_cert, cert, key, min(request_timeout_s, connect_timeout_s))
        # Calls wait for a connection until their deadline, so a dead endpoint costs a whole attempt before
        # pyetcd fails over: leave time in the connect budget to try each endpoint.
        attempt_timeout_s = min(request_timeout_s, connect_timeout_s / len(endpoints))

        clients: list[EtcdClient] = []  # one pyetcd client across attempts: it remembers failed endpoints
        again = functools.partial(
            cls.connect,
            endpoints,
            connect_timeout_s=connect_timeout_s,
            request_timeout_s=request_timeout_s,
            ca_cert=ca_cert,
            cert=cert,
            key=key,
            user=user,
            password=password,
            on_error=on_error,
            election_grace_s=election_grace_s,
        )

        def attempt() -> EtcdClient:
            if not clients:
                raw = _raw_client(endpoints, creds, attempt_timeout_s, user, password, on_error)
                login = (user, password) if user is not None and password is not None else None
                clients.append(cls(raw, endpoints, on_error, login=login, reconnect=again))
            client = clients[0]
            try:
                client._call("status", client._raw.status)
                if user is None:
                    client.revision()  # status needs no login; a read does: an etcd that requires one says so now
            except EtcdError as exc:
                raise _access_error(exc, text) or exc from None
            client._raw.timeout = request_timeout_s
            client._election_grace_s = election_grace_s
            return client

        try:
            return tenacity.Retrying(
                stop=tenacity.stop_after_delay(connect_timeout_s),
                wait=_CONNECT_WAIT,
                retry=tenacity.retry_if_exception_type(EtcdError),
            )(attempt)
        except tenacity.RetryError as exc:
            for client in clients:
                client.close()
            last = exc.last_attempt.exception()
            raise EtcdUnavailableError(text, connect_timeout_s, str(last) if last else "") from None

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._endpoints

    def reconnect(self, request_timeout_s: float | None = None) -> EtcdClient:
        """A new client on a connection of its own to the same endpoints, with this client's TLS files, credentials,
        timeouts (or ``request_timeout_s``) and error hook: it works on after this one is closed (close it apart).
        Raises what :meth:`connect` raises."""
        return self._reconnect() if request_timeout_s is None else self._reconnect(request_timeout_s=request_timeout_s)

    # -- keys ----------------------------------------------------------------------------------------------

    def get(self, key: str) -> tuple[bytes, int] | None:
        """The value and mod_revision of ``key``, or None when absent."""
        value, meta = self._call("get", lambda: self._raw.get(key))
        return None if meta is None else (bytes(value), int(meta.mod_revision))

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The values of those ``keys`` that exist (one atomic read per 128 keys)."""
        found: dict[str, bytes] = {}
        for start in range(0, len(keys), MAX_TXN_OPS):
            chunk = list(keys[start : start + MAX_TXN_OPS])
            ops = [self._raw.transactions.get(k) for k in chunk]
            read = functools.partial(self._raw.transaction, compare=[], success=ops, failure=[])
            _, responses = self._call("get", read)
            for k, kvs in zip(chunk, responses, strict=True):
                if kvs:
                    found[k] = bytes(kvs[0][0])
        return found

    def put(self, key: str, value: bytes | str, lease_id: int | None = None) -> None:
        self._call("put", lambda: self._raw.put(key, value, lease=lease_id))

    def put_if(self, key: str, value: bytes | str, mod_revision: int, lease_id: int | None = None) -> PutIfResult:
        """Write only if the key's mod_revision equals ``mod_revision`` (0: only if absent), in one
        transaction that also returns the key's value and mod_revision afterwards, whether it wrote or not."""
        tx = self._raw.transactions
        succeeded, responses = self._call(
            "compare-and-swap",
            lambda: self._raw.transaction(
                compare=[tx.mod(key) == mod_revision],
                success=[tx.put(key, value, lease=lease_id), tx.get(key)],
                failure=[tx.get(key)],
            ),
        )
        kvs = responses[-1]
        current = (bytes(kvs[0][0]), int(kvs[0][1].mod_revision)) if kvs else None
        return PutIfResult(bool(succeeded), current)

    def put_if_equal(self, guard_key: str, expected: bytes | str, key: str, value: bytes | str) -> bool:
        """Write ``key`` only if ``guard_key`` currently holds ``expected`` (a fence); True when written."""
        return self.put_all_if_equal(guard_key, expected, {key: value})

    def put_all(self, items: dict[str, bytes | str]) -> None:
        """Write every key of ``items`` in one transaction: a reader sees all of them or none."""
        tx = self._raw.transactions
        puts = [tx.put(key, value) for key, value in items.items()]
        self._call("put", lambda: self._raw.transaction(compare=[], success=puts, failure=[]))

    def put_all_if_equal(self, guard_key: str, expected: bytes | str, items: dict[str, bytes | str]) -> bool:
        """Write every key of ``items`` in one transaction, only if ``guard_key`` currently holds ``expected``;
        True when written (all of them), False when the guard did not hold (none of them)."""
        tx = self._raw.transactions
        return self._put_all("fenced put", tx.value(guard_key) == expected, items)

    def put_all_if_revision(self, guard_key: str, mod_revision: int, items: dict[str, bytes | str]) -> bool:
        """Write every key of ``items`` in one transaction, only if ``guard_key``'s mod_revision is ``mod_revision``
        (0: only if it is absent); True when written (all of them), False when not (none of them)."""
        tx = self._raw.transactions
        return self._put_all("compare-and-swap", tx.mod(guard_key) == mod_revision, items)

    def put_all_if_revision_and_equal(
        self, revision_key: str, mod_revision: int, equal_key: str, expected: bytes | str, items: dict[str, bytes | str]
    ) -> bool:
        """Both guards at once: ``revision_key`` at ``mod_revision`` (0: absent) and ``equal_key`` holding
        ``expected``; True when every key of ``items`` was written in one transaction."""
        tx = self._raw.transactions
        compares = [tx.mod(revision_key) == mod_revision, tx.value(equal_key) == expected]
        return self._put_all("compare-and-swap", compares, items)

    def _put_all(self, operation: str, compare: Any, items: dict[str, bytes | str]) -> bool:
        tx = self._raw.transactions
        puts = [tx.put(key, value) for key, value in items.items()]
        compares = compare if isinstance(compare, list) else [compare]
        succeeded, _ = self._call(operation, lambda: self._raw.transaction(compare=compares, success=puts, failure=[]))
        return bool(succeeded)

    def create(self, key: str, value: bytes | str, lease_id: int | None = None) -> bool:
        """Write only if ``key`` is absent; True when written."""
        return self.put_if(key, value, 0, lease_id).succeeded

    def compare_and_swap(self, key: str, value: bytes | str, mod_revision: int, lease_id: int | None = None) -> bool:
        """Write only if the key's mod_revision is ``mod_revision``; True when written."""
        return self.put_if(key, value, mod_revision, lease_id).succeeded

    def delete(self, key: str) -> bool:
        """True when the key existed."""
        return bool(self._call("delete", lambda: self._raw.delete(key)))

    def delete_if_revision(self, key: str, mod_revision: int) -> bool:
        """Delete ``key`` only if its mod_revision is still ``mod_revision``; True when deleted."""
        tx = self._raw.transactions
        succeeded, _ = self._call(
            "delete",
            lambda: self._raw.transaction(compare=[tx.mod(key) == mod_revision], success=[tx.delete(key)], failure=[]),
        )
        return bool(succeeded)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many there were."""
        check_prefix(prefix)
        return int(self._call("delete_prefix", lambda: self._raw.delete_prefix(prefix)).deleted)

    def revision(self, key: str = "\0") -> int:
        """The store's current revision, from the header of a count-only read of ``key``: a user whose role may read
        only its run's keys passes one of them (etcd refuses a read outside the role's ranges)."""
        return int(self._call("revision", lambda: self._raw.get_response(key, count_only=True)).header.revision)

    # -- leases --------------------------------------------------------------------------------------------

    def grant_lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds (etcd raises it to 1.5 election timeouts at least); its id."""
        return self.grant_lease_ttl(ttl_s)[0]

    def grant_lease_ttl(self, ttl_s: int) -> tuple[int, int]:
        """:meth:`grant_lease`, and the TTL etcd granted (seconds)."""
        lease = self._call("grant_lease", lambda: self._raw.lease(ttl_s))
        return int(lease.id), int(lease.ttl)

    def refresh_lease(self, lease_id: int) -> bool:
        """Reset the lease's TTL; False when etcd no longer knows it (expired or revoked)."""
        try:
            return self._keepalive.refresh(lease_id, float(self._raw.timeout)) > 0
        except TimeoutError as exc:
            error = EtcdError("refresh_lease", self._endpoint_label(), "DEADLINE_EXCEEDED", str(exc))
            self._report(error)
            raise error from None
        except StreamBroken:
            pass  # the old way, a stream of its own: reported and failed over as any call (keepalive.py)
        responses = self._call("refresh_lease", lambda: list(self._raw.refresh_lease(lease_id)))
        return bool(responses) and int(responses[0].TTL) > 0

    def _open_keepalive(self, requests: Iterator[Any]) -> Any:
        with self._lock:
            raw = self._raw
            return raw.leasestub.LeaseKeepAlive(requests, credentials=raw.call_credentials, metadata=raw.metadata)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease and delete its keys; a lease already gone is not an error."""
        try:
            self._call("revoke_lease", lambda: self._raw.revoke_lease(lease_id), report=False)
        except EtcdLeaseNotFoundError:
            return
        except EtcdError as exc:
            self._report(exc)
            raise

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds the lease has left; -1 when it is gone."""
        return int(self._call("lease_ttl", lambda: self._raw.get_lease_info(lease_id)).TTL)

    def lease_of(self, key: str) -> int | None:
        """The lease ``key`` is attached to (None when absent or not leased)."""
        _, meta = self._call("get", lambda: self._raw.get(key))
        if meta is None or not meta.lease_id:
            return None
        return int(meta.lease_id)

    # -- watches -------------------------------------------------------------------------------------------

    def close(self) -> None:
        self._keepalive.close()
        with self._lock:
            self._raw.close()

    # -- internals -----------------------------------------------------------------------------------------

    def _call(self, operation: str, fn: Callable[[], T], report: bool = True, renewed: bool = False) -> T:
        if self._election_grace_s <= 0:
            return self._call_once(operation, fn, report, renewed)
        return _through_elections(self._election_grace_s)(self._call_once, operation, fn, report, renewed)

    def _call_once(self, operation: str, fn: Callable[[], T], report: bool = True, renewed: bool = False) -> T:
        try:
            with self._lock:
                return fn()
        except _RPC_ERRORS as exc:
            error = _translate(operation, self._endpoint_label(), exc)
            if isinstance(exc, pyetcd.exceptions.NoServerAvailableError):
                # Every endpoint failed within the failover backoff: the next call tries them all (etcd may be back)
                for endpoint in self._raw.endpoints.values():
                    endpoint.last_failed = 0
        lost = operation in _READS and "Stream removed" in str(error)  # its connection closed under it: once more
        if not renewed and (lost or (any(m in str(error) for m in _STALE_TOKEN) and self._renew_token())):
            return self._call_once(operation, fn, report, renewed=True)  # (a write may have been applied: never)
        if report:
            self._report(error)
        raise error

    def _renew_token(self) -> bool:
        """Log in again after etcd forgot our token (:func:`_log_in_again`); True on success."""
        if self._login is None:
            return False
        with self._lock:
            return _log_in_again(self._raw, *self._login)

    def _watch_error(self, error: BaseException) -> EtcdError:
        translated = _translate("watch", self._endpoint_label(), error)
        self._report(translated)
        return translated

    def _report(self, error: EtcdError) -> None:
        if self._on_error is not None:
            self._on_error(error)

    def endpoint_in_use(self) -> str:
        """``host:port`` of the member this client talks to now (all its endpoints when it cannot tell)."""
        return self._endpoint_label()

    def _endpoint_label(self) -> str:
        try:
            return str(self._raw.endpoint_in_use.netloc)
        except Exception:  # the label is only for the message; never let it hide the real error
            return format_endpoints(list(self._endpoints))


def _through_elections(grace_s: float) -> tenacity.Retrying:
    """Retries of a call that failed transiently (:attr:`EtcdError.transient`) for up to ``grace_s``."""
    return tenacity.Retrying(
        stop=tenacity.stop_after_delay(grace_s),
        wait=_ELECTION_RETRY_WAIT,
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, EtcdError) and e.transient),
        reraise=True,
    )


def _log_in_again(raw: pyetcd.MultiEndpointEtcd3Client, user: str, password: str) -> bool:
    """A new token after etcd forgot ours (it restarted, or the token expired unused) or a user or role changed while
    a request of ours was in flight ("auth: revision in header is old"); True on success.

    The watch stream carries the old token, so it is replaced (watches on it end; their callers re-read)."""
    request = pyetcd.etcdrpc.AuthenticateRequest(name=user, password=password)
    try:
        token = raw.authstub.Authenticate(request, raw.timeout).token
        raw.metadata = (("token", token),)
        if raw.call_credentials is not None:
            raw.call_credentials = grpc.metadata_call_credentials(pyetcd.client.EtcdTokenCallCredentials(token))
        old_watcher, raw.watcher = raw.watcher, raw.get_watcher()
    except _RPC_ERRORS:
        return False
    with contextlib.suppress(*_RPC_ERRORS):
        old_watcher.close()
    return True


def _raw_client(
    endpoints: Sequence[Endpoint],
    creds: grpc.ChannelCredentials | None,
    timeout_s: float,
    user: str | None,
    password: str | None,
    on_error: ErrorHook | None,
) -> pyetcd.MultiEndpointEtcd3Client:
    """pyetcd's client over ``endpoints``, failing over between them; it logs in here when given a user."""
    try:
        raw = pyetcd.MultiEndpointEtcd3Client(
            endpoints=[_pyetcd_endpoint(e, creds, len(endpoints)) for e in endpoints],
            timeout=timeout_s,
            user=user,
            password=password,
            failover=True,
        )
    except _RPC_ERRORS as exc:  # authentication happens in the constructor
        text = format_endpoints(list(endpoints))
        error = _translate("authenticate", text, exc)
        if on_error is not None:
            on_error(error)
        raise _access_error(error, text) or error from None
    if creds is None:
        # gRPC never sends call credentials over a channel without TLS; the token also travels as plain metadata,
        # which is what etcd reads (loopback, or a network the operator trusts).
        raw.call_credentials = None
    return raw


def _translate(operation: str, endpoint: str, exc: BaseException) -> EtcdError:
    rpc = exc if isinstance(exc, grpc.RpcError) else exc.__context__
    if isinstance(rpc, grpc.RpcError) and hasattr(rpc, "code"):
        code, detail = rpc.code().name, str(rpc.details() or "")
    else:
        code, detail = type(exc).__name__, str(exc) or type(exc).__name__
    if "lease not found" in detail:
        return EtcdLeaseNotFoundError(operation, endpoint, code, detail)
    return EtcdError(operation, endpoint, code, detail)


def _access_error(error: EtcdError, endpoints: str) -> EtcdAccessError | None:
    detail = str(error).lower()
    if error.code in REFUSED_CODES or any(s in detail for s in _ACCESS_DENIED):
        hint = "check --etcd-cacert/--etcd-cert/--etcd-key" if "cert" in detail or "ssl" in detail else ""
        hint = hint or f"check {o.ETCD_USER.flag} and the password ({o.ETCD_PASSWORD_FILE.flag} or {ETCD_PASSWORD})"
        return EtcdAccessError(f"etcd at {endpoints} refused the connection: {error.code}: {_short(error)}; {hint}")
    return None


def _short(error: EtcdError) -> str:
    """The gRPC detail on one line, without gRPC's addresses-and-timestamps preamble."""
    text = " ".join(str(error).split(": ", 3)[-1].split())
    return text if len(text) <= 200 else text[:197] + "..."


def _check_tls(
    endpoints: Sequence[Endpoint], ca_cert: str, cert: str | None, key: str | None, timeout_s: float
) -> None:
    """One TLS handshake with Python's ssl before gRPC: gRPC only reports a certificate that does not verify as a
    deadline exceeded, after retrying until the connect timeout; this names the reason at once. An endpoint that
    does not answer at all is left to the normal connect retries."""
    context = ssl.create_default_context(cafile=ca_cert)
    if cert is not None and key is not None:
        context.load_cert_chain(cert, key)
    for endpoint in endpoints:
        try:
            with (
                socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s) as raw,
                context.wrap_socket(raw, server_hostname=endpoint.host),
            ):
                return
        except ssl.SSLError as exc:
            reason = getattr(exc, "verify_message", None) or exc.reason or str(exc)
            raise EtcdAccessError(
                f"etcd at {endpoint.netloc}: TLS handshake failed ({reason}); check --etcd-cacert (the CA that signed"
                " etcd's certificate) and --etcd-cert/--etcd-key"
            ) from None
        except OSError:
            continue


def _tls_credentials(ca_cert: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    if (cert is None) != (key is None):
        raise ConfigError("etcd cert/key", "give both the client certificate and its key, or neither")
    if ca_cert is None:
        if cert is not None:
            raise ConfigError("etcd cacert", "a client certificate needs the CA certificate too")
        return None
    try:
        return pyetcd.MultiEndpointEtcd3Client.get_secure_creds(ca_cert, key, cert)
    except OSError as exc:
        raise ConfigError("etcd TLS", f"cannot read {exc.filename}: {exc.strerror}") from None


def _pyetcd_endpoint(endpoint: Endpoint, creds: grpc.ChannelCredentials | None, count: int) -> pyetcd.Endpoint:
    # With one endpoint there is nothing to fail over to: never mark it failed, or pyetcd would refuse to use
    # it for time_retry seconds (default 300) after a single error, e.g. while etcd restarts.
    time_retry = _FAILOVER_BACKOFF_S if count > 1 else 0.0
    host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
    return pyetcd.Endpoint(
        host,
        endpoint.port,
        secure=creds is not None,
        creds=creds,
        time_retry=time_retry,
        opts=_CHANNEL_OPTIONS,
    )
