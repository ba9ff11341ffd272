"""encode memoizes its plan per layout: a hit gives the blob a fresh plan gives and refuses what it refuses."""

from __future__ import annotations

import pytest
import torch

from kvcodec import UnsupportedConfigError, encode, parse


def _kv(t: int = 8, h: int = 2, d: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t * h * d)
    return torch.randn(t, h, d, generator=g).half(), torch.randn(t, h, d, generator=g).half()


def test_repeated_raw_encodes_stay_unit_scaled() -> None:
    k, v = _kv(16, 2, 8)
    first = encode(k, v, scope="raw")
    for _ in range(2):
        assert encode(k, v, scope="raw") == first  # a memoized plan may not drop the unit scale
    assert parse(first).header.scale_payload_len == 0


def test_cached_plans_follow_a_changed_identity_object() -> None:
    class Ids:
        model_revision_hash = tokenizer_hash = rope_config_hash = attention_backend = kv_layout = ""

        def __init__(self, model: str) -> None:
            self.model_id = model

    k, v = _kv(16, 2, 8)
    ids = Ids("model-A")
    assert parse(encode(k, v, hashes=ids, scope="per_tensor")).header.hashes.model_id == "model-A"
    ids.model_id = "model-B"
    assert parse(encode(k, v, hashes=ids, scope="per_tensor")).header.hashes.model_id == "model-B"


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [("version", 1, 1.0), ("version", 1, True), ("page_size", 1, True), ("chunk_size", 16, 16.0)],
)
def test_cached_plans_refuse_what_a_fresh_plan_refuses(name: str, good: object, bad: object) -> None:
    k, v = _kv(16, 2, 8)
    encode(k, v, scope="per_page_head" if name == "page_size" else "per_tensor", **{name: good})
    with pytest.raises(UnsupportedConfigError):
        encode(k, v, scope="per_page_head" if name == "page_size" else "per_tensor", **{name: bad})
