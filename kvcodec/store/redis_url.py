"""The Redis store's URL and connection: ``RedisURL`` parses a store URL (credentials percent-decoded,
never echoed), :func:`connect` opens the redis-py client it names, and :func:`auth_refusal` tells a
refused credential or permission (a configuration error) from an outage."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, NoReturn
from urllib.parse import parse_qsl, unquote

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import Reason, UnsupportedConfigError

__all__ = ["CA_CERTS_ENV", "PASSWORD_ENV", "USERNAME_ENV", "RedisURL", "auth_refusal", "connect", "mask_url"]

PASSWORD_ENV = "KVCODEC_REDIS_PASSWORD"
"""The password when the URL has none."""
USERNAME_ENV = "KVCODEC_REDIS_USERNAME"
"""The ACL user name when the URL has none."""
CA_CERTS_ENV = "KVCODEC_REDIS_CA_CERTS"
"""The CA bundle for ``rediss://`` when the URL names none (``?ca_certs=PATH``)."""

_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")


def mask_url(url: str) -> str:
    """``url`` with its netloc (credentials up to the last ``@``, and the hosts, which may be a password
    whose ``@host`` was forgotten) replaced by ``***``: only the scheme, the database and the query show."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***"
    tail = rest[rest.rfind("@") + 1 :]
    cut = min((i for i in (tail.find("/"), tail.find("?")) if i >= 0), default=len(tail))
    return f"{scheme}://***{tail[cut:]}"


def _bad_url(url: str, why: str) -> NoReturn:
    raise UnsupportedConfigError(f"bad Redis store URL {mask_url(url)!r}: {why}", reason=Reason.BAD_VALUE)


def _host_port(url: str, item: str, n: int) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        _bad_url(url, f"node {n} is not host:port with a port in 1..65535")  # no netloc text shown
    return host.strip("[]"), int(port)


def _split(url: str, rest: str) -> tuple[str, str, str, str]:
    """``(user, password, hosts, path)`` of the text after ``scheme://``; userinfo ends at the last ``@``."""
    at = rest.rfind("@")
    userinfo, tail = (rest[:at], rest[at + 1 :]) if at >= 0 else ("", rest)
    hosts, _, path = tail.partition("/")
    user, _, password = userinfo.partition(":")
    try:
        return unquote(user, errors="strict"), unquote(password, errors="strict"), hosts, path
    except UnicodeDecodeError:
        _bad_url(url, "the credentials are not percent-encoded UTF-8")


@dataclass(frozen=True)
class RedisURL:
    """A parsed store URL: scheme flags, the seed nodes, the database and (hidden) credentials."""

    tls: bool
    cluster: bool | None
    """True: stated by the scheme; None: a plain URL, detected on connect."""
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    ca_certs: str | None = None
    """The CA bundle a TLS server's certificate is checked against (None: the system's)."""

    @classmethod
    def parse(cls, url: str) -> RedisURL:
        """``redis[s][+cluster]://[user:password@]host:port[,host:port...][/db][?ca_certs=PATH]``
        (user and password percent-encoded: ``%40`` for ``@``, ``%2F`` for ``/``)."""
        scheme, sep, rest = url.partition("://")
        scheme = scheme.lower()
        if not sep or scheme not in _SCHEMES:
            _bad_url(url, "the scheme must be redis, rediss, redis+cluster or rediss+cluster")
        user, password, hosts, path = _split(url, rest)
        nodes = tuple(_host_port(url, h, n) for n, h in enumerate(hosts.split(","), 1) if h)
        if not nodes:
            _bad_url(url, "no host:port")
        path, _, query = path.partition("?")
        path = path.strip("/")
        params = dict(parse_qsl(query, keep_blank_values=True))
        if set(params) - {"ca_certs"}:
            _bad_url(url, f"unknown parameters {sorted(set(params) - {'ca_certs'})}; only ca_certs")
        if path and not path.isdigit():
            _bad_url(url, f"database {path!r} is not a number")
        cluster = True if scheme.endswith("+cluster") else None
        if len(nodes) > 1 and cluster is None:
            _bad_url(url, "several nodes need redis+cluster://")
        if cluster and path not in ("", "0"):
            _bad_url(url, "a Redis Cluster has only database 0")
        return cls(
            tls=scheme.startswith("rediss"),
            cluster=cluster,
            nodes=nodes,
            db=int(path or 0),
            username=user or os.environ.get(USERNAME_ENV) or None,
            password=password or os.environ.get(PASSWORD_ENV) or None,
            ca_certs=params.get("ca_certs") or os.environ.get(CA_CERTS_ENV) or None,
        )

    @property
    def location(self) -> str:
        """The URL without credentials, for logs."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        return f"{scheme}://{hosts}" + ("" if self.cluster else f"/{self.db}")


def auth_refusal(e: BaseException, location: str) -> UnsupportedConfigError | None:
    """The configuration error a refused login or command is (``STORE_AUTH``); None for anything else.
    A cluster client's "cannot be connected" error is judged by its cause."""
    if isinstance(e, redis.exceptions.RedisClusterException) and e.__cause__ is not None:
        e = e.__cause__
    if isinstance(e, redis.exceptions.AuthenticationError):
        why = "refused the credentials (an unknown user or a bad password)"
    elif isinstance(e, redis.exceptions.NoPermissionError):
        why = "refused a command: the ACL user lacks a permission the store needs"
        why += " (GETRANGE, MSET, EXISTS, DEL, SCAN)"
    elif isinstance(e, redis.exceptions.ResponseError) and str(e).startswith(("NOAUTH", "WRONGPASS")):
        why = "refused the credentials (the server needs a password)"
    else:
        return None
    return UnsupportedConfigError(f"Redis store {location} {why}", reason=Reason.STORE_AUTH)


def _is_cluster(single: Any) -> bool:
    """Whether a plain URL's server is a cluster node; a server that refuses ``INFO`` (a least-privilege
    ACL user) is taken as a single server."""
    try:
        return bool(single.info("cluster").get("cluster_enabled"))
    except redis.exceptions.AuthenticationError:
        raise
    except redis.exceptions.ResponseError as e:
        if str(e).startswith(("NOAUTH", "WRONGPASS")):
            raise
        return False


def connect(url: RedisURL, timeout_s: float) -> tuple[Any, bool]:
    """A client for ``url`` (one server, or a cluster: stated or found by ``INFO cluster``)."""
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "username": url.username,
        "password": url.password,
        "ssl": url.tls,
    }
    if url.tls and url.ca_certs:
        common["ssl_ca_certs"] = url.ca_certs
    if url.cluster is None:
        host, port = url.nodes[0]
        probe = redis.Redis(host=host, port=port, db=0, **common)  # a cluster node refuses SELECT n
        try:
            cluster = _is_cluster(probe)
        except BaseException:
            probe.close()
            raise
        if not cluster:
            if not url.db:
                return probe, False
            probe.close()
            return redis.Redis(host=host, port=port, db=url.db, **common), False
        probe.close()
        if url.db:
            raise UnsupportedConfigError(
                f"{url.location} is a Redis Cluster node: clusters have only database 0",
                reason=Reason.BAD_VALUE,
            )
    nodes = [redis.cluster.ClusterNode(h, p) for h, p in url.nodes]
    client = redis.cluster.RedisCluster(startup_nodes=nodes, require_full_coverage=False, **common)
    return client, True
