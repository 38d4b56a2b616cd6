"""The transformers engine adapter: fingerprint a model, checkpoint its DynamicCache, restore one, verified.

A user keeps their own objects: `restore` returns a `transformers.DynamicCache`
that `model(...)` and `model.generate(...)` continue from, and `checkpoint`
takes the `DynamicCache` the model filled. In between, KV crosses kvc's two
seams (`restore.destination`): a restore writes verified chunks straight into
one host buffer that becomes the cache's tensors (one copy from the blob; for
a GPU model the buffer is pinned and sent to the device asynchronously), and
a checkpoint reads the cache's tensors in place (a GPU cache is copied once to
pinned host memory).

Only caches kvc can represent exactly are accepted: every layer a full-
attention `DynamicLayer`, one sequence, K and V of one head dim, a float32,
float16 or bfloat16 model on one device. Anything else (sliding-window or
hybrid layers, quantized, static or offloaded caches, encoder-decoder models)
is refused by name with `UnsupportedModelError`.

This is the only module of the core that imports torch and transformers.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import blake3
import numpy as np
import torch
import transformers
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from catalog import AttentionLayout, Fingerprint
from catalog.base import CatalogAPI
from catalog.identity import DType, canonical_json, token_array
from catalog.models import Shard
from chunkstore import ChunkStore
from chunkstore.codecs import DEFAULT_CODEC
from restore.checkpoint import Checkpointer, CheckpointResult, write_behind_store
from restore.errors import InputError, UnsupportedModelError
from restore.restore import Restorer, RestoreResult

__all__ = ["GreedyRun", "HFAdapter", "greedy", "model_fingerprint", "save_random_model"]

log = logging.getLogger(__name__)

_DTYPES: dict[torch.dtype, DType] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
# Config fields that never change a K/V value: names, paths, versions, labels,
# token ids and output switches. Everything else is part of the fingerprint, so
# a field this list does not know costs at most a cache miss, never a wrong hit.
# (The model's dtype is in the execution variant as the KV dtype.)
_NOT_NUMERIC = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "id2label",
        "label2id",
        "problem_type",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "task_specific_params",
        "finetuning_task",
    }
)


# -- what kvc accepts ------------------------------------------------------------


def _text_config(model: PreTrainedModel) -> Any:
    return model.config.get_text_config(decoder=True)


def check_supported(model: PreTrainedModel) -> None:
    """Raise `UnsupportedModelError` naming what kvc cannot represent exactly in this model."""
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(
            f"expected a transformers PreTrainedModel, got {type(model).__name__}"
        )
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; kvc supports decoder-only models"
        )
    if model.dtype not in _DTYPES:
        raise UnsupportedModelError(
            f"{name} computes in {model.dtype}; kvc supports float32, float16 and bfloat16"
        )
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        raise UnsupportedModelError(
            f"{name} is dispatched over several devices ({sorted(map(str, devices))}); "
            "kvc supports a model on one device"
        )
    if model.device.type == "meta":
        raise UnsupportedModelError(f"{name} has weights on the meta device (not loaded)")
    layers = _full_attention_layers(DynamicCache(config=model.config), name)
    if len(layers) != _text_config(model).num_hidden_layers:
        raise UnsupportedModelError(
            f"{name} caches {len(layers)} layers for {_text_config(model).num_hidden_layers} "
            "hidden layers (shared or missing KV layers are not supported)"
        )


def check_cache(cache: object) -> list[DynamicLayer]:
    """The layers of a `DynamicCache` of full-attention layers, or `UnsupportedModelError` naming it."""
    if isinstance(cache, tuple | list):
        raise UnsupportedModelError(
            "legacy tuple caches are not supported: pass the DynamicCache the model returned"
        )
    if not isinstance(cache, DynamicCache):
        raise UnsupportedModelError(
            f"{type(cache).__name__} is not supported: kvc stores the exact KV of a DynamicCache "
            "(quantized, static, offloaded and encoder-decoder caches are refused)"
        )
    if getattr(cache, "offloading", False):
        raise UnsupportedModelError("an offloaded DynamicCache is not supported")
    return _full_attention_layers(cache)


def _full_attention_layers(cache: DynamicCache, owner: str = "the cache") -> list[DynamicLayer]:
    """The cache's layers, if every one is a full-attention `DynamicLayer` (transformers builds
    other kinds for sliding-window, chunked, linear-attention and hybrid layers)."""
    odd = {
        i: type(layer).__name__
        for i, layer in enumerate(cache.layers)
        if type(layer) is not DynamicLayer
    }
    if odd:
        listed = ", ".join(f"{i}: {k}" for i, k in list(odd.items())[:6])
        raise UnsupportedModelError(
            f"{owner} has layers that are not full attention ({listed}"
            f"{', ...' if len(odd) > 6 else ''}): sliding-window, chunked, linear or hybrid "
            "layers keep a KV that kvc cannot restore exactly"
        )
    return cast(list[DynamicLayer], cache.layers)


# -- identity ----------------------------------------------------------------------


def model_layout(model: PreTrainedModel) -> AttentionLayout:
    """The K/V a token occupies in this model, from its config and dtype."""
    cfg = _text_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttentionLayout(cfg.num_hidden_layers, kv_heads, head_dim, _DTYPES[model.dtype])


def weights_digest(model: PreTrainedModel) -> str:
    """blake3 over the state dict: every tensor's name, dtype, shape and bytes, in name order."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(canonical_json([name, str(t.dtype), list(t.shape)]))
        flat = t.to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy())
    return h.hexdigest()


