"""A real causal LM's KV cache, for ``kvcodec quality --model`` and ``kvcodec demo --model``.

Needs the ``quality`` extra (transformers; gguf for ``.gguf`` files). A model is
a Hugging Face checkpoint folder or a ``.gguf`` file; a GGUF file is converted
once (weights dequantized to fp32, saved as a plain checkpoint with its
tokenizer) into the user cache folder, keyed by the file's content hash, so
later runs load a plain checkpoint in seconds.

K and V are read from (and written back into) transformers' ``DynamicCache``,
one ``[tokens, kv_heads, head_dim]`` tensor each per layer: the same layout a
paged engine hands to kvcodec, post-RoPE K included.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import Reason, UnsupportedConfigError

__all__ = [
    "DTYPES",
    "LoadedModel",
    "cache_root",
    "checkpoint_dir",
    "convert_gguf",
    "forward",
    "load_model",
    "make_cache",
    "model_kv",
    "output_cache",
    "prefix_cache",
    "quiet_transformers",
    "read_tokens",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_EXTRA_HINT = "install the quality extra: pip install 'kvcodec[quality]'"


def _transformers() -> Any:
    """The transformers module, or a clear refusal naming the extra."""
    try:
        import transformers
    except ImportError as e:
        raise UnsupportedConfigError(
            f"--model needs transformers ({e}); {_EXTRA_HINT}", reason=Reason.UNSUPPORTED
        ) from None
    return transformers


def quiet_transformers() -> None:
    """Silence transformers' info lines and load bars (for the command line; warnings stay)."""
    tf = _transformers()
    tf.logging.set_verbosity_warning()
    tf.utils.logging.disable_progress_bar()


def cache_root() -> Path:
    """kvcodec's user cache folder: ``$KVCODEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvcodec``, else ``~/.cache/kvcodec``."""
    env = os.environ.get("KVCODEC_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvcodec"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def convert_gguf(path: str | os.PathLike[str], dest_root: Path | None = None) -> Path:
    """The plain checkpoint folder for GGUF file ``path``, converting it on first use.

    The folder is ``<cache>/models/<stem>-<sha256[:16]>``; a half-written one
    is never used (it is built under a temp name and renamed when complete).
    """
    src = Path(path)
    root = (dest_root or cache_root()) / "models"
    dest = root / f"{src.stem}-{_file_digest(src)}"
    if (dest / "config.json").is_file():
        return dest
    tf = _transformers()
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError as e:
        raise UnsupportedConfigError(f"a .gguf model needs the gguf package ({e}); {_EXTRA_HINT}") from None
    root.mkdir(parents=True, exist_ok=True)
    print(f"kvcodec: converting {src.name} once into {dest} (dequantized to fp32)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=root))
    try:
        kw = {"gguf_file": src.name}
        tok = tf.AutoTokenizer.from_pretrained(str(src.parent), **kw)
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(src.parent), dtype=torch.float32, quantization_config=tf.GgufConfig(dequantize=True), **kw
        )
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """A checkpoint folder for ``path``: the folder itself, or a ``.gguf`` file's converted copy."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return convert_gguf(p)
    if p.is_dir() and (p / "config.json").is_file():
        return p
    raise UnsupportedConfigError(
        f"--model {os.fspath(path)!r} is neither a checkpoint folder (with config.json) nor a .gguf file",
        reason=Reason.BAD_VALUE,
    )


@dataclass
class LoadedModel:
    """A causal LM in eval mode, its tokenizer and where it came from."""

    model: Any
    tokenizer: Any
    name: str
    dtype: torch.dtype
    cache_kwarg: str | None = None
    """The keyword ``forward`` takes a cache by (found on first use)."""

    @property
    def layers(self) -> int:
        """Decoder layers (one K and one V per layer in the cache)."""
        return int(self.model.config.num_hidden_layers)


def load_model(path: str | os.PathLike[str], dtype: str = "bf16") -> LoadedModel:
    """Load ``path`` (checkpoint folder or ``.gguf``) for CPU inference in ``dtype`` (bf16, fp16, fp32)."""
    if dtype not in DTYPES:
        raise UnsupportedConfigError(f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
    tf = _transformers()
    ckpt = checkpoint_dir(path)
    try:
        tok = tf.AutoTokenizer.from_pretrained(str(ckpt))
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(ckpt), dtype=DTYPES[dtype], attn_implementation="sdpa"
        )
    except (OSError, ValueError, KeyError) as e:
        raise UnsupportedConfigError(f"--model {os.fspath(path)!r} could not be loaded: {e}") from None
    model.eval()
    return LoadedModel(model, tok, Path(path).name, DTYPES[dtype])


def read_tokens(loaded: LoadedModel, path: str | os.PathLike[str], count: int) -> torch.Tensor:
    """The first ``count`` token ids of text file ``path`` (``[1, count]``), refusing a shorter text."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < count:
        raise UnsupportedConfigError(
            f"{os.fspath(path)}: {ids.shape[1]} tokens, fewer than the {count} needed "
            "(shorten --prefix/--score or pick a longer text)",
            reason=Reason.BAD_VALUE,
        )
    return ids[:, :count]


def model_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) of a transformers cache, as ``[tokens, kv_heads, head_dim]`` views."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = [(layer.keys, layer.values) for layer in layers]
    else:  # transformers < 4.56 keeps two lists
        pairs = list(zip(cache.key_cache, cache.value_cache))
    return [(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v in pairs]


def make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A new ``DynamicCache`` holding copies of ``kv`` (``[tokens, kv_heads, head_dim]`` per layer)."""
    cache = _transformers().DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k.transpose(0, 1).unsqueeze(0).clone(), v.transpose(0, 1).unsqueeze(0).clone(), i)
    return cache


def forward(loaded: LoadedModel, ids: torch.Tensor, cache: Any = None) -> Any:
    """The model's output for ``ids`` after ``cache`` (a transformers cache, or None for a fresh one).

    transformers renamed ``past_key_values`` to ``cache`` (5.x); either is used, whichever ``forward`` takes.
    """
    if cache is None:
        return loaded.model(ids, use_cache=True)
    if loaded.cache_kwarg is None:
        params = inspect.signature(loaded.model.forward).parameters
        loaded.cache_kwarg = "cache" if "cache" in params else "past_key_values"
    return loaded.model(ids, use_cache=True, **{loaded.cache_kwarg: cache})


def output_cache(out: Any) -> Any:
    """The cache a forward pass returned (``cache`` or ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.inference_mode()
def prefix_cache(loaded: LoadedModel, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``ids`` (``[1, tokens]``) through the model and return its KV per layer."""
    out = forward(loaded, ids)
    return [(k.contiguous(), v.contiguous()) for k, v in model_kv(output_cache(out))]
