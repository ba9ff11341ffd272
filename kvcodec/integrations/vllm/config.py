"""``kv_connector_extra_config``, validated: every key checked once, so a bad config stops the engine
at start rather than failing every chunk. Pure Python (no torch, no vLLM): the scheduler side uses it."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any

from kvcodec.errors import Reason, UnsupportedConfigError
from kvcodec.format import COMPUTED_SCOPES, ScaleScope
from kvcodec.format.header import MAX_DIM, MAX_HASH_STR

__all__ = ["COMPRESSION_TIERS", "DEFAULT_COMPRESSION", "DEFAULT_PENDING_SAVE_BYTES", "KvcodecConfig"]

COMPRESSION_TIERS = ("ram", "disk", "remote")
"""The store tiers ``compression`` names (kvcodec/integrations/vllm/store_tiers.py)."""
DEFAULT_COMPRESSION = {"ram": "none", "disk": "none", "remote": "none"}
"""Plain blobs in every tier by default. ``{"remote": "lossless"}`` keeps 0.72x the bytes in Redis (its
``used_memory`` 0.545x the raw KV instead of 0.756x, ``bench/fleet/engines.py``), but on a CPU host
the stage codes and decodes at ~0.04x a memcpy's speed: the same run's hit from Redis took 120 ms
against 60 ms plain (the expansion on the engine's cores). Turn it on where Redis memory
bounds the hit rate and the hosts have cores to spare (docs/vllm.md, Store tiers)."""

DEFAULT_PENDING_SAVE_BYTES = 1 << 30
"""Host memory that chunks copied out of the cache but not yet written may hold (1 GiB): a 2048-token
prompt of a 32-layer model with 8 KV heads of 128 in bf16 is 256 MiB, so four such prompts in flight."""


@dataclass(frozen=True)
class KvcodecConfig:
    """``kv_connector_extra_config``, validated."""

    root: str | None = None
    """The local store directory; required unless ``store`` names another store."""
    store: str | None = None
    """A store URL (``redis://host:port/db``, ``redis+cluster://h1:p1,h2:p2``, ``file://``); None: ``root``."""
    store_timeout_ms: int = 50
    """Per-call timeout of a remote store: an outage costs a step at most this much per call."""
    key_prefix: str | None = None
    """Namespace of the keys in a shared server (None: the backend's default)."""
    fleet_key_env: str | None = "KVCODEC_FLEET_KEY"
    """Environment variable holding the fleet MAC key (unset or empty: no MAC)."""
    fleet_key_file: str | None = None
    """A file holding the fleet MAC key (read instead of ``fleet_key_env``)."""
    chunk_size: int = 256
    scope: str = "per_page_head"
    """Scale scope name (``per_tensor``, ``per_layer_head`` or ``per_page_head``; stored lower-case)."""
    page_size: int = 16
    model_id: str | None = None
    max_bytes: int | None = None
    host_cache_bytes: int | None = None
    """A RAM tier of encoded blobs of at most this many bytes in front of the store (None: none):
    hits on recently written or loaded chunks skip the disk and network reads, and keep coming while
    a remote store is down (:mod:`~kvcodec.integrations.vllm.store_tiers`)."""
    fsync: bool = False
    """KV blobs can always be recomputed, so a machine crash may lose recent ones."""
    fused: str = "auto"
    """Fused Triton save/load (``auto``: on CUDA caches that qualify; ``on``: required, else the engine
    stops; CPU caches then run the kernels in Triton's interpreter, for tests; ``off``: per layer)."""
    async_save: bool = True
    """Encode and write chunks on the connector's writer threads (the step waits only for the gather)."""
    async_load: bool = True
    """Read and check chunks on a loader thread between steps (``load_async=True`` to the scheduler)."""
    max_pending_save_bytes: int = DEFAULT_PENDING_SAVE_BYTES
    """Host memory held by chunks copied out of the cache and not yet written. At the bound, CPU caches
    keep the chunks in the cache (their requests' blocks held) until memory frees; only a copy that
    cannot wait (a preemption, or a GPU cache's in-step copy) is skipped, counted and logged."""
    max_concurrent_loads: int = 16
    """Asynchronous loads in flight at once; over it the scheduler asks vLLM to try the request later."""
    writer_threads: int = 2
    compression: Any = None
    """Per store tier, ``"none"`` or ``"lossless"`` (``compression="lossless"`` blobs, decoded back
    byte for byte): a mapping of ``ram``/``disk``/``remote`` to either (tiers left out keep
    :data:`DEFAULT_COMPRESSION`), one string for every tier, or None for the defaults."""

    def __post_init__(self) -> None:
        """Check every field, so a bad config stops the engine at start, not every chunk save."""
        self._check_location()
        for name, top in (
            ("chunk_size", MAX_DIM),
            ("page_size", MAX_DIM),
            ("writer_threads", 64),
            ("max_concurrent_loads", 1 << 16),
            ("store_timeout_ms", 600_000),
            ("max_pending_save_bytes", 1 << 50),
        ):
            val = getattr(self, name)
            if not _is_int(val) or not 1 <= val <= top:
                raise UnsupportedConfigError(
                    f"{name} must be an int in 1..{top}; got {val!r}", reason=Reason.BAD_VALUE
                )
        for name in ("max_bytes", "host_cache_bytes"):
            val = getattr(self, name)
            if val is not None and (not _is_int(val) or val < 1):
                raise UnsupportedConfigError(
                    f"{name} must be an int >= 1 or null; got {val!r}", reason=Reason.BAD_VALUE
                )
        for name in ("fsync", "async_save", "async_load"):
            if type(getattr(self, name)) is not bool:
                raise UnsupportedConfigError(
                    f"{name} must be true or false; got {getattr(self, name)!r}", reason=Reason.BAD_TYPE
                )
        if not isinstance(self.fused, str) or self.fused not in ("auto", "on", "off"):
            raise UnsupportedConfigError(
                f'fused must be "auto", "on" or "off"; got {self.fused!r}', reason=Reason.BAD_VALUE
            )
        for name in ("key_prefix", "fleet_key_env", "fleet_key_file"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, str) or not val):
                raise UnsupportedConfigError(
                    f"{name} must be a non-empty string or null; got {val!r}", reason=Reason.BAD_TYPE
                )
        if self.model_id is not None:
            _check_hash_text("model_id", self.model_id)
        object.__setattr__(self, "compression", _compression(self.compression))
        object.__setattr__(self, "scope", _scope_name(self.scope))

    def _check_location(self) -> None:
        if self.store is not None and (not isinstance(self.store, str) or not self.store):
            raise UnsupportedConfigError(
                f'store must be a store URL ("redis://host:port/0") or null; got {self.store!r}',
                reason=Reason.BAD_TYPE,
            )
        if self.root is not None or self.store is None:
            object.__setattr__(self, "root", _check_root(self.root))

    def compression_of(self, tier: str) -> str:
        """``"none"`` or ``"lossless"``: how ``tier`` (ram, disk or remote) stores blobs."""
        return dict(self.compression)[tier]

    @property
    def location(self) -> str:
        """What the store is opened from: ``store`` when set, else ``root``."""
        return self.store if self.store is not None else str(self.root)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvcodecConfig:
        """The config from vLLM's ``kv_connector_extra_config``; unknown keys and bad values are refused."""
        if extra is not None and not isinstance(extra, dict):
            raise UnsupportedConfigError(
                f"kv_connector_extra_config must be a JSON object; got {type(extra).__name__}",
                reason=Reason.BAD_TYPE,
            )
        extra = dict(extra or {})
        unknown = set(extra) - set(cls.__dataclass_fields__)
        if unknown:
            raise UnsupportedConfigError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}",
                reason=Reason.BAD_VALUE,
            )
        if "root" not in extra and extra.get("store") is None:
            raise UnsupportedConfigError(
                'KvcodecConnector needs kv_connector_extra_config {"root": "<store dir>"} or {"store": "<url>"}',
                reason=Reason.MISSING_ARGUMENT,
            )
        return cls(**extra)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_root(root: Any) -> str:
    """``root`` as a str, refused unless it can be (or is) a directory: no NUL, no file on its path."""
    if not isinstance(root, (str, os.PathLike)):
        raise UnsupportedConfigError(
            f'root must be a path string ("root": "<store dir>"); got {root!r}', reason=Reason.BAD_TYPE
        )
    try:
        path = os.fspath(root)
    except TypeError as e:
        raise UnsupportedConfigError(f"root {root!r} is not a path: {e}", reason=Reason.BAD_TYPE) from None
    if not isinstance(path, str) or not path:
        raise UnsupportedConfigError(
            f'KvcodecConnector needs kv_connector_extra_config {{"root": "<store dir>"}}; got root={root!r}',
            reason=Reason.MISSING_ARGUMENT,
        )
    if "\x00" in path:
        raise UnsupportedConfigError(f"root {path!r} contains a NUL byte", reason=Reason.BAD_VALUE)
    _check_hash_text("root", path)
    at = os.path.abspath(path)
    while True:
        try:
            st = os.stat(at)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        except OSError as e:
            raise UnsupportedConfigError(
                f"root {path!r}: cannot inspect {at!r}: {e.strerror}", reason=Reason.BAD_VALUE
            ) from None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise UnsupportedConfigError(
                f"root {path!r}: {at!r} exists and is not a directory", reason=Reason.BAD_VALUE
            )
        if st is not None or os.path.dirname(at) == at:
            return path
        at = os.path.dirname(at)


