"""The ``kvcodec`` command line: inspect, verify, encode/decode round trips, quality, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcodec import CodecError, decode, encode
from kvcodec.format import MAX_DIM, Header, ScaleScope, assemble, parse
from kvcodec.tools import cli, cmd_inspect, cmd_verify
from kvcodec.tools.cli import main
from kvcodec.tools.progress import Progress, progress_enabled
from tests.paths import REPO_ROOT, SHARED_VECTORS

VECTORS = SHARED_VECTORS
REPO = REPO_ROOT

HASHES = {"model_id": "meta-llama/Meta-Llama-3-8B", "tokenizer_hash": "tok123", "kv_layout": "NHD"}


def _kv(tokens: int = 32, heads: int = 4, dim: int = 16, dtype: torch.dtype = torch.float16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(tokens, heads, dim, generator=g) * 3).to(dtype)
    v = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    return k, v


def _blob(tmp_path: Path, name: str = "a.blob", *, seed: int = 0, **kw) -> Path:
    k, v = _kv(seed=seed)
    opts = {
        "scope": "per_page_head",
        "page_size": 8,
        "hashes": HASHES,
        "layer_id": 5,
        "chunk_id": 2,
        "version": 1,
    }
    opts.update(kw)
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(encode(k, v, **opts))
    return p


def _flip_payload_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x40
    p.write_bytes(bytes(data))


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcodec: error: "), err
    assert "Traceback" not in err
    return lines[0]


# ----------------------------------------------------------------------------- inspect


def test_inspect_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path)
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    for text in (
        str(p),
        "LMCKV\\x01\\x00\\x01",
        "PER_PAGE_HEAD",
        "float16",
        "float8_e4m3fn",
        "layer id",
        "chunk size",
        "(4, 4)",  # 32 tokens / page 8 -> 4 pages x 4 heads
        "header bytes",
        "meta-llama/Meta-Llama-3-8B",
        "tok123",
        "trailing bytes",
    ):
        assert text in out, text
    assert "CRC" in out and " ok" in out and "BAD" not in out


def test_inspect_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path)
    parsed = parse(p.read_bytes())
    assert main(["inspect", "--json", str(p)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["file"] == str(p)
    assert info["version"] == 1
    assert info["scale_scope"] == "PER_PAGE_HEAD"
    assert (info["k_dtype"], info["v_dtype"], info["scale_dtype"]) == ("float16", "float8_e4m3fn", "float32")
    assert (info["layer_id"], info["chunk_id"], info["chunk_size"], info["page_size"]) == (5, 2, 32, 8)
    assert (info["kv_head_count"], info["head_dim"], info["scale_shape"]) == (4, 16, [4, 4])
    assert info["k_payload_len"] == 32 * 4 * 16 * 2
    assert info["v_payload_len"] == 32 * 4 * 16
    assert info["scale_payload_len"] == 16 * 4
    assert info["header_len"] == parsed.header_len
    assert info["hashes"]["model_id"] == HASHES["model_id"]
    assert info["hashes"]["rope_config_hash"] == ""
    assert info["trailing_bytes"] == 0
    assert info["crc_ok"] is True
    assert info["crc"] == f"{parsed.crc:#010x}"


def test_inspect_json_several_is_a_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _blob(tmp_path, "a.blob")
    b = _blob(tmp_path, "b.blob", scope="per_tensor", version=2)
    assert main(["inspect", "--json", str(a), str(b)]) == 0
    infos = json.loads(capsys.readouterr().out)
    assert [i["file"] for i in infos] == [str(a), str(b)]
    assert infos[1]["version"] == 2 and infos[1]["scale_scope"] == "PER_TENSOR"


def test_inspect_bad_crc_still_shows_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path)
    _flip_payload_byte(p)
    assert main(["inspect", str(p)]) == 1
    out = capsys.readouterr().out
    assert "PER_PAGE_HEAD" in out and "BAD" in out
    assert main(["inspect", "--json", str(p)]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["crc_ok"] is False and info["crc"] != info["crc_computed"]
    assert info["layer_id"] == 5


def test_inspect_trailing_bytes_v1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path)
    p.write_bytes(p.read_bytes() + b"xyz")
    assert main(["inspect", "--json", str(p)]) == 0
    assert json.loads(capsys.readouterr().out)["trailing_bytes"] == 3


def test_inspect_garbage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = tmp_path / "garbage.bin"
    g.write_bytes(b"not a blob at all" * 10)
    assert main(["inspect", str(g)]) == 1
    assert "bad magic" in capsys.readouterr().out
    assert main(["inspect", "--json", str(g)]) == 1
    assert "bad magic" in json.loads(capsys.readouterr().out)["error"]


@pytest.mark.skipif(not (VECTORS / "pph_fp16_small.blob").is_file(), reason="no ../shared/vectors")
def test_inspect_shared_vector(capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((VECTORS / "manifest.json").read_text())
    want = next(v for v in manifest["vectors"] if v["name"] == "pph_fp16_small")
    assert main(["inspect", "--json", str(VECTORS / "pph_fp16_small.blob")]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("layer_id", "chunk_id", "chunk_size", "page_size", "kv_head_count", "head_dim", "header_len"):
        assert info[key] == want[key], key
    assert info["scale_shape"] == want["scale_shape"]
    assert info["hashes"] == want["hashes"]
    assert info["crc_ok"] and int(info["crc"], 16) == want["payload_crc32"]
    assert main(["inspect", str(VECTORS / "corrupt_bad_crc.blob")]) == 1
    assert "BAD" in capsys.readouterr().out


# ----------------------------------------------------------------------------- verify


def test_verify_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _blob(tmp_path, "a.blob"), _blob(tmp_path, "b.blob", seed=1)
    assert main(["verify", str(a), str(b)]) == 0
    assert capsys.readouterr().out.strip() == "verified 2 blobs: 2 ok, 0 bad"


def test_verify_bad_blob(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _blob(tmp_path, "a.blob"), _blob(tmp_path, "b.blob", seed=1)
    _flip_payload_byte(b)
    assert main(["verify", str(a), str(b)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{b}: ") and "CRC mismatch" in lines[0]
    assert lines[1] == "verified 2 blobs: 1 ok, 1 bad"


def test_verify_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    for i in range(3):
        _blob(root, f"k{i}", seed=i)
    _blob(root / "sub", "deep", seed=7)
    (root / ".quarantine").mkdir()
    (root / ".quarantine" / "junk").write_bytes(b"junk")  # hidden: skipped
    (root / ".tmp.123").write_bytes(b"partial")  # hidden: skipped
    assert main(["verify", str(root)]) == 0
    assert capsys.readouterr().out.strip() == "verified 4 blobs: 4 ok, 0 bad"

    (root / "sub" / "broken").write_bytes(b"LMCKV\x01\x00\x01 truncated")
    assert main(["verify", "--progress", str(root)]) == 1  # forced bar goes to stderr
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "verified 5 blobs: 4 ok, 1 bad"
    assert len(out) == 2 and out[0].startswith(str(root / "sub" / "broken") + ": ")

    assert main(["verify", "--glob", "k*", "-v", str(root)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "verified 3 blobs: 3 ok, 0 bad" and out[0].endswith(": ok")


def test_verify_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == "verified 0 blobs: 0 ok, 0 bad"
    assert "warning" in cap.err


def test_verify_expected_hashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path)
    assert main(["verify", "--expect-model-id", HASHES["model_id"], "--expect-kv-layout", "NHD", str(p)]) == 0
    capsys.readouterr()
    assert main(["verify", "--expect-model-id", "other/model", str(p)]) == 1
    out = capsys.readouterr().out
    assert "CodecMismatchError" in out and "model_id" in out
    # An empty blob field is a wildcard unless --strict-hashes.
    assert main(["verify", "--expect-rope-config-hash", "r1", str(p)]) == 0
    capsys.readouterr()
    assert main(["verify", "--expect-rope-config-hash", "r1", "--strict-hashes", str(p)]) == 1
    assert "rope_config_hash" in capsys.readouterr().out


def test_verify_strict_trailing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path)
    p.write_bytes(p.read_bytes() + b"\0\0")
    assert main(["verify", str(p)]) == 0
    capsys.readouterr()
    assert main(["verify", "--strict", str(p)]) == 1
    assert "trailing" in capsys.readouterr().out


@pytest.mark.skipif(not (VECTORS / "manifest.json").is_file(), reason="no ../shared/vectors")
def test_verify_shared_vectors(capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((VECTORS / "manifest.json").read_text())
    good = sum(1 for v in manifest["vectors"] if v["kind"] != "corrupt")
    bad = sum(1 for v in manifest["vectors"] if v["kind"] == "corrupt")
    assert main(["verify", "--glob", "*.blob", str(VECTORS)]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"verified {good + bad} blobs: {good} ok, {bad} bad"
    )


# ----------------------------------------------------------------------------- encode / decode


def test_encode_decode_npy_roundtrip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    k, v = _kv(tokens=40, dtype=torch.float16)
    np.save(tmp_path / "k.npy", k.numpy())
    np.save(tmp_path / "v.npy", v.float().numpy())  # V may be fp32
    blob = tmp_path / "x.blob"
    rc = main(
        [
            "encode",
            "--k",
            str(tmp_path / "k.npy"),
            "--v",
            str(tmp_path / "v.npy"),
            "--out",
            str(blob),
            "--page-size",
            "16",
            "--layer-id",
            "7",
            "--chunk-id",
            "3",
            "--model-id",
            "m",
            "--kv-layout",
            "NHD",
        ]
    )
    assert rc == 0
    assert f"wrote {blob}" in capsys.readouterr().out
    h = parse(blob.read_bytes()).header
    assert (h.layer_id, h.chunk_id, h.page_size, h.scale_shape) == (7, 3, 16, (3, 4))
    assert (h.hashes.model_id, h.hashes.kv_layout) == ("m", "NHD")

    out = tmp_path / "x.npz"
    assert main(["decode", str(blob), "--out", str(out), "--expect-model-id", "m"]) == 0
    z = np.load(out, allow_pickle=False)
    assert z["k"].dtype == np.float16 and np.array_equal(z["k"].view(np.uint16), k.numpy().view(np.uint16))
    ref = decode(blob.read_bytes())
    assert z["v"].dtype == np.uint8 and np.array_equal(z["v"], ref.v.view(torch.uint8).numpy())
    assert np.array_equal(z["scales"], ref.scales.numpy())
    meta = json.loads(str(z["meta"]))
    assert meta["header"]["layer_id"] == 7 and meta["npz_dtypes"]["v"] == "float8_e4m3fn as uint8"

    out2 = tmp_path / "y.npz"
    assert main(["decode", str(blob), "--out", str(out2), "--dequant", "fp32"]) == 0
    v_hat = np.load(out2)["v"]
    assert v_hat.dtype == np.float32
    assert np.abs(v_hat - v.float().numpy()).max() <= 0.07 * np.abs(v.float().numpy()).max()


def test_encode_decode_safetensors_bf16(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file, save_file

    k, v = _kv(tokens=48, dtype=torch.bfloat16, seed=3)
    src = tmp_path / "kv.safetensors"
    save_file({"keys": k, "values": v}, str(src))
    blob = tmp_path / "x.blob"
    rc = main(
        [
            "encode",
            "--k",
            str(src),
            "--k-name",
            "keys",
            "--v-name",
            "values",
            "--out",
            str(blob),
            "--scope",
            "per_layer_head",
            "--version",
            "2",
        ]
    )
    assert rc == 0
    h = parse(blob.read_bytes()).header
    assert h.version == 2 and str(h.k_dtype) == "bfloat16" and h.scale_shape == (4,)

    out = tmp_path / "out.safetensors"
    assert main(["decode", str(blob), "--out", str(out)]) == 0
    assert "float8_e4m3fn" in capsys.readouterr().out
    d = load_file(str(out))
    assert d["k"].dtype == torch.bfloat16 and torch.equal(d["k"].view(torch.int16), k.view(torch.int16))
    assert d["v"].dtype == torch.float8_e4m3fn and d["scales"].shape == (4,)

    out2 = tmp_path / "deq.safetensors"
    assert main(["decode", str(blob), "--out", str(out2), "--dequant", "bf16"]) == 0
    assert load_file(str(out2))["v"].dtype == torch.bfloat16

    npz = tmp_path / "bf.npz"  # numpy has no bf16: K travels as its raw bits
    assert main(["decode", str(blob), "--out", str(npz)]) == 0
    kz = np.load(npz)["k"]
    assert kz.dtype == np.uint16 and np.array_equal(kz, k.view(torch.int16).numpy().view(np.uint16))


def test_encode_v_only_and_external_scales(tmp_path: Path) -> None:
    _, v = _kv()
    np.save(tmp_path / "v.npy", v.numpy())
    np.save(tmp_path / "s.npy", np.full((4,), 0.01, dtype=np.float32))
    blob = tmp_path / "x.blob"
    rc = main(
        [
            "encode",
            "--v",
            str(tmp_path / "v.npy"),
            "--out",
            str(blob),
            "--scope",
            "external",
            "--scales",
            str(tmp_path / "s.npy"),
        ]
    )
    assert rc == 0
    h = parse(blob.read_bytes()).header
    assert h.k_payload_len == 0 and h.scale_payload_len == 0 and h.scale_scope.name == "EXTERNAL"


def test_decode_hash_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path)
    out = tmp_path / "o.npz"
    assert main(["decode", str(p), "--out", str(out), "--expect-model-id", "someone/else"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "model_id" in line
    assert not out.exists()


def test_decode_bad_crc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path)
    _flip_payload_byte(p)
    assert main(["decode", str(p), "--out", str(tmp_path / "o.npz")]) == 1
    assert "CRC" in _one_error_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- quality


def test_quality_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["quality", "--tokens", "64", "--heads", "2", "--head-dim", "32", "--page-size", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "SQNR dB" in out and "per_page_head" in out and "outlier_channels" in out
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 9
    assert {r["scope"] for r in rows} == {"per_tensor", "per_layer_head", "per_page_head"}
    assert all(r["sqnr_db"] > 15 for r in rows)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{tmp}/missing.blob"],
        ["verify", "{tmp}/missing.blob"],
        ["decode", "{tmp}/missing.blob", "--out", "{tmp}/o.npz"],
        ["encode", "--k", "{tmp}/missing.npy", "--v", "{tmp}/missing.npy", "--out", "{tmp}/o.blob"],
    ],
)
def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(argv) == 1
    assert "missing" in _one_error_line(capsys.readouterr().err)


def test_garbage_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = tmp_path / "g.blob"
    g.write_bytes(b"\x00garbage")
    assert main(["decode", str(g), "--out", str(tmp_path / "o.npz")]) == 1
    assert "truncated" in _one_error_line(capsys.readouterr().err)
    for name in ("g.npy", "g.safetensors"):
        (tmp_path / name).write_bytes(b"garbage garbage garbage")
        assert main(["encode", "--k", str(tmp_path / name), "--v", str(tmp_path / name), "--out", "x"]) == 1
        assert name in _one_error_line(capsys.readouterr().err)
    # A valid .npy whose dtype the codec refuses for K and V.
    np.save(tmp_path / "f.npy", np.zeros((4, 2, 8), np.int16))
    assert main(["encode", "--k", str(tmp_path / "f.npy"), "--v", str(tmp_path / "f.npy"), "--out", "x"]) == 1
    assert "dtype" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_npy_header_claiming_more_than_the_file_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: tuple[int, int]
) -> None:
    """A 180-byte .npy whose header claims 2 PiB: one line naming the bad header, no allocation attempted."""
    import io

    hdr = io.BytesIO()
    write = (
        np.lib.format.write_array_header_1_0 if version == (1, 0) else np.lib.format.write_array_header_2_0
    )
    write(hdr, {"descr": "<f2", "fortran_order": False, "shape": (2**50, 1)})
    huge = tmp_path / "huge.npy"
    huge.write_bytes(hdr.getvalue().ljust(180, b"\0"))
    assert main(["encode", "--k", str(huge), "--v", str(huge), "--out", str(tmp_path / "o.blob")]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "huge.npy: bad .npy header" in line and "MemoryError" not in line
    assert not (tmp_path / "o.blob").exists()


def test_npy_header_that_does_not_parse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY\x01\x00" + (16).to_bytes(2, "little") + b"{'descr': 1}    ")
    assert main(["encode", "--k", str(bad), "--v", str(bad), "--out", str(tmp_path / "o.blob")]) == 1
    assert "bad.npy: bad .npy header" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["inspect"],
        ["inspect", "--bogus", "x"],
        ["quality", "--tokens", "zero"],
        ["quality", "--tokens", "0"],
        ["encode", "--k", "k.npy", "--v", "v.npy"],  # no --out
        ["encode", "--k", "k.npy", "--out", "x.blob"],  # .npy K needs --v
        ["encode", "--k", "k.npy", "--v", "v.npy", "--out", "x", "--scope", "weird"],
        ["decode", "x.blob", "--out", "x.txt"],
        ["demo", "--dtype", "fp8"],
    ],
)
def test_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(argv) == 2
    cap = capsys.readouterr()
    _one_error_line(cap.err)
    assert cap.out == ""


def test_unknown_input_extension(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "k.txt"
    p.write_text("x")
    assert main(["encode", "--k", str(p), "--v", str(p), "--out", str(tmp_path / "o")]) == 2
    assert ".npy or .safetensors" in _one_error_line(capsys.readouterr().err)


def test_output_folder_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path)
    assert main(["decode", str(p), "--out", str(tmp_path / "nope" / "o.npz")]) == 1
    assert "does not exist" in _one_error_line(capsys.readouterr().err)


def test_unexpected_exception_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(_args: object) -> int:
        raise RuntimeError("kaboom\nsecond line")

    monkeypatch.setattr(cmd_inspect, "run", boom)
    monkeypatch.delenv("KVCODEC_DEBUG", raising=False)
    p = _blob(tmp_path)
    assert main(["inspect", str(p)]) == 1
    assert "kaboom second line" in _one_error_line(capsys.readouterr().err)


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("inspect", "verify", "encode", "decode", "quality", "demo"):
        assert cmd in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("kvcodec ")
    assert main(["verify", "--help"]) == 0
    assert "--expect-tokenizer-hash" in capsys.readouterr().out


def test_progress_enabled() -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    assert progress_enabled(None, Tty()) is True  # type: ignore[arg-type]
    assert progress_enabled(False, Tty()) is False  # type: ignore[arg-type]
    assert progress_enabled(True) is True
    with Progress(3, "x", enabled=False) as bar:
        assert not bar.active
        bar.update()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_python_m_kvcodec_help() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvcodec", "--help"], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "usage: kvcodec" in r.stdout and "demo" in r.stdout


def test_python_m_kvcodec_error_exit_code(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvcodec", "inspect", str(tmp_path / "missing.blob")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert r.returncode == 1
    _one_error_line(r.stderr)


def test_console_script(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "kvcodec"
    if not script.is_file():
        pytest.skip("console script not installed (pip install -e .)")
    p = _blob(tmp_path)
    r = subprocess.run([str(script), "verify", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "verified 1 blobs: 1 ok, 0 bad"


def test_fifo_in_a_tree_or_named_does_not_hang(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _blob(tmp_path / "d", "a.blob")
    os.mkfifo(tmp_path / "d" / "zfifo")
    assert main(["verify", str(tmp_path / "d")]) == 0  # the FIFO is not a blob: skipped
    assert "1 ok, 0 bad" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "d" / "zfifo")]) == 1
    assert "not a regular file" in capsys.readouterr().out  # inspect reports per file, in its table


def test_output_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = _blob(tmp_path)
    (tmp_path / "dd.npz").mkdir()
    assert main(["decode", str(b), "--out", str(tmp_path / "dd.npz")]) == 1
    assert "dd.npz: is a directory" in _one_error_line(capsys.readouterr().err)


def test_kvcodec_debug_zero_means_off(
    tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVCODEC_DEBUG", "0")
    (tmp_path / "e.blob").write_bytes(b"")
    assert main(["decode", str(tmp_path / "e.blob"), "--out", str(tmp_path / "e.npz")]) == 1
    _one_error_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- structure


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120, check=True
    )


def test_demo_does_not_import_the_cli() -> None:
    """The demo and the CLI no longer import each other (progress bars live in tools.progress)."""
    r = _run_python("import sys, kvcodec.tools.demo; print('kvcodec.tools.cli' in sys.modules)")
    assert r.stdout.strip() == "False"


def test_help_imports_no_torch() -> None:
    code = (
        "import sys; import kvcodec.tools.cli as c; c.TUNE_MODULE = 'kvcodec.tools._absent_tune'; "
        "rc = c.main(['--help']); print(rc, 'torch' in sys.modules)"
    )
    assert _run_python(code).stdout.strip().splitlines()[-1] == "0 False"


def test_every_command_module_registers_one_subcommand() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for module in cli.COMMANDS:
        name = module.__name__.rsplit(".cmd_", 1)[1]
        assert sub.choices[name].get_default("func") is module.run, name


def test_tune_missing_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "TUNE_MODULE", "kvcodec.tools._absent_tune")
    assert main(["--help"]) == 0
    assert "tune" in capsys.readouterr().out
    assert main(["tune", "--anything"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "tune is not available" in line and "_absent_tune" in line


def test_tune_module_is_wired_when_present(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.machinery
    import types

    name = "kvcodec.tools._fake_tune"
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def add_parser(sub: object) -> None:
        p = sub.add_parser("tune", help="tune kernels")  # type: ignore[attr-defined]
        p.add_argument("--shape", default="x")

    def run(args: object) -> int:
        print(f"tuned {args.shape}")  # type: ignore[attr-defined]
        return 0

    mod.add_parser, mod.run = add_parser, run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(cli, "TUNE_MODULE", name)
    assert main(["tune", "--shape", "s1"]) == 0
    assert capsys.readouterr().out.strip() == "tuned s1"


# ----------------------------------------------------------------------------- sealed by default


def test_encode_writes_version_2_by_default_and_1_on_request(tmp_path: Path) -> None:
    k, v = _kv()
    np.save(tmp_path / "k.npy", k.numpy())
    np.save(tmp_path / "v.npy", v.numpy())
    base = ["encode", "--k", str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy"), "--page-size", "8"]
    assert main([*base, "--out", str(tmp_path / "d.blob")]) == 0
    assert parse((tmp_path / "d.blob").read_bytes()).header.version == 2
    assert main([*base, "--out", str(tmp_path / "one.blob"), "--version", "1"]) == 0
    assert parse((tmp_path / "one.blob").read_bytes()).header.version == 1


# ----------------------------------------------------------------------------- inspect escapes blob strings

HOSTILE = "evil\x1b[2J\x1b]0;pwned\x07\nline2\u202eabc\\"


def test_inspect_escapes_hash_strings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path, hashes={"model_id": HOSTILE, "kv_layout": "NHD\r\t", "tokenizer_hash": "tök"})
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\r\t\u202e")
    row = next(line for line in out.splitlines() if "hash model_id" in line)
    assert row.endswith("evil\\x1b[2J\\x1b]0;pwned\\x07\\nline2\\u202eabc\\\\")
    assert "line2" not in out.replace(row, "")  # the stored newline did not start a new line
    assert "NHD\\r\\t" in out and "tök" in out  # printable UTF-8 stays readable

    assert main(["inspect", "--json", str(p)]) == 0
    raw = capsys.readouterr().out
    assert raw.isascii() and not any(c in raw for c in "\x1b\x07\r\t")
    info = json.loads(raw)
    assert info["hashes"]["model_id"] == HOSTILE and info["hashes"]["tokenizer_hash"] == "tök"


def test_errors_and_verify_lines_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _blob(tmp_path, hashes={"model_id": "m"})
    assert main(["verify", "--expect-model-id", "x\x1b[31m", str(p)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "model_id" in out
    weird = tmp_path / "we\x1bird\nname.blob"
    weird.write_bytes(b"garbage")
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "we\\x1bird\\nname.blob" in out
    assert main(["decode", str(weird), "--out", str(tmp_path / "o.npz")]) == 1
    assert "\x1b" not in _one_error_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- verify == decode


def _crafted(tmp_path: Path, name: str, h: Header, k: bytes = b"", v: bytes = b"", s: bytes = b"") -> Path:
    h = h.replace(k_payload_len=len(k), v_payload_len=len(v), scale_payload_len=len(s))
    p = tmp_path / f"{name}.blob"
    p.write_bytes(bytes(assemble(h, k, v, s)))
    return p


def _crafted_blobs(tmp_path: Path) -> dict[str, Path]:
    f32 = np.float32
    base = Header(k_dtype="float16", v_dtype="float8_e4m3fn", scale_scope=ScaleScope.PER_TENSOR, version=2)
    one = f32(1).tobytes()
    return {
        # kv_head_count * head_dim overflows: passed parse and verify, then decode raised RuntimeError.
        "overflow_v1": _crafted(
            tmp_path, "overflow_v1", base.replace(version=1, kv_head_count=2**32, head_dim=2**32), s=one
        ),
        "overflow_v2": _crafted(
            tmp_path, "overflow_v2", base.replace(kv_head_count=2**32, head_dim=2**32), s=one
        ),
        # An empty per_tensor blob without its scale.
        "empty_per_tensor": _crafted(tmp_path, "empty_per_tensor", base.replace(kv_head_count=2, head_dim=8)),
        # A NaN scale, and a page size far beyond the 2 tokens held.
        "nan_scale": _crafted(
            tmp_path,
            "nan_scale",
            base.replace(kv_head_count=1, head_dim=8),
            bytes(32),
            bytes(16),
            f32("nan").tobytes(),
        ),
        "huge_page": _crafted(
            tmp_path,
            "huge_page",
            base.replace(
                scale_scope=ScaleScope.PER_PAGE_HEAD,
                kv_head_count=1,
                head_dim=8,
                page_size=2**28,
                scale_shape=(1, 1),
            ),
            bytes(32),
            bytes(16),
            one,
        ),
        "good": _blob(tmp_path, "good.blob", version=2),
    }


@pytest.mark.parametrize(
    "name", ["overflow_v1", "overflow_v2", "empty_per_tensor", "nan_scale", "huge_page", "good"]
)
def test_a_blob_that_verifies_decodes(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    p = _crafted_blobs(tmp_path)[name]
    verified = main(["verify", str(p)]) == 0
    raw = main(["decode", str(p), "--out", str(tmp_path / "raw.npz")])
    deq = main(["decode", str(p), "--out", str(tmp_path / "deq.npz"), "--dequant", "fp32"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unexpected" not in err, err
    assert verified == (raw == 0 and deq == 0), (verified, raw, deq, err)
    if name.startswith("overflow") or name == "nan_scale":  # "verifies" means "decodes to finite values"
        assert not verified
    if name in ("good", "huge_page"):
        assert verified


def test_empty_per_tensor_blob_is_not_called_external(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = _crafted_blobs(tmp_path)["empty_per_tensor"]
    assert main(["inspect", "--json", str(p)]) == 0
    assert json.loads(capsys.readouterr().out)["scale_scope"] == "PER_TENSOR"
    rc = main(["decode", str(p), "--out", str(tmp_path / "o.npz"), "--dequant", "fp16"])
    err = capsys.readouterr().err
    assert "external" not in err.lower(), err
    if rc == 0:
        assert np.load(tmp_path / "o.npz")["v"].shape == (0, 2, 8)


def test_verify_keeps_external_blobs_without_scales(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the caller has an external blob's scales: verify decodes its V raw."""
    _, v = _kv()
    p = tmp_path / "ext.blob"
    p.write_bytes(encode(None, v, scope="external", scales=torch.full((4,), 0.01)))
    assert parse(p.read_bytes()).header.scale_payload_len == 0
    assert main(["verify", str(p)]) == 0
    assert "1 ok" in capsys.readouterr().out