def execution_variant(model: PreTrainedModel) -> str:
    """Everything about how the model runs that can change its K/V numbers."""
    device = model.device
    parts: dict[str, object] = {
        "engine": "transformers",
        "attn": getattr(model.config, "_attn_implementation", None) or "default",
        "kv": _DTYPES[model.dtype],
        "device": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        parts["gpu"] = f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
        parts["tf32"] = torch.backends.cuda.matmul.allow_tf32
    elif device.type == "cpu":
        parts["cpu"] = torch.backends.cpu.get_cpu_capability()
    return ";".join(f"{k}={v}" for k, v in sorted(parts.items()))


def model_fingerprint(model: PreTrainedModel, *, weights_id: str | None = None) -> Fingerprint:
    """The fingerprint of a loaded transformers model (see docs/engines.md).

    `weights_id` replaces the weights digest with an immutable revision id the
    caller vouches for (a hub commit hash, a release tag that is never moved).
    """
    check_supported(model)
    config = _text_config(model).to_dict()
    config = {k: v for k, v in config.items() if k not in _NOT_NUMERIC}
    if weights_id is not None:
        if not isinstance(weights_id, str) or not weights_id.strip():
            raise InputError("weights_id must be a non-empty string (an immutable revision id)")
        weights = f"revision:{weights_id}"
    else:
        weights = f"blake3:{weights_digest(model)}"
    return Fingerprint.create(
        weights=weights,
        architecture=type(model).__name__,
        config=_json_safe(config),
        attention_layout=model_layout(model),
        execution_variant=execution_variant(model),
    )


def _json_safe(value: Any) -> Any:
    """Config values as JSON data (dtypes and other objects by their string)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


# -- token ids -----------------------------------------------------------------------


def token_ids(ids: object, what: str = "input_ids") -> np.ndarray[Any, np.dtype[np.uint32]]:
    """A list of ints, a 1-D tensor or a `[1, T]` tensor as validated uint32 token ids."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise InputError(
                    f"{what} is a batch of {ids.shape[0]} rows; kvc checkpoints and restores "
                    "one sequence per call"
                )
            ids = ids[0]
        if ids.dim() != 1:
            raise InputError(f"{what} must be 1-D or [1, T], got shape {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.is_complex():
            raise InputError(f"{what} must hold integer token ids, got {ids.dtype}")
        ids = ids.detach().to("cpu").numpy()
    try:
        return token_array(ids)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InputError(f"{what}: {exc}") from exc


# -- the seams over torch tensors -----------------------------------------------------------


def _numpy(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of a CPU tensor (bfloat16 as its uint16 bit patterns): no copy."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class _CacheSnapshot:
    """A `KVSnapshot` of a DynamicCache's slab: positions `[0, length)` of its layers and heads.

    CPU tensors are read in place. transformers' DynamicLayer never writes into
    its tensors (appending concatenates into new ones), so holding references
    freezes them while decoding goes on. A GPU cache is copied once into pinned
    host memory.
    """

    def __init__(
        self, cache_layers: list[DynamicLayer], layout: AttentionLayout, shard: Shard, length: int
    ) -> None:
        self._layout = layout
        self._length = length
        layers = cache_layers[shard.layer_lo : shard.layer_hi]
        if len(layers) != layout.num_layers:
            raise InputError(
                f"the cache has {len(cache_layers)} layers; this worker's shard is {shard}"
            )
        want = (1, layout.num_kv_heads, layout.head_dim)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(layers):
            if not layer.is_initialized or layer.keys is None or layer.values is None:
                raise InputError(f"cache layer {shard.layer_lo + i} holds no KV")
            k, v = layer.keys.detach(), layer.values.detach()
            for name, t in (("keys", k), ("values", v)):
                got = (t.shape[0], t.shape[1], t.shape[3]) if t.dim() == 4 else tuple(t.shape)
                if t.dim() != 4 or got != want:
                    raise UnsupportedModelError(
                        f"cache layer {shard.layer_lo + i} {name} are shaped {tuple(t.shape)}, "
                        f"expected [1, {layout.num_kv_heads}, T, {layout.head_dim}] "
                        "(one sequence; K and V of one head dim)"
                    )
                if t.shape[2] < length:
                    raise InputError(
                        f"cache layer {shard.layer_lo + i} holds {t.shape[2]} positions, "
                        f"fewer than the {length} to store"
                    )
                if t.dtype != _torch_dtype(layout.dtype):
                    raise UnsupportedModelError(
                        f"cache layer {shard.layer_lo + i} {name} are {t.dtype}, "
                        f"the model's KV dtype is {layout.dtype}"
                    )
            pairs.append((k[0, :, :length], v[0, :, :length]))
        if pairs and pairs[0][0].device.type != "cpu":
            pairs = _to_pinned_host(pairs)
        self._kv = [(_numpy(k), _numpy(v)) for k, v in pairs]

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def length(self) -> int:
        return self._length

    def read_kv(self, start: int, end: int) -> np.ndarray[Any, Any]:
        lay = self._layout
        out = np.empty(
            (lay.num_layers, 2, end - start, lay.num_kv_heads, lay.head_dim), dtype=lay.numpy_dtype
        )
        for i, (k, v) in enumerate(self._kv):
            out[i, 0] = k[:, start:end].transpose(1, 0, 2)
            out[i, 1] = v[:, start:end].transpose(1, 0, 2)
        return out


def _to_pinned_host(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy device tensors into one pinned host buffer (asynchronously, then one synchronize)."""
    k0 = pairs[0][0]
    host = torch.empty((len(pairs), 2, *k0.shape), dtype=k0.dtype, pin_memory=True)
    for i, (k, v) in enumerate(pairs):
        host[i, 0].copy_(k, non_blocking=True)
        host[i, 1].copy_(v, non_blocking=True)
    torch.cuda.synchronize(k0.device)
    return [(host[i, 0], host[i, 1]) for i in range(len(pairs))]


_HUGE_PAGE = 2 << 20


def _fresh_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory the kernel backs with huge pages where it
    can: the restore's one copy writes into never-touched memory, and faulting it in by 4 KiB
    pages runs at about a third of the speed (measured: 2.1 vs 6.6 GB/s here)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping; it is unmapped when the last view is gone.
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def _torch_dtype(dtype: str) -> torch.dtype:
    return next(t for t, name in _DTYPES.items() if name == dtype)


class _CacheDestination:
    """A `Destination` that becomes a DynamicCache: verified chunks land in one host buffer
    laid out like the blob payload, `[L, 2, T, H, D]` (pinned for a GPU model), so each
    chunk is one plain copy; the layers' tensors are `[1, H, T, D]` views of it (strided:
    transformers' first append concatenates them into new tensors anyway)."""

    def __init__(self, model: PreTrainedModel, layout: AttentionLayout, shard: Shard) -> None:
        self._model = model
        self._layout = layout
        self._shard = shard
        self._host: torch.Tensor | None = None
        self._view: np.ndarray[Any, Any] | None = None
        self.cache: DynamicCache | None = None

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    def reserve(self, tokens: int) -> None:
        lay = self._layout
        shape = (lay.num_layers, 2, tokens, lay.num_kv_heads, lay.head_dim)
        dtype = _torch_dtype(lay.dtype)
        if self._model.device.type == "cuda":
            self._host = torch.empty(shape, dtype=dtype, pin_memory=True)
        else:
            self._host = _fresh_host_tensor(shape, dtype)
        self._view = _numpy(self._host)

    def write(self, kv: np.ndarray[Any, Any], start: int, count: int) -> None:
        assert self._view is not None
        self._view[:, :, start : start + count] = kv[:, :, :count]  # the one copy from the blob

    def commit(self, tokens: int) -> None:
        host = self._host
        assert host is not None
        self._host = self._view = None
        device = self._model.device
        kv = host if device.type == "cpu" else host.to(device, non_blocking=True)
        cache = DynamicCache(config=self._model.config)
        layers = _full_attention_layers(cache)
        for i in range(self._layout.num_layers):
            layer = layers[self._shard.layer_lo + i]
            k = kv[i, 0, :tokens].transpose(0, 1).unsqueeze(0)
            v = kv[i, 1, :tokens].transpose(0, 1).unsqueeze(0)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        self.cache = cache

    def abort(self) -> None:
        self._host = self._view = None


# -- the adapter ------------------------------------------------------------------------------


class HFAdapter:
    """kvc for one loaded transformers model: `restore` a verified DynamicCache, `checkpoint` one.

    `stores[0]` receives every new blob synchronously; the first object store
    after it (S3) gets a write-behind copy, catalogued after its receipt. All
    `stores` are read on restore. A worker that owns a slab of the model passes
    `shard` (layers and kv heads of the fingerprint's layout): it publishes and
    restores only those layers, and its cache holds only those kv heads.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        catalog: CatalogAPI,
        stores: Sequence[ChunkStore],
        namespace: str = "default",
        chunk_size: int = 256,
        *,
        weights_id: str | None = None,
        shard: Shard | None = None,
        codec: str = DEFAULT_CODEC,
        max_parallel: int = 4,
        byte_budget: int = 256 << 20,
        actor: str | None = None,
    ) -> None:
        if not stores:
            raise InputError("HFAdapter needs at least one store to write to")
        self.model = model
        t0 = time.perf_counter()
        self.fingerprint = model_fingerprint(model, weights_id=weights_id)
        self.fingerprint_seconds = time.perf_counter() - t0
        log.info(
            "fingerprint %s of %s in %.2f s",
            self.fingerprint.hex[:12],
            type(model).__name__,
            self.fingerprint_seconds,
        )
        full = self.fingerprint.layout
        self.shard = shard or Shard.full(full)
        self.shard.check_within(full)
        self.layout = AttentionLayout(
            self.shard.layer_hi - self.shard.layer_lo,
            self.shard.head_hi - self.shard.head_lo,
            full.head_dim,
            full.dtype,
        )
        self.checkpointer = Checkpointer(
            catalog,
            stores[0],
            namespace,
            chunk_size,
            write_behind=write_behind_store(stores[1:]),
            shard=shard,
            codec=codec,
            actor=actor,
        )
        self.restorer = Restorer(
            catalog,
            stores,
            namespace,
            shard=shard,
            max_parallel=max_parallel,
            byte_budget=byte_budget,
            actor=actor,
        )
        self.last_restore: RestoreResult | None = None

    def restore(
        self, input_ids: object, *, max_tokens: int | None = None
    ) -> tuple[DynamicCache, int]:
        """A DynamicCache holding the longest verified stored prefix of `input_ids`, and its length.

        At most `len(input_ids) - 1` positions are restored, so the model always
        computes the last prompt token's logits. On a miss the cache is empty
        and the length 0. Pass the cache as `cache=` (or `past_key_values=`)
        with the whole `input_ids` to `model.generate`; call `model(...)` with
        `input_ids[:, n:]`. `last_restore` keeps the report.
        """
        tok = token_ids(input_ids)
        dest = _CacheDestination(self.model, self.layout, self.shard)
        result = self.restorer.restore_into(
            dest, tok, self.fingerprint, self.shard, max_tokens=max_tokens
        )
        self.last_restore = result
        if dest.cache is None:
            return self.new_cache(), 0
        return dest.cache, result.restored_tokens

    def new_cache(self) -> DynamicCache:
        """An empty DynamicCache for this model (what `restore` returns on a miss)."""
        return DynamicCache(config=self.model.config)

    def checkpoint(
        self, token_ids: object, cache: object, name: str | None = None
    ) -> CheckpointResult:
        """Store the `cache.get_seq_length()` positions the cache holds; `token_ids` names them.

        `token_ids` must cover those positions; when it has one more (the output
        of `generate`, whose last token was never fed), that one is the ref's
        pending token. With `name`, the ref `name` points at the new head.
        Returns when every new chunk is durable and catalogued.
        """
        snapshot, tok, pending = self._snapshot(token_ids, cache)
        return self.checkpointer.checkpoint_snapshot(snapshot, tok, self.fingerprint, name, pending)

    def submit(
        self,
        token_ids: object,
        cache: object,
        name: str | None = None,
        *,
        speculative: bool = True,
    ) -> Future[CheckpointResult] | None:
        """`checkpoint` in the background; the cache may keep decoding meanwhile.

        Bounded like `Checkpointer.submit`: when the queue or staging budget is
        full, speculative work is dropped (None, counted in
        `checkpointer.dropped`) and explicit work raises `CheckpointBusyError`.
        """
        snapshot, tok, pending = self._snapshot(token_ids, cache)
        return self.checkpointer.submit_snapshot(
            snapshot, tok, self.fingerprint, name, pending, speculative=speculative
        )

    def _snapshot(
        self, ids: object, cache: object
    ) -> tuple[_CacheSnapshot, np.ndarray[Any, Any], int | None]:
        layers = check_cache(cache)
        tok = token_ids(ids, "token_ids")
        n = layers[self.shard.layer_lo].get_seq_length() if len(layers) > self.shard.layer_lo else 0
        if n == 0:
            raise InputError("the cache holds no positions: nothing to checkpoint")
        if len(tok) < n:
            raise InputError(
                f"the cache holds {n} positions but token_ids has only {len(tok)}: "
                "pass the ids of every position the cache holds"
            )
        pending = int(tok[n]) if len(tok) > n else None
        return _CacheSnapshot(layers, self.layout, self.shard, n), tok[:n], pending

    def close(self) -> None:
        """Finish queued checkpoints and write-behind uploads, then stop the workers."""
        self.checkpointer.close()
        self.restorer.close()

    def __enter__(self) -> HFAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- models for tests, demos and benchmarks ------------------------------------------------


def save_random_model(
    directory: str | Path, model_type: str = "llama", *, seed: int = 0, **config: Any
) -> Path:
    """Build a causal LM of `model_type` ("llama", "qwen2", "mistral", ...) with random weights
    from `config` fields, `save_pretrained` it to `directory` and return the path.

    Nothing is downloaded; load it back with `AutoModelForCausalLM.from_pretrained`.
    Biases are random too (transformers initialises them to zero), so a bias in
    the K/V projections really changes K/V.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.02)
    path = Path(directory)
    model.save_pretrained(path)
    return path


@dataclass
class GreedyRun:
    """Greedy decoding from a cache: the tokens, each step's logits, time to the first token."""

    tokens: list[int]
    logits: list[np.ndarray[Any, Any]]
    first_token_s: float


@torch.no_grad()
def greedy(
    model: PreTrainedModel, input_ids: object, cache: DynamicCache, start: int, new_tokens: int
) -> GreedyRun:
    """Feed `input_ids[start:]` after the `start` positions `cache` holds, then decode
    `new_tokens` greedily; logits come back as float32 numpy arrays (for digests)."""
    ids = token_ids(input_ids)
    t0 = time.perf_counter()
    x = torch.tensor(ids[start:].astype(np.int64), device=model.device).unsqueeze(0)
    # Logits of the last position only: a long prompt's full logits would not fit in memory.
    logits = model(x, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    first = time.perf_counter() - t0
    out: list[int] = []
    seen: list[np.ndarray[Any, Any]] = []
    for _ in range(new_tokens):
        seen.append(logits.float().cpu().numpy())
        out.append(int(torch.argmax(logits)))
        if len(out) < new_tokens:
            x = torch.tensor([[out[-1]]], device=model.device)
            logits = model(x, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    return GreedyRun(out, seen, first)


# A small Llama the demo builds when no model is given: GQA, head dim 64, bfloat16.
DEMO_MODEL = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "bos_token_id": 0,
    "eos_token_id": None,
    "pad_token_id": None,
}


def load_model(path_or_id: str | Path, dtype: str = "auto") -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` in eval mode: a local checkpoint directory, or a
    hub id where there is network. `dtype` "auto" keeps the checkpoint's own."""
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(path_or_id), dtype=dtype if dtype == "auto" else getattr(torch, dtype)
    )
    model.eval()  # type: ignore[no-untyped-call]
    return model
