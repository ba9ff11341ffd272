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
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import Reason, UnsupportedConfigError
from ..format import Hashes

__all__ = [
    "DTYPES",
    "MAX_CONFIG_BYTES",
    "MAX_SAFETENSORS_HEADER",
    "PICKLE_SUFFIXES",
    "LoadedModel",
    "ModelKVCache",
    "cache_root",
    "check_checkpoint",
    "checkpoint_dir",
    "convert_gguf",
    "forward",
    "load_model",
    "make_cache",
    "model_hashes",
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
    try:
        dest = root / f"{src.stem}-{_file_digest(src)}"
    except OSError as e:
        raise _refuse(src, src, e.strerror or str(e)) from None
    if (dest / "config.json").is_file():
        return dest
    tf = _transformers()
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError as e:
        raise UnsupportedConfigError(
            f"a .gguf model needs the gguf package ({e}); {_EXTRA_HINT}", reason=Reason.UNSUPPORTED
        ) from None
    root.mkdir(parents=True, exist_ok=True)
    print(f"kvcodec: converting {src.name} once into {dest} (dequantized to fp32)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=root))
    try:
        kw = {"gguf_file": src.name, "trust_remote_code": False}
        tok = tf.AutoTokenizer.from_pretrained(str(src.parent), **kw)
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(src.parent), dtype=torch.float32, quantization_config=tf.GgufConfig(dequantize=True), **kw
        )
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest)
    except Exception as e:  # gguf and transformers raise many types for a malformed file
        raise _refuse(src, src, f"{type(e).__name__}: {e}") from None
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


MAX_CONFIG_BYTES = 16 << 20
"""Largest ``config.json`` read (real ones are a few KiB)."""
MAX_SAFETENSORS_HEADER = 100 << 20
"""Largest safetensors JSON header read (the safetensors library's own limit)."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weight files in pickle form: never opened (unpickling runs whatever code the file names)."""


def _refuse(model: str | os.PathLike[str], what: Path | str, why: str) -> UnsupportedConfigError:
    """The documented refusal: which model, which file, why."""
    return UnsupportedConfigError(
        f"--model {os.fspath(model)!r} could not be loaded: {what}: {why}", reason=Reason.BAD_CHECKPOINT
    )


def _json_object(model: str | os.PathLike[str], path: Path, data: bytes) -> dict[str, Any]:
    """``data`` (read from ``path``) as a JSON object; anything else is refused."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise _refuse(model, path, f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _refuse(model, path, f"holds a JSON {type(obj).__name__}, expected an object")
    return obj


def _read_head(model: str | os.PathLike[str], path: Path, limit: int) -> tuple[bytes, int]:
    """Up to ``limit`` bytes from the start of ``path``, and the file's size."""
    try:
        with path.open("rb") as f:
            return f.read(limit), os.fstat(f.fileno()).st_size
    except OSError as e:
        raise _refuse(model, path, e.strerror or str(e)) from None


def _check_config(model: str | os.PathLike[str], path: Path) -> None:
    """Refuse a ``config.json`` that is too large or not a JSON object."""
    data, size = _read_head(model, path, MAX_CONFIG_BYTES + 1)
    if size > MAX_CONFIG_BYTES:
        raise _refuse(model, path, f"{size} bytes, more than the {MAX_CONFIG_BYTES} a config may hold")
    _json_object(model, path, data)


def _check_safetensors(model: str | os.PathLike[str], path: Path) -> None:
    """Refuse a safetensors file whose header length or JSON header does not fit the file."""
    head, size = _read_head(model, path, 8)
    if len(head) < 8:
        raise _refuse(model, path, f"{size} bytes, too short for a safetensors header")
    n = int.from_bytes(head, "little")
    if not 2 <= n <= min(size - 8, MAX_SAFETENSORS_HEADER):
        raise _refuse(
            model,
            path,
            f"safetensors header length {n} does not fit the file ({size} bytes) "
            f"or the limit of {MAX_SAFETENSORS_HEADER}",
        )
    data, _ = _read_head(model, path, 8 + n)
    _json_object(model, path, data[8:])


def _weight_files(model: str | os.PathLike[str], ckpt: Path) -> list[Path]:
    """The folder's safetensors weights; pickle weights are refused, never opened."""
    weights = sorted(p for p in ckpt.glob("*.safetensors") if p.is_file())
    if weights:
        return weights
    pickles = sorted(p.name for p in ckpt.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise _refuse(
            model,
            ckpt / pickles[0],
            "pickle weights are never loaded (unpickling can run code); "
            "kvcodec reads safetensors checkpoints or .gguf files only",
        )
    raise _refuse(model, ckpt, "no *.safetensors weights in the folder")


def check_checkpoint(model: str | os.PathLike[str], ckpt: Path) -> None:
    """Refuse (``Reason.BAD_CHECKPOINT``) a folder whose config or weights transformers would choke on."""
    _check_config(model, ckpt / "config.json")
    for path in _weight_files(model, ckpt):
        _check_safetensors(model, path)


def load_model(path: str | os.PathLike[str], dtype: str = "bf16") -> LoadedModel:
    """Load ``path`` (checkpoint folder or ``.gguf``) for CPU inference in ``dtype`` (bf16, fp16, fp32).

    Only safetensors weights are read (pickle files are refused unopened); any
    failure to load is an :class:`UnsupportedConfigError` with ``Reason.BAD_CHECKPOINT``
    naming the file (or folder) and why.
    """
    if dtype not in DTYPES:
        raise UnsupportedConfigError(
            f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}", reason=Reason.BAD_VALUE
        )
    tf = _transformers()
    ckpt = checkpoint_dir(path)
    check_checkpoint(path, ckpt)
    try:
        tok = tf.AutoTokenizer.from_pretrained(str(ckpt), trust_remote_code=False)
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(ckpt),
            dtype=DTYPES[dtype],
            attn_implementation="sdpa",
            use_safetensors=True,
            trust_remote_code=False,
        )
    except Exception as e:  # transformers and its loaders raise many types for a malformed folder
        raise _refuse(path, ckpt, f"{type(e).__name__}: {e}") from None
    model.eval()
    return LoadedModel(model, tok, Path(path).name, DTYPES[dtype])


