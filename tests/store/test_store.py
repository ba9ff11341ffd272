"""DirectoryStore: roundtrip, zero-copy reads, keys, crash safety, corruption, concurrency, LRU."""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcodec.errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.format import Hashes, Header, ScaleScope, assemble, parse
from kvcodec.store import QUARANTINE_DIRNAME, DirectoryStore, InvalidKeyError, validate_key

needs_fork = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the 'fork' start method"
)


def make_blob(nbytes: int, seed: int, *, version: int = 1, model: str = "m") -> bytes:
    """A valid LMCKV blob of about ``nbytes`` payload bytes (random K and V of equal size)."""
    half = max(2, nbytes // 2) // 2 * 2
    rng = np.random.default_rng(seed)
    k = rng.bytes(half)
    v = rng.bytes(half)
    h = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float16,
        scale_scope=ScaleScope.EXTERNAL,
        version=version,
        layer_id=seed % 7,
        chunk_id=seed,
        hashes=Hashes(model_id=model, tokenizer_hash="tok"),
    )
    return bytes(assemble(h, k, v))


def digest(b: object) -> str:
    return hashlib.sha256(memoryview(b)).hexdigest()  # type: ignore[arg-type]


def temps(root: Path) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith(".tmp.")]


# --------------------------------------------------------------------------- basics


def test_roundtrip_and_listing(tmp_path: Path) -> None:
    blobs = {f"k{i}": make_blob(4096 + i * 100, i) for i in range(4)}
    with DirectoryStore(tmp_path) as st:
        assert len(st) == 0 and st.keys() == [] and st.total_bytes == 0
        for k, b in blobs.items():
            st.put(k, b)
        assert st.keys() == sorted(blobs)
        assert len(st) == 4
        assert list(st) == sorted(blobs)
        assert st.total_bytes == sum(len(b) for b in blobs.values())
        for k, b in blobs.items():
            assert st.contains(k) and k in st
            assert bytes(st.get(k)) == b
        assert "nope" not in st
        with pytest.raises(KeyError):
            st.get("nope")
        assert st.delete("k1") is True
        assert st.delete("k1") is False
        assert "k1" not in st and st.keys() == ["k0", "k2", "k3"]
        assert st.total_bytes == sum(len(b) for k, b in blobs.items() if k != "k1")
        with pytest.raises(KeyError):
            st.get("k1")
        # overwrite
        new = make_blob(9000, 99)
        st.put("k0", new)
        assert bytes(st.get("k0")) == new
        assert st.total_bytes == len(new) + len(blobs["k2"]) + len(blobs["k3"])
    assert temps(tmp_path) == []
    assert os.path.isdir(tmp_path / QUARANTINE_DIRNAME)


