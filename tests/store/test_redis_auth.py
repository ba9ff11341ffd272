"""Credentials and permissions on a real redis-server (issue 27): a least-privilege ACL user (no
``INFO``) is a single server, a refused password or command is ``UnsupportedConfigError``
(``STORE_AUTH``, one ERROR line) and never an outage, and a password holding ``/ @ :`` (raw or
percent-encoded) logs in and never shows in an error, ``location`` or a log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvcodec.errors import Reason, StoreUnavailableError, UnsupportedConfigError
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import StoreOptions, open_store
from kvcodec.store.redis import RedisURL
from tests.raises import raises_reason
from tests.redis_servers import make_blob, redis_cluster, redis_missing, redis_single

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))

LOGGER = "kvcodec.store.redis"
OPTS = StoreOptions(group_of=group_of, timeout_s=2.0)
SECRET = "s3cr/et@x:y"
ENCODED = "s3cr%2Fet%40x%3Ay"


def _levels(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


def _acl_user(srv, name: str, *rules: str) -> None:
    with srv.client() as c:
        c.execute_command("ACL", "SETUSER", name, "reset", "on", ">kvpass1234", "~*", *rules)


def test_an_acl_user_without_info_reads_and_writes_a_single_server(tmp_path: Path) -> None:
    with redis_single(tmp_path) as srv:
        _acl_user(srv, "kv", "+getrange", "+mset", "+exists", "+del", "+scan", "+ping")  # no GET, no SET
        with open_store(f"redis://kv:kvpass1234@127.0.0.1:{srv.port}/0", OPTS) as st:
            st.put("k", make_blob(64, 0))
            assert st.contains("k") and st.keys() == ["k"] and not st.cluster
            assert bytes(st.get("k")) == make_blob(64, 0)
            big = make_blob(197_000, 1)  # stored as a head and a tail (one MSET), read in one pipeline
            st.put("big", big)
            assert bytes(st.get("big")) == big and st.delete("big") and not st.contains("big")


def test_a_refused_command_or_password_is_a_config_error_not_an_outage(tmp_path: Path, caplog) -> None:
    with redis_single(tmp_path) as srv, caplog.at_level(logging.INFO):
        _acl_user(srv, "ro", "+getrange", "+exists", "+scan")  # reads only
        with open_store(f"redis://ro:kvpass1234@127.0.0.1:{srv.port}/0", OPTS) as st:
            for _ in range(3):
                with raises_reason(UnsupportedConfigError, Reason.STORE_AUTH):
                    st.put("k", make_blob(64, 0))
                assert st.contains("k") is False  # reads still served: no outage was recorded
        with open_store(f"redis://ro:wrong-pass@127.0.0.1:{srv.port}/0", OPTS) as st:
            for _ in range(3):
                with raises_reason(UnsupportedConfigError, Reason.STORE_AUTH) as info:
                    st.contains("k")
        assert "wrong-pass" not in str(info.value) + caplog.text
        assert len(_levels(caplog, logging.ERROR)) == 2  # one per store (rate-limited), never per call
        assert not _levels(caplog, logging.WARNING)  # no outage


def test_a_cluster_refusing_a_password_or_a_command_is_a_config_error(tmp_path: Path, caplog) -> None:
    with redis_cluster(tmp_path) as cl, caplog.at_level(logging.WARNING):
        for node in cl.nodes:
            _acl_user(node, "ro", "+getrange", "+exists", "+cluster", "+info", "+command", "+ping")
        for url in (
            cl.url.replace("://", "://ro:kvpass1234@"),
            f"redis://ro:kvpass1234@127.0.0.1:{cl.nodes[0].port}",
        ):
            with open_store(url, OPTS) as st:
                assert st.contains("k") is False
                with raises_reason(UnsupportedConfigError, Reason.STORE_AUTH):
                    st.put("k", make_blob(64, 0))
                assert st.cluster
        with open_store(cl.url.replace("://", "://ro:wrong-pass@"), OPTS) as st:
            for _ in range(2):  # not an outage: never refused at once as "down"
                with raises_reason(UnsupportedConfigError, Reason.STORE_AUTH):
                    st.contains("k")
        assert not _levels(caplog, logging.WARNING) and "wrong-pass" not in caplog.text


@pytest.mark.parametrize("password", [SECRET, ENCODED])
def test_a_password_with_slash_at_colon_logs_in_and_never_shows(tmp_path: Path, password: str) -> None:
    with redis_single(tmp_path, password=SECRET) as srv:
        url = f"redis://:{password}@127.0.0.1:{srv.port}/0"
        assert RedisURL.parse(url).password == SECRET
        with open_store(url, OPTS) as st:
            st.put("k", make_blob(64, 0))
            assert st.contains("k")
            assert st.location == f"redis://127.0.0.1:{srv.port}/0" and SECRET not in repr(st)
        srv.kill()
        with open_store(url, OPTS) as st:
            with pytest.raises(StoreUnavailableError) as info:
                st.contains("k")
            assert "s3cr" not in str(info.value)


@pytest.mark.parametrize("password", [SECRET, ENCODED, "s3cr%40et", "a:b:c", "x/y/z"])
@pytest.mark.parametrize("tail", ["h:notaport/0", "h:1/db", "h:1/0?bad=1", ""])
def test_a_bad_url_never_echoes_its_password(password: str, tail: str) -> None:
    url = f"redis://user:{password}@{tail}"
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE) as info:
        RedisURL.parse(url)
    text = str(info.value)
    assert password not in text and "s3cr" not in text and "user" not in text and "***" in text


def test_a_url_without_an_at_sign_never_echoes_what_may_be_a_password() -> None:
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE) as info:
        RedisURL.parse("redis://bob:hunter2")  # "@host:port" forgotten
    assert "hunter2" not in str(info.value)
