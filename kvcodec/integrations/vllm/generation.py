"""The cache generation: which blobs of one model identity the engine may load, kept in the store.

``reset_cache()`` (vLLM calls it through ``reset_prefix_cache(reset_connector=True)``, e.g. after an
in-place weight update) starts a new generation: a random id that seeds every chunk's prefix hash
(:func:`~.keys.prefix_hashes`), so every key and every blob header (its ``kv_layout`` carries the
chunk hash, checked on load) differ from the blobs written before. Those can no longer be named,
let alone loaded; they age out of the store (nothing hits them).

The generation lives in the store, so a restart with the same weights, and every engine sharing the
store, uses it: two payload-free LMCKV blobs (``kvcodec verify`` reads them as blobs)

* the pointer ``<model16>-G``, holding the current generation id (its ``kv_layout`` hash);
* the marker ``<model16>-G<id>`` (absent for the first generation, ``""``, which has no pointer).

Every lookup asks, in its one ``contains_many``, for one more key: at generation ``""`` the pointer
(must be absent), at generation ``g`` its marker (must be present). When the answer is wrong
(another engine reset; the pointer or marker was evicted) that lookup misses and the pointer is read
again: an engine never loads a generation the store no longer names. A pointer that is gone while
the engine is past ``""`` starts a fresh generation (never back to ``""``). A reset writes the new
marker, then the pointer, then deletes the old marker. Pure Python (no torch, no vLLM).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Protocol

from kvcodec.errors import CodecError
from kvcodec.format import Hashes, Header, ScaleScope, assemble, parse

__all__ = ["GENERATION_LAYOUT", "GenerationStore", "Generations"]

logger = logging.getLogger("vllm.kvcodec")

GENERATION_LAYOUT = "kvcodec-generation;id="
"""What a generation record's ``kv_layout`` starts with; the id follows."""


class GenerationStore(Protocol):
    """What the generation needs of a store."""

    def get(self, key: str) -> Any: ...

    def put(self, key: str, blob: Any) -> None: ...

    def delete(self, key: str) -> bool: ...


class Generations:
    """The current generation of one model identity (``hashes``, whose keys start ``model16``) in one
    store; reads the store's pointer now."""

    def __init__(self, store: GenerationStore, model16: str, hashes: dict[str, str]) -> None:
        self.store, self.model16, self.hashes = store, model16, dict(hashes)
        self.current = ""
        self.refresh()

    @property
    def pointer(self) -> str:
        return f"{self.model16}-G"

    def marker(self, gen: str) -> str:
        return f"{self.model16}-G{gen}"

    @property
    def check_key(self) -> str:
        """The key every lookup also asks for: the pointer (gen ``""``) or the current marker."""
        return self.pointer if not self.current else self.marker(self.current)

    def seed(self, request_seed: str) -> str:
        """The prefix-hash seed of a request in this generation (``request_seed`` alone at ``""``)."""
        return request_seed if not self.current else f"{request_seed}|gen={self.current}"

    def confirmed(self, found: bool) -> bool:
        """Whether a lookup's answer for :attr:`check_key` confirms the generation; if not, re-read it."""
        ok = found if self.current else not found
        if not ok:
            self.refresh()
        return ok

    def refresh(self) -> None:
        """Adopt the store's pointer; with none, keep ``""`` at ``""`` and start afresh past it."""
        try:
            gen = self._read_pointer()
        except (CodecError, OSError) as e:  # unreachable or damaged: keep ours; the next lookup asks again
            logger.warning("kvcodec: cannot read the cache generation (%s: %s)", type(e).__name__, e)
            return
        if gen is None and self.current:
            logger.warning("kvcodec: the cache generation record is gone; starting a new generation")
            self.reset()
        elif gen is not None and gen != self.current:
            logger.info("kvcodec: cache generation %s (was %s)", gen, self.current or "initial")
            self.current = gen

    def _read_pointer(self) -> str | None:
        try:
            blob = self.store.get(self.pointer)
        except KeyError:
            return None
        layout = parse(blob).header.hashes.kv_layout
        if not layout.startswith(GENERATION_LAYOUT):
            return None
        return layout.removeprefix(GENERATION_LAYOUT) or None

    def reset(self) -> bool:
        """Start a new generation: this engine uses it at once; True once the store names it."""
        old, self.current = self.current, secrets.token_hex(8)
        record = self.record(self.current)
        try:
            self.store.put(self.marker(self.current), record)
            self.store.put(self.pointer, record)
            if old:
                self.store.delete(self.marker(old))
        except (CodecError, OSError) as e:
            logger.warning(
                "kvcodec: cache generation %s not stored (%s: %s): this engine loads no older blob, "
                "a restart or another engine may",
                self.current,
                type(e).__name__,
                e,
            )
            return False
        logger.info("kvcodec: cache reset: generation %s (was %s)", self.current, old or "initial")
        return True

    def record(self, gen: str) -> bytearray:
        """A payload-free LMCKV v2 blob naming generation ``gen`` of this model."""
        header = Header(
            k_dtype="bfloat16",
            v_dtype="float8_e4m3fn",
            scale_scope=ScaleScope.EXTERNAL,
            version=2,
            hashes=Hashes.coerce({**self.hashes, "kv_layout": GENERATION_LAYOUT + gen}),
        )
        return assemble(header)