def read_tokens(
    loaded: LoadedModel, path: str | os.PathLike[str], count: int, limit: int | None = None
) -> torch.Tensor:
    """The first ``limit`` (default ``count``) token ids of text file ``path``, ``[1, n]``.

    A text shorter than ``limit`` gives all its tokens; one shorter than ``count`` is refused.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < count:
        raise UnsupportedConfigError(
            f"{os.fspath(path)}: {ids.shape[1]} tokens, fewer than the {count} needed "
            "(shorten --prefix/--score/--tokens or pick a longer text)",
            reason=Reason.BAD_VALUE,
        )
    return ids[:, : max(count, limit or count)]


def model_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) of a transformers cache, as ``[tokens, kv_heads, head_dim]`` views."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = [(layer.keys, layer.values) for layer in layers]
    else:  # transformers < 4.56 keeps two lists
        pairs = list(zip(cache.key_cache, cache.value_cache))
    return [(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v in pairs]


def make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype | None = None) -> Any:
    """A new ``DynamicCache`` holding copies of ``kv`` (``[tokens, kv_heads, head_dim]`` per layer) in ``dtype``."""
    cache = _transformers().DynamicCache()
    for i, (k, v) in enumerate(kv):
        k4, v4 = (x.transpose(0, 1).unsqueeze(0).to(dtype=dtype, copy=True) for x in (k, v))
        cache.update(k4, v4, i)
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
def prefix_cache(
    loaded: LoadedModel, ids: torch.Tensor, kv_dtype: torch.dtype | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``ids`` (``[1, tokens]``) through the model; its KV per layer, stored in ``kv_dtype`` if given.

    A ``kv_dtype`` narrower than the model's is a cache that stores what an fp32 model computes in
    bf16 or fp16 (the model reads it back widened, see :func:`make_cache`).
    """
    out = forward(loaded, ids)
    return [
        (k.to(kv_dtype).contiguous(), v.to(kv_dtype).contiguous()) for k, v in model_kv(output_cache(out))
    ]


def _sha(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()


def model_hashes(loaded: LoadedModel) -> Hashes:
    """Identity hashes for blobs of ``loaded``'s KV: its name, config, vocabulary and RoPE settings."""
    cfg = loaded.model.config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", None)}
    vocab = json.dumps(sorted(loaded.tokenizer.get_vocab().items()))
    return Hashes(
        model_id=loaded.name,
        model_revision_hash=_sha(cfg.to_json_string(use_diff=False))[:40],
        tokenizer_hash="sha256:" + _sha(vocab),
        rope_config_hash="sha256:" + _sha(json.dumps(rope, sort_keys=True, default=str)),
        attention_backend="SDPA",
        kv_layout="NHD",
    )


class ModelKVCache:
    """A real model's KV cache over a text, served per (layer, chunk) like the demo's synthetic one.

    The forward pass runs in fp32 (fast on CPUs without bf16 units); the cache keeps K and V in
    ``dtype``, as a bf16 or fp16 KV cache would.
    """

    def __init__(
        self, kv: list[tuple[torch.Tensor, torch.Tensor]], chunk_tokens: int, hashes: Hashes
    ) -> None:
        self.kv, self.chunk_tokens, self.hashes = kv, chunk_tokens, hashes
        self.layers = len(kv)
        self.tokens, self.heads, self.head_dim = kv[0][0].shape
        self.dtype = kv[0][0].dtype
        self.chunks = -(-self.tokens // chunk_tokens)

    @classmethod
    def from_text(
        cls,
        model: str | os.PathLike[str],
        text: str | os.PathLike[str],
        *,
        tokens: int,
        chunk_tokens: int,
        dtype: torch.dtype,
    ) -> ModelKVCache:
        """Load ``model``, read up to ``tokens`` tokens of ``text`` through it and keep their KV."""
        loaded = load_model(model, "fp32")
        ids = read_tokens(loaded, text, 2, limit=tokens)
        return cls(prefix_cache(loaded, ids, dtype), chunk_tokens, model_hashes(loaded))

    def chunk_len(self, chunk: int) -> int:
        """Tokens in ``chunk`` (the last one may be partial)."""
        return min(self.chunk_tokens, self.tokens - chunk * self.chunk_tokens)

    def chunk(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer over one chunk, ``[tokens, kv_heads, head_dim]``."""
        k, v = self.kv[layer]
        lo = chunk * self.chunk_tokens
        hi = lo + self.chunk_len(chunk)
        return k[lo:hi].contiguous(), v[lo:hi].contiguous()