def _check_hash_text(name: str, text: Any) -> None:
    """A string the blob header can carry: UTF-8 encodable, at most the format's hash-string length."""
    if not isinstance(text, str):
        raise UnsupportedConfigError(f"{name} must be a string; got {text!r}", reason=Reason.BAD_TYPE)
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedConfigError(
            f"{name} is not encodable as UTF-8 ({e.reason} at {e.start})", reason=Reason.BAD_UTF8
        ) from None
    if name == "model_id" and len(raw) > MAX_HASH_STR:
        raise UnsupportedConfigError(
            f"model_id is {len(raw)} bytes in UTF-8; blobs hold at most {MAX_HASH_STR}",
            reason=Reason.BAD_HASH,
        )


def _compression(value: Any) -> tuple[tuple[str, str], ...]:
    """``compression`` as ((tier, "none" | "lossless"), ...) for every tier; refused unless one of
    None, "none", "lossless" or a mapping of known tiers to either."""
    modes = ("none", "lossless")
    if value is None:
        value = {}
    elif isinstance(value, str):
        value = dict.fromkeys(COMPRESSION_TIERS, value)
    elif isinstance(value, tuple):  # already normalized (a config rebuilt from another's fields)
        value = dict(value)
    if not isinstance(value, dict):
        raise UnsupportedConfigError(
            f'compression must be "none", "lossless", a mapping of {list(COMPRESSION_TIERS)} to either, or null; '
            f"got {value!r}",
            reason=Reason.BAD_TYPE,
        )
    bad = {k: v for k, v in value.items() if k not in COMPRESSION_TIERS or v not in modes}
    if bad:
        raise UnsupportedConfigError(
            f"compression {bad!r}: tiers are {list(COMPRESSION_TIERS)}, each {list(modes)}",
            reason=Reason.BAD_VALUE,
        )
    return tuple({**DEFAULT_COMPRESSION, **value}.items())


def _scope_name(scope: Any) -> str:
    """The lower-case name of a computed scope given by name or number (JSON has no enums)."""
    names = {s.name.lower(): s for s in ScaleScope}
    names.update({n.removeprefix("per_"): s for n, s in list(names.items())})
    if isinstance(scope, str) and scope.lower() in names:
        sc = names[scope.lower()]
    elif _is_int(scope) and scope in {s.value for s in ScaleScope}:
        sc = ScaleScope(scope)
    else:
        raise UnsupportedConfigError(f"unknown scale scope {scope!r}", reason=Reason.BAD_SCOPE)
    if sc not in COMPUTED_SCOPES:
        raise UnsupportedConfigError(
            f"scope {scope!r} cannot be written by the connector; use one of {[s.name.lower() for s in COMPUTED_SCOPES]}",
            reason=Reason.BAD_SCOPE,
        )
    return sc.name.lower()