def test_accepts_any_bytes_like(tmp_path: Path) -> None:
    b = make_blob(4096, 1)
    st = DirectoryStore(tmp_path, fsync=False)
    arr16 = np.frombuffer(b[: len(b) // 2 * 2], dtype=np.uint16)
    for i, buf in enumerate([b, bytearray(b), memoryview(b), np.frombuffer(b, dtype=np.uint8)]):
        st.put(f"b{i}", buf)
        assert bytes(st.get(f"b{i}")) == b
    if len(b) % 2 == 0:
        st.put("u16", arr16)
        assert bytes(st.get("u16")) == b
    with pytest.raises(UnsupportedConfigError):
        st.put("x", 12345)
    with pytest.raises(UnsupportedConfigError):
        st.put("x", np.frombuffer(b, dtype=np.uint8)[::2])


def test_get_is_a_copy_on_write_mmap_view(tmp_path: Path) -> None:
    b = make_blob(1 << 16, 3)
    st = DirectoryStore(tmp_path)
    st.put("k", b)
    v = st.get("k")
    assert isinstance(v, memoryview)
    assert isinstance(v.obj, mmap.mmap), "view must be backed by the file's mapping, not a copy"
    assert not v.readonly and v.nbytes == len(b) and v.format == "B"
    # torch wraps it without copying: writes through the tensor show in the view...
    t = torch.frombuffer(v, dtype=torch.uint8)
    t[200] ^= 0xFF
    assert v[200] == b[200] ^ 0xFF
    # ...but never reach the file (ACCESS_COPY).
    assert (tmp_path / "k").read_bytes() == b
    assert bytes(st.get("k")) == b
    # Views stay valid after delete and close (they own their maps).
    w = st.get("k")
    st.delete("k")
    st.close()
    assert bytes(w) == b


def test_put_drops_trailing_bytes_and_reads_refuse_them(tmp_path: Path) -> None:
    b = make_blob(2048, 4)
    st = DirectoryStore(tmp_path)
    st.put("t", b + b"trailing junk")  # v1 allows trailing bytes; put stores the blob only
    assert (tmp_path / "t").read_bytes() == b
    v = st.get("t")
    assert bytes(v) == b and isinstance(v.obj, mmap.mmap)
    for read in (st.get, st.get_parsed):
        (tmp_path / "u").write_bytes(b + b"xyz")  # written by someone else: not what its header declares
        with pytest.raises(CorruptEncodedKVError, match="3 bytes too many") as e:
            read("u")
        assert e.value.reason is Reason.SIZE_MISMATCH
        assert not (tmp_path / "u").exists()


def test_put_refuses_invalid_blobs(tmp_path: Path) -> None:
    b = make_blob(2048, 5)
    st = DirectoryStore(tmp_path)
    for bad in (b"", b"not a blob at all", b[:-1], b[:50]):
        with pytest.raises(CorruptEncodedKVError, match="refusing to store 'x'"):
            st.put("x", bad)
    flipped = bytearray(b)
    flipped[-1] ^= 1
    with pytest.raises(CorruptEncodedKVError, match="CRC"):
        st.put("x", flipped)
    assert st.keys() == [] and temps(tmp_path) == []
    # verify=False stores what it is given; get still bounds-checks the header.
    raw = DirectoryStore(tmp_path, verify=False)
    raw.put("x", flipped)
    assert bytes(raw.get("x")) == bytes(flipped)  # CRC skipped
    with pytest.raises(UnsupportedConfigError):
        raw.put("e", b"")
    raw.put("g", b"garbage")
    with pytest.raises(CorruptEncodedKVError):
        raw.get("g")


def test_closed_store_refuses_calls(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path)
    st.close()
    st.close()
    for call in (
        lambda: st.put("a", make_blob(64, 1)),
        lambda: st.get("a"),
        st.keys,
        lambda: st.contains("a"),
    ):
        with pytest.raises(UnsupportedConfigError, match="closed"):
            call()


def test_bad_constructor_args(tmp_path: Path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UnsupportedConfigError):
            DirectoryStore(tmp_path, max_bytes=bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize(
    "key",
    ["", ".hidden", ".", "..", "a/b", "../x", "a b", "ü", "a\x00b", "x" * 201, "a\\b", "k:1", 7, None, b"k"],
)
def test_invalid_keys(tmp_path: Path, key: object) -> None:
    st = DirectoryStore(tmp_path)
    blob = make_blob(64, 1)
    for call in (
        lambda: st.put(key, blob),  # type: ignore[arg-type]
        lambda: st.get(key),  # type: ignore[arg-type]
        lambda: st.contains(key),  # type: ignore[arg-type]
        lambda: st.delete(key),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidKeyError) as ei:
            call()
        assert isinstance(ei.value, ValueError) and isinstance(ei.value, UnsupportedConfigError)
    assert os.listdir(tmp_path) == [QUARANTINE_DIRNAME]


@pytest.mark.parametrize("key", ["a", "x" * 200, "A-b_c.9", "model.v1-L0-C3", "_", "-", "a..b"])
def test_valid_keys(tmp_path: Path, key: str) -> None:
    assert validate_key(key) == key
    st = DirectoryStore(tmp_path, fsync=False)
    st.put(key, make_blob(64, 2))
    assert st.keys() == [key] and key in st


def test_make_key_stable_and_distinct() -> None:
    h = Hashes(model_id="llama", model_revision_hash="r1", tokenizer_hash="t", kv_layout="NHD")
    k = DirectoryStore.make_key(h, 3, 17)
    # Pinned: the derivation is part of the on-disk format (keys must survive upgrades).
    assert k == DirectoryStore.make_key(h, 3, 17)
    assert k.endswith("-L3-C17") and len(k.split("-")[0]) == 16
    assert k == "fdaf27b73a60289e-L3-C17"
    assert DirectoryStore.make_key(h.as_dict(), 3, 17) == k
    assert (
        DirectoryStore.make_key(
            {"model_id": "llama", "model_revision_hash": "r1", "tokenizer_hash": "t", "kv_layout": "NHD"},
            3,
            17,
        )
        == k
    )
    assert DirectoryStore.make_key(h, 3, 17, chunk_hash="abc123") == k + "-Habc123"
    variants = {
        k,
        DirectoryStore.make_key(h, 4, 17),
        DirectoryStore.make_key(h, 3, 18),
        DirectoryStore.make_key(h, 31, 7),
        DirectoryStore.make_key(h, 3, 17, chunk_hash="x"),
    }
    for field in h.as_dict():
        variants.add(DirectoryStore.make_key(h.as_dict() | {field: getattr(h, field) + "z"}, 3, 17))
    # Length-prefixing keeps field boundaries: moving a character between fields changes the key.
    variants.add(
        DirectoryStore.make_key(
            Hashes(model_id="llam", model_revision_hash="ar1", tokenizer_hash="t", kv_layout="NHD"), 3, 17
        )
    )
    assert len(variants) == 5 + 6 + 1
    for v in variants:
        assert validate_key(v) == v
    with pytest.raises(InvalidKeyError):
        DirectoryStore.make_key(h, 0, 0, chunk_hash="a/b")
    with pytest.raises(InvalidKeyError):
        DirectoryStore.make_key(h, 0, 0, chunk_hash="x" * 200)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(UnsupportedConfigError):
            DirectoryStore.make_key(h, bad, 0)  # type: ignore[arg-type]
        with pytest.raises(UnsupportedConfigError):
            DirectoryStore.make_key(h, 0, bad)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError):
        DirectoryStore.make_key({"not_a_hash": "x"}, 0, 0)


# --------------------------------------------------------------------------- crash safety

CRASH_BLOB = 3 << 20
CRASH_CHUNK = 256 << 10


def _crash_writer(root: str, key: str, seed: int, crash_at: int) -> None:
    """Child: put a big blob and ``os._exit`` right after its ``crash_at``-th I/O step (0: before any write).

    Steps are each ``os.write`` (cut short to CRASH_CHUNK bytes, as POSIX allows, so one put
    takes many), the file's ``fsync``, the ``os.replace`` and the folder's ``fsync``: the store
    needs no hook of its own for this.
    """
    st = DirectoryStore(root, fsync=True)
    blob = make_blob(CRASH_BLOB, seed)
    real_write, real_fsync, real_replace = os.write, os.fsync, os.replace
    steps = 0

    def step() -> None:
        nonlocal steps
        steps += 1
        if steps == crash_at:
            os._exit(0)

    def short_write(fd: int, data: object) -> int:
        if crash_at == 0:
            os._exit(0)
        n = real_write(fd, memoryview(data)[:CRASH_CHUNK])  # type: ignore[arg-type]
        step()
        return n

    def fsync(fd: int) -> None:
        real_fsync(fd)
        step()

    def replace(src: str, dst: str) -> None:
        real_replace(src, dst)
        step()

    os.write, os.fsync, os.replace = short_write, fsync, replace  # this child only; it never returns
    st.put(key, blob)
    os._exit(0)


@needs_fork
def test_crash_mid_write_never_leaves_partial_files(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    root = tmp_path / "store"
    st = DirectoryStore(root)
    keep = {f"keep-{i}": make_blob(8192, 1000 + i) for i in range(2)}
    for k, b in keep.items():
        st.put(k, b)
    expected = {k: digest(b) for k, b in keep.items()}
    for i in range(2):
        b = make_blob(CRASH_BLOB, 2000 + i)
        st.put(f"over-{i}", b)
        expected[f"over-{i}"] = digest(b)
    # I/O steps of one put: one per written piece, fsync, replace, fsync of the folder.
    pieces = -(-len(make_blob(CRASH_BLOB, 0)) // CRASH_CHUNK)
    stages = ["write"] * pieces + ["fsync", "replace", "fsync_dir"]
    rnd = random.Random(1234)
    crash_points = [0, 1, 2, pieces, pieces + 1, pieces + 2, pieces + 3, len(stages) + 1]
    crash_points += [rnd.randint(0, len(stages) + 1) for _ in range(12)]
    keys = ["over-0", "over-1", "new-0", "new-1", "new-2"]
    renamed = 0
    for it, crash_at in enumerate(crash_points):
        key = keys[it % len(keys)]
        seed = 3000 + it
        p = ctx.Process(target=_crash_writer, args=(str(root), key, seed, crash_at))
        p.start()
        p.join(30)
        assert p.exitcode == 0
        # Crashing before the rename keeps the old content; at or after it, the new one is complete.
        if crash_at > len(stages) or (crash_at >= 1 and stages[crash_at - 1] in ("replace", "fsync_dir")):
            expected[key] = digest(make_blob(CRASH_BLOB, seed))
            renamed += 1
            assert temps(root) == []
        else:
            assert len(temps(root)) == 1  # the dead writer's partial temp file
        reopened = DirectoryStore(root)  # scans: removes the dead writer's temp file
        assert temps(root) == []
        assert reopened.keys() == sorted(expected)
        for k, d in expected.items():
            view = reopened.get(k)
            parse(view, strict=True)
            assert digest(view) == d, (it, crash_at, k)
    assert 0 < renamed < len(crash_points)
    assert os.listdir(root / QUARANTINE_DIRNAME) == []


def test_temp_cleanup_spares_live_writers(tmp_path: Path) -> None:
    DirectoryStore(tmp_path)
    ctx = multiprocessing.get_context()
    p = ctx.Process(target=os.getpid)
    p.start()
    p.join()
    dead = p.pid
    mine_fresh = tmp_path / f".tmp.{os.getpid()}.1.aaaa"
    mine_old = tmp_path / f".tmp.{os.getpid()}.1.bbbb"
    locked_old = tmp_path / f".tmp.{os.getpid()}.1.cccc"
    dead_fresh = tmp_path / f".tmp.{dead}.1.dddd"
    junk_name = tmp_path / ".tmp.notapid.eeee"
    for f in (mine_fresh, mine_old, locked_old, dead_fresh, junk_name):
        f.write_bytes(b"partial")
    old = 1_000_000_000  # 2001: older than any age the cleanup spares
    for f in (mine_old, locked_old):
        os.utime(f, (old, old))
    fcntl = pytest.importorskip("fcntl")
    fd = os.open(locked_old, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = DirectoryStore(tmp_path)
        left = sorted(temps(tmp_path))
        assert left == sorted([mine_fresh.name, locked_old.name]), left
        assert st.keys() == []
    finally:
        os.close(fd)
    st.refresh()
    assert temps(tmp_path) == [mine_fresh.name]


# --------------------------------------------------------------------------- corruption


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip_payload":
        data[-10] ^= 0x40
    elif how == "flip_magic":
        data[2] ^= 0x01
    elif how == "flip_header_hash":  # inside the model_id string: only v2's CRC covers it
        i = data.index(b"model-x")
        data[i + 6] ^= 0x01
    elif how == "truncate_half":
        data = data[: len(data) // 2]
    elif how == "truncate_one":
        data = data[:-1]
    elif how == "empty":
        data = bytearray()
    elif how == "garbage":
        data = bytearray(os.urandom(len(data)))
    path.write_bytes(data)


DAMAGES = [
    "flip_payload",
    "flip_magic",
    "flip_header_hash",
    "truncate_half",
    "truncate_one",
    "empty",
    "garbage",
]


def test_corrupt_files_are_refused_and_quarantined(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path)
    good = make_blob(5000, 77)
    st.put("good", good)
    blobs = {}
    for i, how in enumerate(DAMAGES):
        b = make_blob(20000, i, version=2, model="model-x")
        blobs[how] = b
        st.put(how, b)
    for how in DAMAGES:
        _damage(tmp_path / how, how)
    st.refresh()
    for how in DAMAGES:
        with pytest.raises(CorruptEncodedKVError) as ei:
            st.get(how)
        msg = str(ei.value)
        assert repr(how) in msg and str(tmp_path / how) in msg and "moved to" in msg
        assert not (tmp_path / how).exists()
        assert how not in st
        with pytest.raises(KeyError):
            st.get(how)
    q = sorted(os.listdir(st.quarantine_dir))
    assert len(q) == len(DAMAGES)
    assert sorted(n.split(".")[0] for n in q) == sorted(DAMAGES)
    assert st.keys() == ["good"]
    assert st.total_bytes == len(good)
    assert bytes(st.get("good")) == good
    assert DirectoryStore(tmp_path).keys() == ["good"]


def test_v1_header_hash_flip_is_format_limit(tmp_path: Path) -> None:
    """v1's CRC covers the payload only; the store can refuse only what parse detects."""
    st = DirectoryStore(tmp_path)
    st.put("v1", make_blob(4000, 1, version=1, model="model-x"))
    _damage(tmp_path / "v1", "flip_payload")
    with pytest.raises(CorruptEncodedKVError, match="CRC"):
        st.get("v1")


def test_quarantine_off_deletes(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path, quarantine=False)
    st.put("a", make_blob(4000, 1))
    _damage(tmp_path / "a", "truncate_half")
    with pytest.raises(CorruptEncodedKVError, match="deleted"):
        st.get("a")
    assert os.listdir(tmp_path) == [] and st.keys() == [] and st.total_bytes == 0


def test_verify_false_skips_crc_only(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path, verify=False)
    b = make_blob(4000, 1)
    st.put("a", b)
    st.put("b", b)
    _damage(tmp_path / "a", "flip_payload")
    _damage(tmp_path / "b", "truncate_one")
    assert len(st.get("a")) == len(b)  # CRC not checked
    with pytest.raises(CorruptEncodedKVError):
        st.get("b")  # bounds still checked
    assert st.keys() == ["a"]


# --------------------------------------------------------------------------- concurrency

PAR_SIZE = 96 << 10
PAR_ROUNDS = 6


def _par_seed(writer: int, rnd: int) -> int:
    return 10_000 + writer * 100 + rnd


def _proc_writer(root: str, writer: int) -> None:
    st = DirectoryStore(root, fsync=True)
    for r in range(PAR_ROUNDS):
        st.put("same", make_blob(PAR_SIZE + writer * 64, _par_seed(writer, r)))


@needs_fork
def test_parallel_writers_leave_one_complete_blob(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    n_proc, n_thr = 3, 4
    candidates = {
        digest(make_blob(PAR_SIZE + w * 64, _par_seed(w, r)))
        for w in range(n_proc + n_thr)
        for r in range(PAR_ROUNDS)
    }
    # Fork before any thread starts.
    procs = [ctx.Process(target=_proc_writer, args=(str(tmp_path), w)) for w in range(n_proc)]
    for p in procs:
        p.start()
    st = DirectoryStore(tmp_path, fsync=False)
    errors: list[BaseException] = []
    stop = threading.Event()
    reads = [0]

    def thread_writer(w: int) -> None:
        try:
            for r in range(PAR_ROUNDS):
                st.put("same", make_blob(PAR_SIZE + w * 64, _par_seed(w, r)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader() -> None:
        rs = DirectoryStore(tmp_path)
        try:
            while not stop.is_set():
                try:
                    v = rs.get("same")
                except KeyError:
                    continue
                assert digest(v) in candidates
                reads[0] += 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=thread_writer, args=(n_proc + i,)) for i in range(n_thr)]
    rt = threading.Thread(target=reader)
    rt.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    stop.set()
    rt.join()
    assert not errors, errors
    assert reads[0] > 0
    final = DirectoryStore(tmp_path)
    assert final.keys() == ["same"]
    v = final.get("same")
    parse(v, strict=True)
    assert digest(v) in candidates
    assert final.total_bytes == len(v)
    assert temps(tmp_path) == []
    assert os.listdir(final.quarantine_dir) == []


# --------------------------------------------------------------------------- eviction


def test_lru_eviction_and_accounting(tmp_path: Path) -> None:
    size = len(make_blob(16 << 10, 0))
    blobs = {name: make_blob(16 << 10, i) for i, name in enumerate("abcdefg")}
    assert all(len(b) == size for b in blobs.values())
    cap = 3 * size + size // 2
    st = DirectoryStore(tmp_path, max_bytes=cap)
    for k in "abc":
        st.put(k, blobs[k])
    assert st.total_bytes == 3 * size
    st.get("a")  # a becomes most recent; b is now LRU
    st.put("d", blobs["d"])
    assert st.keys() == ["a", "c", "d"]
    st.put("e", blobs["e"])
    assert st.keys() == ["a", "d", "e"]
    assert st.total_bytes == 3 * size
    assert sum(os.path.getsize(tmp_path / k) for k in st.keys()) == st.total_bytes
    # Overwriting a key replaces its size, evicting nothing when it still fits.
    st.put("e", blobs["e"])
    assert st.keys() == ["a", "d", "e"] and st.total_bytes == 3 * size

    # Reopen: total recomputed and LRU order rebuilt from mtimes (a, d, e oldest first).
    st2 = DirectoryStore(tmp_path, max_bytes=cap)
    assert st2.total_bytes == 3 * size
    st2.get("d")
    st2.put("f", blobs["f"])
    assert st2.keys() == ["d", "e", "f"]
    # Too big for the store: refused, nothing evicted or written.
    big = make_blob(cap + 100, 50)
    with pytest.raises(UnsupportedConfigError, match="max_bytes"):
        st2.put("big", big)
    assert st2.keys() == ["d", "e", "f"] and temps(tmp_path) == []
    assert st2.delete("d") and st2.total_bytes == 2 * size
    # The first instance is stale; a rescan catches up.
    st.refresh()
    assert st.total_bytes == 2 * size and st.keys() == ["e", "f"]


def test_eviction_sees_other_instances_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcodec.store.directory as store_mod

    monkeypatch.setattr(store_mod, "RECENCY_PERSIST_S", 0.0)  # every read persists its recency
    size = len(make_blob(8 << 10, 0))
    cap = 3 * size
    one = DirectoryStore(tmp_path, max_bytes=cap, rescan_interval_s=0)
    two = DirectoryStore(tmp_path, max_bytes=cap, rescan_interval_s=0)
    one.put("a", make_blob(8 << 10, 1))
    two.put("b", make_blob(8 << 10, 2))
    one.put("c", make_blob(8 << 10, 3))
    two.get("a")  # another process's read makes "a" recent on disk (mtime)
    one.put("d", make_blob(8 << 10, 4))  # rescans: evicts b, the LRU across both
    assert sorted(os.listdir(tmp_path)) == [QUARANTINE_DIRNAME, "a", "c", "d"]
    assert one.total_bytes == 3 * size
    assert two.keys() == ["a", "c", "d"] and two.total_bytes == 3 * size


def test_evicted_key_can_be_read_by_earlier_view(tmp_path: Path) -> None:
    size = len(make_blob(8 << 10, 0))
    st = DirectoryStore(tmp_path, max_bytes=size)
    a = make_blob(8 << 10, 1)
    st.put("a", a)
    view = st.get("a")
    st.put("b", make_blob(8 << 10, 2))
    assert st.keys() == ["b"]
    assert bytes(view) == a  # the mapping outlives the unlinked file


def test_corrupt_file_replaced_during_read_returns_new_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer's rename landing while a reader handles a damaged file: the new blob wins."""
    import kvcodec.store.reading as store_mod  # where the directory store's reads parse

    st = DirectoryStore(tmp_path)
    st.put("k", make_blob(4000, 1))
    _damage(tmp_path / "k", "flip_payload")
    good = make_blob(4000, 2)
    staged = tmp_path / ".staged"  # dot names are never keys
    staged.write_bytes(good)
    real_parse = store_mod.parse
    calls = [0]

    def parse_then_writer_renames(buf: object, **kw: object) -> object:
        calls[0] += 1
        if calls[0] == 1:
            os.replace(staged, tmp_path / "k")  # lands after we opened the damaged inode
        return real_parse(buf, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store_mod, "parse", parse_then_writer_renames)
    assert bytes(st.get("k")) == good
    assert os.listdir(st.quarantine_dir) == []


def test_quarantine_puts_back_a_blob_renamed_in_mid_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename into quarantine caught a fresh blob: it is linked back, the read retried."""
    st = DirectoryStore(tmp_path)
    st.put("k", make_blob(4000, 1))
    _damage(tmp_path / "k", "truncate_half")
    good = make_blob(4000, 2)
    staged = tmp_path / ".staged"  # dot names are never keys
    staged.write_bytes(good)
    real_rename = os.rename

    def writer_wins_then_rename(src: str, dst: str) -> None:
        if os.path.exists(staged):
            os.replace(staged, src)  # a writer's os.replace just before ours
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", writer_wins_then_rename)
    assert bytes(st.get("k")) == good
    monkeypatch.undo()
    assert os.listdir(st.quarantine_dir) == []
    assert st.keys() == ["k"] and st.total_bytes == len(good)


def test_corrupt_blob_in_a_store_that_cannot_quarantine(tmp_path, monkeypatch):
    """A read-only store still reports CorruptEncodedKVError (a cache miss), never a bare OSError."""
    s = DirectoryStore(tmp_path)
    s.put("k", make_blob(4096, 1))
    p = tmp_path / "k"
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF
    p.write_bytes(bytes(data))

    def refuse(*a, **kw):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(CorruptEncodedKVError, match="could not quarantine it"):
        s.get("k")


def test_fifo_under_a_key_name_does_not_hang(tmp_path):
    s = DirectoryStore(tmp_path)
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(KeyError):
        s.get("pipe")


# --------------------------------------------------------------------------- symlinks and special files


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A valid blob outside the store root, with an old mtime, that no store call may serve or touch."""
    f = tmp_path / "outside.blob"
    f.write_bytes(make_blob(2048, 9))
    os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    return f


def _untouched(f: Path, data: bytes) -> None:
    assert f.read_bytes() == data
    assert os.stat(f).st_mtime_ns == 1_000_000_000


def test_symlink_under_a_key_is_a_miss_never_followed(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "store"
    st = DirectoryStore(root)
    data = outside.read_bytes()
    os.symlink(outside, root / "link")
    with pytest.raises(KeyError):
        st.get("link")
    assert not st.contains("link") and "link" not in st
    assert st.keys() == [] and len(st) == 0 and st.total_bytes == 0
    _untouched(outside, data)
    assert os.path.islink(root / "link")  # left alone, not quarantined through the link
    assert os.listdir(st.quarantine_dir) == []


def test_symlink_to_a_file_inside_the_root_is_not_served(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path)
    b = make_blob(2048, 1)
    st.put("real", b)
    os.symlink(tmp_path / "real", tmp_path / "alias")
    with pytest.raises(KeyError):
        st.get("alias")
    assert st.keys() == ["real"] and not st.contains("alias") and bytes(st.get("real")) == b


@pytest.mark.parametrize("kind", ["loop", "self", "dangling", "to_dir", "to_fifo"])
def test_odd_symlinks_are_misses_not_oserrors(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "store"
    st = DirectoryStore(root)
    if kind == "loop":
        os.symlink(root / "b", root / "a")
        os.symlink(root / "a", root / "b")
    elif kind == "self":
        os.symlink(root / "a", root / "a")
    elif kind == "dangling":
        os.symlink(tmp_path / "nowhere", root / "a")
    elif kind == "to_dir":
        (tmp_path / "d").mkdir()
        os.symlink(tmp_path / "d", root / "a")
    else:
        os.mkfifo(tmp_path / "fifo")
        os.symlink(tmp_path / "fifo", root / "a")
    with pytest.raises(KeyError):
        st.get("a")
    assert st.contains("a") is False
    assert "a" not in st.keys()
    st.refresh()
    assert DirectoryStore(root).keys() == st.keys()


def test_put_and_delete_replace_the_link_not_its_target(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "store"
    st = DirectoryStore(root)
    data = outside.read_bytes()
    os.symlink(outside, root / "k")
    new = make_blob(1024, 2)
    st.put("k", new)
    assert not os.path.islink(root / "k") and bytes(st.get("k")) == new
    _untouched(outside, data)
    os.unlink(root / "k")
    os.symlink(outside, root / "k")
    assert st.delete("k") is True  # removes the stray link itself
    assert not os.path.lexists(root / "k")
    _untouched(outside, data)


def test_eviction_never_follows_a_symlink(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "store"
    size = len(make_blob(4096, 0))
    st = DirectoryStore(root, max_bytes=2 * size, rescan_interval_s=3600)
    st.put("a", make_blob(4096, 1))
    st.put("b", make_blob(4096, 2))
    data = outside.read_bytes()
    os.unlink(root / "a")  # between scans, "a" becomes a link to a file outside
    os.symlink(outside, root / "a")
    st.put("c", make_blob(4096, 3))  # needs room: the stale entry is dropped, the link not followed
    _untouched(outside, data)
    assert os.path.islink(root / "a")
    assert "c" in st.keys()


def test_temp_named_symlink_is_not_followed_by_the_scan(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    data = outside.read_bytes()
    link = root / ".tmp.999999999.1.ffff"  # looks like a dead writer's temp file
    os.symlink(outside, link)
    os.mkfifo(root / ".tmp.999999999.1.eeee")
    # The scan must neither hang on the FIFO nor touch the link's target; a child keeps a hang from
    # hanging the suite (the bound is a deadlock guard, not a speed requirement).
    p = multiprocessing.get_context().Process(target=_scan_store, args=(str(root),))
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        pytest.fail("scanning a store with a FIFO named like a temp file hung")
    assert p.exitcode == 0
    _untouched(outside, data)


def _scan_store(root: str) -> None:
    DirectoryStore(root, stale_temp_s=0).refresh()


@pytest.mark.parametrize("make", ["released", "closed_mmap", "datetime64", "object"])
def test_put_refuses_odd_buffers_with_a_codec_error(tmp_path: Path, make: str) -> None:
    st = DirectoryStore(tmp_path)
    if make == "released":
        buf: object = memoryview(make_blob(256, 1))
        buf.release()  # type: ignore[attr-defined]
    elif make == "closed_mmap":
        buf = mmap.mmap(-1, 4096)
        buf.close()  # type: ignore[attr-defined]
    elif make == "datetime64":
        buf = np.zeros(8, dtype="datetime64[s]")
    else:
        buf = object()
    with pytest.raises(UnsupportedConfigError):
        st.put("k", buf)
    assert st.keys() == []


def test_store_modules_have_no_test_hooks() -> None:
    import kvcodec.store as store_pkg

    sources = sorted(Path(store_pkg.__file__).parent.glob("*.py"))
    assert len(sources) >= 10
    for path in sources:
        src = path.read_text()
        assert "_crash_hook" not in src and "tests shrink" not in src, path.name
