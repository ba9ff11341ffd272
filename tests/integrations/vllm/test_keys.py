"""Connector config, identity and prefix hashes (no vLLM needed), and the lazy vLLM import."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcodec import UnsupportedConfigError
from kvcodec.integrations.vllm.config import KvcodecConfig
from kvcodec.integrations.vllm.identity import CacheGeometry, cache_geometry, identity, layer_ids
from kvcodec.integrations.vllm.keys import prefix_hashes, request_seed


def test_import_kvcodec_never_imports_vllm():
    code = (
        "import sys, kvcodec, kvcodec.integrations.vllm as m, kvcodec.integrations.vllm.layout, "
        "kvcodec.integrations.vllm.chunks, kvcodec.integrations.vllm.keys, kvcodec.integrations.vllm.scheduler\n"
        "assert 'vllm' not in sys.modules, sorted(k for k in sys.modules if k.startswith('vllm'))\n"
        "assert m.__all__ == ['KvcodecConnector', 'register']\n"
        "print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_unknown_attribute_is_an_attribute_error():
    import kvcodec.integrations.vllm as m

    with pytest.raises(AttributeError):
        _ = m.NoSuchThing


@given(st.lists(st.integers(0, 2**31 - 1), max_size=40), st.integers(1, 9))
def test_prefix_hashes_cover_every_token_up_to_each_chunk(tokens, cs):
    hs = prefix_hashes(tokens, cs)
    assert len(hs) == len(tokens) // cs
    assert hs == prefix_hashes(tokens[: len(hs) * cs], cs)  # a partial tail changes nothing
    for c in range(len(hs)):
        changed = list(tokens)
        changed[c * cs] += 1  # a token in chunk c changes chunk c and every later hash, not earlier ones
        hs2 = prefix_hashes(changed, cs)
        assert hs2[:c] == hs[:c] and all(a != b for a, b in zip(hs2[c:], hs[c:]))
    assert len(set(hs)) == len(hs)
    if hs:
        assert prefix_hashes(tokens, cs, "lora") != hs


def test_request_seed_names_lora_multimodal_and_salt():
    plain = SimpleNamespace(lora_request=None, mm_features=[], cache_salt=None)
    assert request_seed(plain) == ""
    lora = SimpleNamespace(lora_request=SimpleNamespace(lora_name="a"), mm_features=[], cache_salt=None)
    salted = SimpleNamespace(lora_request=None, mm_features=[], cache_salt="s")
    mm = SimpleNamespace(lora_request=None, mm_features=[SimpleNamespace(identifier="img1")], cache_salt=None)
    assert len({request_seed(x) for x in (lora, salted, mm)}) == 3


def test_layer_ids():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0)]
    assert layer_ids(names) == {names[0]: 10, names[1]: 2, names[2]: 0}
    assert layer_ids(["b.attn", "a.attn"]) == {"a.attn": 0, "b.attn": 1}


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (None, "root"),
        ({"root": ""}, "root"),
        ({"root": "/x", "chunk_sise": 3}, "unknown kv_connector_extra_config keys"),
        ({"root": "/x", "chunk_size": 0}, "chunk_size"),
        ({"root": "/x", "page_size": True}, "page_size"),
        # review B10: every key is checked when the connector starts, not per chunk
        ({"root": 5}, "root"),
        ({"root": "/x", "scope": "bogus"}, "scope"),
        ({"root": "/x", "scope": "external"}, "scope"),
        ({"root": "/x", "scope": "raw"}, "scope"),
        ({"root": "/x", "scope": 3}, "scope"),
        ({"root": "/x", "scope": None}, "scope"),
        ({"root": "/x", "fsync": "no"}, "fsync"),
        ({"root": "/x", "fsync": 1}, "fsync"),
        ({"root": "/x", "model_id": 5}, "model_id"),
        ({"root": "/x", "max_bytes": "10G"}, "max_bytes"),
        ({"root": "/x", "max_bytes": 1.5}, "max_bytes"),
        ({"root": "/x", "max_bytes": False}, "max_bytes"),
        ({"root": "/x", "max_bytes": -1}, "max_bytes"),
        ({"root": "/x", "chunk_size": 2.0}, "chunk_size"),
        ({"root": "/x", "page_size": -16}, "page_size"),
        ({"root": "/x", "Scope": "per_tensor"}, "unknown kv_connector_extra_config keys"),
        ("root=/x", "kv_connector_extra_config"),
    ],
)
def test_config_refusals(extra, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        KvcodecConfig.from_extra(extra)


@pytest.mark.parametrize(
    ("scope", "canonical"),
    [
        ("per_tensor", "per_tensor"),
        ("PER_LAYER_HEAD", "per_layer_head"),
        ("per_page_head", "per_page_head"),
        (0, "per_tensor"),
        (2, "per_page_head"),
    ],
)
def test_config_accepts_the_computed_scopes(scope, canonical):
    cfg = KvcodecConfig.from_extra(
        {"root": "/x", "scope": scope, "fsync": True, "model_id": "m", "max_bytes": 10}
    )
    assert (cfg.scope, cfg.fsync, cfg.model_id, cfg.max_bytes) == (canonical, True, "m", 10)


def test_config_defaults_are_valid():
    cfg = KvcodecConfig.from_extra({"root": "/x"})
    assert (cfg.scope, cfg.fsync, cfg.model_id, cfg.max_bytes) == ("per_page_head", False, None, None)


def test_scheduler_side_never_imports_vllm_or_torch():
    """The scheduler side (its config, keys and metadata) runs in any venv, without torch: the
    connector's vLLM imports stay in connector.py, torch in the worker side."""
    code = (
        "import sys, kvcodec.integrations.vllm.scheduler, kvcodec.integrations.vllm.identity\n"
        "assert not any(m.startswith(('vllm', 'torch')) for m in sys.modules), sorted(sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_bad_config_fails_when_the_connector_is_built(tmp_path):
    """The engine fails at start: KvcodecConnector's constructor raises, before any chunk is saved."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vLLM")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcodec.integrations.vllm.connector import KvcodecConnector

    for extra in ({"root": str(tmp_path), "scope": "bogus"}, {"root": str(tmp_path), "fsync": "no"}):
        ktc = KVTransferConfig(
            kv_connector="KvcodecConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
        vcfg = SimpleNamespace(kv_transfer_config=ktc)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(UnsupportedConfigError):
                KvcodecConnector(vcfg, role, _kv_config(_spec()))


def _vllm_config(model="m", revision=None, cache_dtype="auto", rope_theta=10000.0):
    hf = SimpleNamespace(to_dict=lambda: {"rope_theta": rope_theta})
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=revision, dtype=torch.bfloat16, hf_config=hf),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )


def _kv_config(spec):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])


def _spec(**kw):
    base = {"num_kv_heads": 2, "head_size": 64, "head_size_v": 64, "dtype": torch.bfloat16, "block_size": 32}
    return SimpleNamespace(**{**base, **kw})


def test_identity_separates_models_geometry_and_ranks():
    cfg = KvcodecConfig.from_extra({"root": "/x"})
    geo = cache_geometry(_kv_config(_spec()), _vllm_config())
    assert geo == CacheGeometry(2, 64, 64, 32, torch.bfloat16, False)
    base = identity(_vllm_config(), cfg, geo, (0, geo.num_kv_heads), geo.num_kv_heads)
    assert base["model_id"] == "m"
    others = [
        identity(_vllm_config(model="n"), cfg, geo, (0, geo.num_kv_heads), geo.num_kv_heads),
        identity(_vllm_config(revision="r2"), cfg, geo, (0, geo.num_kv_heads), geo.num_kv_heads),
        identity(_vllm_config(rope_theta=5e5), cfg, geo, (0, geo.num_kv_heads), geo.num_kv_heads),
        identity(_vllm_config(), cfg, CacheGeometry(2, 64, 32, 32, torch.bfloat16, False), (0, 2), 2),
        identity(_vllm_config(), cfg, geo, (1, 2), 2),  # another head range
        identity(
            _vllm_config(), KvcodecConfig.from_extra({"root": "/x", "model_id": "named"}), geo, (0, 2), 2
        ),
    ]
    assert all(o != base for o in others) and len({str(sorted(o.items())) for o in others}) == len(others)
    # The block size is not part of it: token-major blobs serve any block size.
    assert (
        identity(
            _vllm_config(), cfg, cache_geometry(_kv_config(_spec(block_size=64)), _vllm_config()), (0, 2), 2
        )
        == base
    )


@pytest.mark.parametrize(
    ("kv_config", "cache_dtype", "match"),
    [
        (SimpleNamespace(kv_cache_groups=[]), "auto", "KV cache groups"),
        (None, "auto", "KV cache groups"),
        (_kv_config(_spec(state_content_bytes=12)), "auto", "sliding-window K/V attention"),
        (_kv_config(SimpleNamespace(block_size=16)), "auto", "sliding-window K/V attention"),
        (_kv_config(_spec()), "int8_per_token_head", "not served"),
    ],
)
def test_cache_geometry_refusals(kv_config, cache_dtype, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        cache_geometry(kv_config, _vllm_config(cache_dtype=cache_dtype))


def test_register_makes_the_name_alone_enough():
    """What a ``vllm.general_plugins`` entry point calling ``register`` gives: no module path needed."""
    factory = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory", reason="needs vLLM")
    from vllm.config import KVTransferConfig

    from kvcodec.integrations.vllm import KvcodecConnector, register

    register()
    register()  # idempotent: plugins load in every process
    cfg = KVTransferConfig(kv_connector="KvcodecConnector", kv_role="kv_both")
    assert factory.KVConnectorFactory.get_connector_class(cfg) is KvcodecConnector


def _groups(*specs):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=[]) for s in specs])


def test_hybrid_groups_refused():
    """vLLM's own specs: full + sliding window is served (each group's window kept); a Mamba state
    group beside attention makes the connector passive (its names in ``state``); chunked local
    attention, groups of two geometries and a model of state groups alone are refused, by reason."""
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface", reason="needs vLLM")
    from kvcodec.errors import Reason

    common = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    full, window = kvi.FullAttentionSpec(**common), kvi.SlidingWindowSpec(**common, sliding_window=512)
    geo = cache_geometry(_groups(full, window), _vllm_config())
    assert geo.windows == (None, 512) and geo.num_kv_heads == 2 and geo.state == ()
    mamba = kvi.MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    assert cache_geometry(_groups(full, mamba), _vllm_config()).state == ("MambaSpec",)
    chunked = kvi.ChunkedLocalAttentionSpec(**common, attention_chunk_size=256)
    for groups in (_groups(full, chunked), _groups(mamba)):
        with pytest.raises(UnsupportedConfigError) as e:
            cache_geometry(groups, _vllm_config())
        assert e.value.reason == Reason.UNSUPPORTED
    wider = kvi.SlidingWindowSpec(**{**common, "head_size": 128}, sliding_window=512)
    with pytest.raises(UnsupportedConfigError, match="one geometry"):
        cache_geometry(_groups(full, wider), _vllm_config())
