"""``kvcodec verify`` checks what a load would produce: V must decode to finite values.

A CRC-valid blob whose V holds FP8 NaN codes (or, for e5m2, Inf codes) decodes to NaN;
verify reports it with the group it lies in, as it reports NaN stored scales. The blobs are
made with kvcodec's own writer (``assemble`` reseals the patched bytes), so only V's values
are wrong.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from kvcodec import CorruptEncodedKVError, Reason, encode
from kvcodec.format import assemble, parse
from kvcodec.format.parser import check_v_codes
from kvcodec.tools.cli import main

TOKENS, HEADS, DIM, PAGE = 32, 2, 16, 8


def _clean(v_dtype: torch.dtype = torch.float8_e4m3fn, scope: str = "per_page_head") -> bytearray:
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(2))
    extra = {"allow_e5m2": True} if v_dtype == torch.float8_e5m2 else {}
    return encode(k, v, scope=scope, page_size=PAGE, v_dtype=v_dtype, **extra)


def _with_code(blob: bytearray, token: int, head: int, dim: int, code: int) -> bytearray:
    p = parse(blob)
    v = bytearray(p.v)
    v[(token * HEADS + head) * DIM + dim] = code
    return assemble(p.header, p.k, v, p.scales)


def _verify(tmp_path: Path, blob: bytes, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "blob.lmckv"
    path.write_bytes(blob)
    code = main(["verify", str(path)])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def test_a_clean_blob_still_verifies(tmp_path: Path, capsys) -> None:
    code, out = _verify(tmp_path, _clean(), capsys)
    assert code == 0 and "1 ok, 0 bad" in out


@pytest.mark.parametrize("nan", [0x7F, 0xFF], ids=["+nan", "-nan"])
def test_e4m3fn_nan_code_is_reported_with_its_group(tmp_path: Path, capsys, nan: int) -> None:
    blob = _with_code(_clean(), token=10, head=1, dim=3, code=nan)
    parse(blob)  # CRC-valid and consistent: only V's values are wrong
    code, out = _verify(tmp_path, blob, capsys)
    assert code == 1 and "0 ok, 1 bad" in out
    assert "NaN" in out and "token 10, head 1" in out and "page 1, head 1" in out, out


def test_per_layer_head_names_the_head(tmp_path: Path, capsys) -> None:
    blob = _with_code(_clean(scope="per_layer_head"), token=30, head=0, dim=15, code=0x7F)
    code, out = _verify(tmp_path, blob, capsys)
    assert code == 1 and "token 30, head 0" in out and "scale group head 0" in out, out


@pytest.mark.parametrize("bad", [0x7C, 0xFC, 0x7E], ids=["+inf", "-inf", "nan"])
def test_e5m2_inf_and_nan_codes(bad: int) -> None:
    blob = _with_code(_clean(torch.float8_e5m2), token=0, head=0, dim=0, code=bad)
    p = parse(blob)
    with pytest.raises(CorruptEncodedKVError) as ei:
        check_v_codes(p.header, p.v)
    assert ei.value.reason is Reason.BAD_CODE and "token 0, head 0" in str(ei.value)


def test_every_finite_code_passes() -> None:
    p = parse(_clean())
    codes = bytes(b for b in range(256) if b not in (0x7F, 0xFF))
    check_v_codes(p.header, (codes * (len(p.v) // len(codes) + 1))[: len(p.v)])


def test_a_scale_that_overflows_a_code_to_inf(tmp_path: Path, capsys) -> None:
    """Finite codes and a finite stored scale whose product is past float32: a load gives Inf."""
    p = parse(_clean(scope="per_tensor"))
    v = bytearray(p.v)
    v[0] = 0x7E  # e4m3fn 448, the largest code
    blob = assemble(p.header, p.k, v, struct.pack("<f", 3.0e38))
    code, out = _verify(tmp_path, blob, capsys)
    assert code == 1 and "overflows" in out and "token 0, head 0" in out, out
