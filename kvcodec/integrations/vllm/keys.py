"""What names a chunk: the chained prefix hash of its tokens, seeded by what else changes its KV.

Pure Python (no torch, no vLLM): the scheduler side hashes every prompt with it. The key strings
built from these hashes are :mod:`.chunk_keys`'s.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

from .identity import short_hash

__all__ = ["prefix_hashes", "request_seed"]

_HASH_DOMAIN = b"kvcodec.vllm.prefix.v1\x00"


def prefix_hashes(tokens: Sequence[int], chunk_size: int, seed: str = "") -> list[str]:
    """One hash per full chunk, each over every token id up to that chunk's end (chained)."""
    h = hashlib.sha256(_HASH_DOMAIN + seed.encode()).digest()
    out = []
    for end in range(chunk_size, len(tokens) + 1, chunk_size):
        chunk = tokens[end - chunk_size : end]
        h = hashlib.sha256(h + struct.pack(f"<{len(chunk)}q", *chunk)).digest()
        out.append(h.hex()[:32])
    return out


def request_seed(request: Any) -> str:
    """What, besides token ids, changes a request's KV: LoRA, multimodal inputs, cache salt."""
    lora = getattr(request, "lora_request", None)
    mm = [getattr(f, "identifier", str(f)) for f in (getattr(request, "mm_features", None) or [])]
    salt = getattr(request, "cache_salt", None)
    if lora is None and not mm and not salt:
        return ""
    return short_hash([getattr(lora, "lora_name", None), mm, salt])
