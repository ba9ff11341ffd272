"""Lossless blobs (issue 38) never pass for LMCache records: kvcodec's compat layer refuses their
scheme with LMCache's phrase, and LMCache's own blobs (version 1) have no lossless form."""

from __future__ import annotations

import pytest
import torch

import kvcodec
import kvcodec.integrations.lmcache.compat as compat
from kvcodec import errors
from kvcodec.errors import Reason
from tests.raises import raises_reason


@pytest.mark.parametrize("scope", ["per_tensor", "raw"])
def test_compat_refuses_a_lossless_blob_as_an_unknown_scheme(scope) -> None:
    k, v = torch.randn(8, 2, 4).half(), torch.randn(8, 2, 4).half()
    blob = kvcodec.encode(k, v, scope=scope, compression="lossless")
    with raises_reason(errors.CorruptEncodedKVError, Reason.UNKNOWN_SCHEME) as got:
        compat.deserialize_header(bytes(blob))
    assert "unknown scale_scheme" in str(got.value)


def test_version_1_has_no_lossless_form() -> None:
    k, v = torch.randn(8, 2, 4).half(), torch.randn(8, 2, 4).half()
    with raises_reason(errors.UnsupportedConfigError, Reason.BAD_VALUE):
        kvcodec.encode(k, v, scope="per_tensor", version=1, compression="lossless")