def test_verify_blob_raises_what_decode_raises(tmp_path: Path) -> None:
    bad = _crafted_blobs(tmp_path)["overflow_v2"].read_bytes()
    with pytest.raises(CodecError) as from_verify:
        cmd_verify.verify_blob(bad)
    with pytest.raises(CodecError) as from_decode:
        decode(bad, out_v_dtype=torch.float32)
    assert type(from_verify.value) is type(from_decode.value)


def test_decode_dequant_memory_follows_the_payload_not_the_page_size(tmp_path: Path) -> None:
    """A 2-token blob declaring page_size 2**28: dequantizing it must not allocate per declared row."""
    p = _crafted_blobs(tmp_path)["huge_page"]
    code = (
        "import resource, sys; from kvcodec.tools.cli import main; "
        f"rc = main(['decode', {str(p)!r}, '--out', {str(tmp_path / 'o.npz')!r}, '--dequant', 'fp32']); "
        "print(rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    rc, peak_kib = _run_python(code).stdout.split()[-2:]
    assert rc == "0"
    assert int(peak_kib) < 1536 * 1024  # torch alone is ~300 MiB; 2**28 rows of fp32 would be 8 GiB


# ----------------------------------------------------------------------------- argument validation


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "infinity"])
def test_demo_refuses_non_finite_sqnr_floor(capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert main(["demo", "--layers", "1", "--tokens", "16", f"--min-sqnr-db={value}"]) == 2
    cap = capsys.readouterr()
    assert "finite" in _one_error_line(cap.err) and cap.out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["encode", "--k", "k.npy", "--v", "v.npy", "--out", "x", "--page-size", str(MAX_DIM + 1)],
        ["quality", "--page-size", str(2**62)],
        ["demo", "--page-size", str(2**62)],
        ["quality", "--tokens", str(2**40)],
        ["quality", "--heads", "4096", "--head-dim", "4096", "--tokens", "4096"],
        ["encode", "--k", "k.npy", "--v", "v.npy", "--out", "x", "--version", "3"],
        ["demo", "--version", "0"],
    ],
)
def test_size_arguments_are_checked_before_any_work(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert main(argv) == 2
    cap = capsys.readouterr()
    _one_error_line(cap.err)
    assert cap.out == ""


def test_quality_huge_page_size_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    """A page far larger than the tokens is one partial page: no padding to the declared size."""
    assert (
        main(
            [
                "quality",
                "--tokens",
                "32",
                "--heads",
                "2",
                "--head-dim",
                "16",
                "--page-size",
                str(2**40),
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert {r["scope"] for r in rows} == {"per_tensor", "per_layer_head", "per_page_head"}


SECRET = "Tr0ub4dor-and-3-horses"


@pytest.mark.parametrize(
    "argv",
    [
        ["decode", f"redis://u:{SECRET}@h:1/x.lmckv", "--out", "y.safetensors"],
        ["encode", "--k", f"redis://u:{SECRET}@h/k.npy", "--v", "v.npy", "--out", "x.lmckv"],
        ["inspect", f"redis-cluster://default:{SECRET}@127.0.0.1:1"],
        ["verify", f"http://u:pa/{SECRET}@h/x"],
        ["verify", f"redis://default:{SECRET}"],
        ["inspect", f"rediss+cluster://default:{SECRET},h:1"],
    ],
)
def test_no_error_line_shows_a_urls_password(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Any command, any scheme: a URL's credentials never reach stderr (issue 34)."""
    assert main(argv) in (1, 2)
    cap = capsys.readouterr()
    assert SECRET not in cap.out + cap.err and "Tr0ub" not in cap.err
    assert cap.err.count("\n") == 1 and "unexpected" not in cap.err


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://default:pw", "redis://***"),
        ("redis://default:pw/0", "redis://***"),
        ("redis://u:p@h:6379/0", "redis://h:6379"),
        ("redis://u:p/q@h:6379/0?ca_certs=x", "redis://h:6379"),
        ("redis+cluster://a:1,b:2", "redis+cluster://a:1,b:2"),
        ("redis+cluster://u:pw,b:2", "redis+cluster://***"),
        ("redis://[::1]:6379/0", "redis://[::1]:6379"),
        ("redis://u:p@", "redis://***"),
    ],
)
def test_location_of_shows_hosts_only(url: str, shown: str) -> None:
    from kvcodec.tools.stores import location_of

    assert location_of(url) == shown


def test_the_store_timeout_limits_agree() -> None:
    from kvcodec.tools.stores import MAX_STORE_TIMEOUT_MS

    pytest.importorskip("redis")
    from kvcodec.store.redis import MAX_TIMEOUT_S

    assert MAX_STORE_TIMEOUT_MS == MAX_TIMEOUT_S * 1000
