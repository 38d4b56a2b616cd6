"""transformers models checkpoint and restore their KV through kvc, token-exact, across processes.

Models are small, built offline from a config with random weights, saved with
`save_pretrained` and loaded with `from_pretrained` (the real loading path).
Exactness is compared like with like: both sides compute the same prefix split.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from catalog.base import CatalogAPI
from catalog.catalog import Catalog
from catalog.models import Shard
from catalog.remote import RemoteCatalog
from chunkstore import ChunkStore, open_store
from kvc.service import create_app, hash_token
from restore.engines.hf import (
    HFAdapter,
    cache_kwarg,
    greedy,
    model_fingerprint,
    save_random_model,
)
from restore.errors import InputError, UnsupportedModelError
from tests.rebuild_helpers import kvc_rebuild, lose_catalog, names
from tests.restore.engines.hf_worker import CONFIGS, cache_digests, generate, load, prefill
from tests.restore.test_token_exact import corrupt
from tests.services import serve_in_thread
from tests.store_wrappers import Delegating

ROOT = Path(__file__).resolve().parents[3]
CHUNK = 16
TOKEN = "hf-test-token-51d2"
NEW_TOKENS = 32


def prompt(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 256, n)]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        arch: str(save_random_model(root / arch, arch, seed=7, **cfg))
        for arch, cfg in CONFIGS.items()
    }


@dataclass
class Env:
    catalog: Catalog
    store: ChunkStore
    tmp: Path


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    store = open_store(f"file://{tmp_path / 'blobs'}")
    yield Env(cat, store, tmp_path)
    store.close()
    cat.close()


def adapter(model: PreTrainedModel, env: Env, **kw: Any) -> HFAdapter:
    return HFAdapter(model, env.catalog, [env.store], chunk_size=CHUNK, **kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns, so equality is bit equality for every float dtype."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def cut(cache: DynamicCache, n: int) -> DynamicCache:
    """The first n positions of a cache: the like-with-like reference for a restore of n
    positions that a longer prefill produced (torch may round a shorter prefill differently)."""
    out = copy.deepcopy(cache)
    out.crop(n - out.get_seq_length())  # transformers crops by a negative count
    return out


def same_kv(a: DynamicCache, b: DynamicCache, layers: range | None = None) -> bool:
    idx = layers if layers is not None else range(len(a.layers))
    return all(
        torch.equal(bits(a.layers[i].keys), bits(b.layers[i].keys))  # type: ignore[union-attr]
        and torch.equal(bits(a.layers[i].values), bits(b.layers[i].values))  # type: ignore[union-attr]
        for i in idx
    )


# -- across processes, over every catalog and store kind ---------------------------------------

CASES = [
    ("llama", "float32", "sqlite", "local"),
    ("llama", "bfloat16", "sqlite", "local"),
    ("llama", "float16", "sqlite", "local"),
    ("qwen2", "float32", "sqlite", "local"),
    ("qwen2", "bfloat16", "sqlite", "local"),
    ("mistral", "float32", "sqlite", "local"),
    ("mistral", "bfloat16", "sqlite", "local"),
    ("gpt_neox", "float32", "sqlite", "local"),
    ("llama", "bfloat16", "postgres", "s3"),
    ("qwen2", "float32", "postgres", "local+s3"),
    ("qwen2", "bfloat16", "remote", "s3"),
    ("mistral", "bfloat16", "remote", "local"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "dtype", "catalog_kind", "store_kind"), CASES, ids=["-".join(c) for c in CASES]
)
def test_resume_in_a_new_process_is_bit_identical(
    request: pytest.FixtureRequest,
    model_dirs: dict[str, str],
    tmp_path: Path,
    arch: str,
    dtype: str,
    catalog_kind: str,
    store_kind: str,
) -> None:
    p = prompt(75)
    split = 67  # A prefills 67 tokens and checkpoints them; both sides then compute the rest
    local_url = f"file://{tmp_path / 'blobs'}"
    s3_url = request.getfixturevalue("s3_url") if "s3" in store_kind else None
    write_urls = {"local": [local_url], "s3": [s3_url], "local+s3": [local_url, s3_url]}[store_kind]
    # B reads only the store that must hold the bytes: with write-behind, the object store.
    read_urls = [s3_url] if "s3" in store_kind else [local_url]
    db_url = (
        request.getfixturevalue("postgres_url")
        if catalog_kind == "postgres"
        else f"sqlite:///{tmp_path / 'catalog.db'}"
    )
    cat = Catalog.open(db_url, upgrade=True)
    stores = [open_store(u) for u in write_urls]  # type: ignore[arg-type]
    model = load(model_dirs[arch], dtype)
    worker_args: dict[str, Any] = {
        "model_dir": model_dirs[arch],
        "dtype": dtype,
        "catalog": db_url,
        "stores": read_urls,
        "namespace": "default",
        "chunk_size": CHUNK,
        "prompt": p,
        "new_tokens": NEW_TOKENS,
    }
    try:
        with serve_in_thread(
            create_app(cat, {"default": hash_token(TOKEN)}, max_prompt_tokens=4096)
        ) as url:
            writer: CatalogAPI = RemoteCatalog(url, TOKEN) if catalog_kind == "remote" else cat
            cache = prefill(model, p[:split])
            with HFAdapter(model, writer, stores, chunk_size=CHUNK) as kv:
                result = kv.checkpoint(p[: split + 1], cache, name="chat-1")
            if writer is not cat:
                writer.close()
            assert result.tokens == split and result.new_chunks == 5  # 4 full chunks and a tail
            want_kv = cache_digests(cache)
            want = generate(model, p, cache, NEW_TOKENS)
            if catalog_kind == "remote":
                worker_args["remote"] = {"url": url, "token": TOKEN}
            out = subprocess.run(
                [sys.executable, "-m", "tests.restore.engines.hf_worker", json.dumps(worker_args)],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["fingerprint"] == kv.fingerprint.hex  # the same model, loaded elsewhere
        assert got["restored"] == split
        assert got["kv"] == want_kv  # K and V of every layer, bit for bit
        assert got["tokens"] == want["tokens"] and len(got["tokens"]) == NEW_TOKENS
        assert got["logits"] == want["logits"]
        ref = cat.get_ref("default", "chat-1")
        assert ref.processed == split and ref.pending_token == p[split]
        if store_kind == "local+s3":
            tiers = {
                r.tier for c in cat.lookup("default", kv.fingerprint, p).chunks for r in c.replicas
            }
            assert tiers == {"local", "object"}
    finally:
        for s in stores:
            s.close()
        cat.close()


# -- in one process ---------------------------------------------------------------------------


@pytest.fixture
def llama(model_dirs: dict[str, str]) -> PreTrainedModel:
    return load(model_dirs["llama"], "bfloat16")


def test_a_prompt_diverging_inside_a_chunk_reuses_exactly_the_matching_tokens(
    llama: PreTrainedModel, env: Env
) -> None:
    p = prompt(64)
    q = [*p[:41], *prompt(20, seed=2)]  # diverges at 41, inside the third chunk
    original = prefill(llama, p)
    with adapter(llama, env) as kv:
        kv.checkpoint(p, original)
        cache, n = kv.restore(q)
    assert n == 41
    assert kv.last_restore is not None and kv.last_restore.report.chunks == 3
    want_cache = cut(original, 41)
    assert same_kv(cache, want_cache)
    assert generate(llama, q, cache, 8) == generate(llama, q, want_cache, 8)


def test_two_forks_of_one_restored_prefix_continue_independently(
    llama: PreTrainedModel, env: Env
) -> None:
    p = prompt(48)
    with adapter(llama, env) as kv:
        kv.checkpoint(p, prefill(llama, p))
        cache, n = kv.restore([*p, 5])
    assert n == 48
    before = cache_digests(cache)
    fork = copy.deepcopy(cache)
    a = generate(llama, [*p, 5], cache, 6)
    b = generate(llama, [*p, 9], fork, 6)
    assert a == generate(llama, [*p, 5], prefill(llama, p), 6)
    assert b == generate(llama, [*p, 9], prefill(llama, p), 6)
    assert a["tokens"] != b["tokens"] or a["logits"] != b["logits"]
    # A third restore sees the stored prefix, untouched by either continuation.
    with adapter(llama, env) as kv:
        again, _ = kv.restore([*p, 1])
    assert cache_digests(again) == before


def test_a_corrupt_blob_degrades_to_the_verified_prefix_and_stays_exact(
    llama: PreTrainedModel, env: Env
) -> None:
    p = prompt(70)
    original = prefill(llama, p)
    with adapter(llama, env) as kv:
        kv.checkpoint(p, original)
        bad = env.catalog.lookup("default", kv.fingerprint, p).chunks[2].blob_key
        corrupt(env.store, bad)
        cache, n = kv.restore(p)
    assert n == 2 * CHUNK
    assert kv.last_restore is not None
    assert any("corrupt" in f for f in kv.last_restore.report.failures)
    assert [e.subject for e in env.catalog.events(kind="replica.corrupt")] == [bad]
    want_cache = cut(original, n)
    assert same_kv(cache, want_cache)
    assert generate(llama, p, cache, 8) == generate(llama, p, want_cache, 8)


def test_restore_never_covers_the_last_prompt_token_and_misses_return_an_empty_cache(
    llama: PreTrainedModel, env: Env
) -> None:
    p = prompt(40)
    with adapter(llama, env) as kv:
        empty, n = kv.restore(p)
        assert n == 0 and isinstance(empty, DynamicCache) and empty.get_seq_length() == 0
        assert generate(llama, p, empty, 4) == generate(
            llama, p, DynamicCache(config=llama.config), 4
        )
        kv.checkpoint(p, prefill(llama, p))  # the cache holds every prompt token
        cache, n = kv.restore(p)
        assert n == 39 and cache.get_seq_length() == 39
        _, capped = kv.restore(p, max_tokens=20)
        assert capped == 20
        _, one = kv.restore(p[:1])
        assert one == 0


def test_input_ids_as_list_1d_and_batch_of_one_tensor_and_both_cache_names(
    llama: PreTrainedModel, env: Env
) -> None:
    p = prompt(50)
    with adapter(llama, env) as kv:
        kv.checkpoint(torch.tensor([p]), prefill(llama, p[:40]))
        restored = [kv.restore(x)[1] for x in (p, torch.tensor(p), torch.tensor([p]))]
        assert restored == [40, 40, 40]
        cache, _ = kv.restore(p)
        want = generate(llama, p, prefill(llama, p[:40]), 4)["tokens"]
        # generate continues from the restored cache (under the name this transformers takes).
        with torch.no_grad():
            out = llama.generate(
                torch.tensor([p]), **{cache_kwarg(llama): cache}, max_new_tokens=4, do_sample=False
            )
        assert out[0, 50:].tolist() == want
        # model(...) itself continues from the restored cache with the rest of the prompt.
        cache, n = kv.restore(p)
        with torch.no_grad():
            logits = llama(torch.tensor([p[n:]]), **{cache_kwarg(llama): cache}).logits
        with torch.no_grad():
            straight = llama(
                torch.tensor([p[n:]]), **{cache_kwarg(llama): prefill(llama, p[:n])}
            ).logits
        assert torch.equal(bits(logits), bits(straight))


def test_checkpoint_stores_what_the_cache_holds_and_the_pending_token(
    llama: PreTrainedModel, env: Env
) -> None:
    p = prompt(60)
    with adapter(llama, env) as kv:
        first = kv.checkpoint(p, prefill(llama, p[:30]), name="c")
        assert first.tokens == 30 and first.new_chunks == 2
        assert env.catalog.get_ref("default", "c").pending_token == p[30]
        again = kv.checkpoint(p, prefill(llama, p[:50]), name="c")
        assert again.tokens == 50 and again.skipped_chunks == 1 and again.new_chunks == 3
        with torch.no_grad():
            out = llama.generate(
                torch.tensor([p]),
                **{cache_kwarg(llama): (gen := prefill(llama, p[:50]))},
                max_new_tokens=3,
                do_sample=False,
            )
        # After generate the cache holds all but the last generated token: that one is pending.
        last = kv.checkpoint(out, gen, name="c")
        assert last.tokens == out.shape[1] - 1
        assert env.catalog.get_ref("default", "c").pending_token == int(out[0, -1])


def test_models_that_differ_in_weights_attention_or_dtype_share_nothing(
    model_dirs: dict[str, str], env: Env, tmp_path: Path
) -> None:
    p = prompt(40)
    base = load(model_dirs["llama"], "float32")
    with adapter(base, env) as kv:
        kv.checkpoint(p, prefill(base, p))
        assert kv.restore(p)[1] == 39
    other_weights = load(
        str(save_random_model(tmp_path / "other", "llama", seed=8, **CONFIGS["llama"])), "float32"
    )
    variants = {
        "weights": other_weights,
        "attention": load(model_dirs["llama"], "float32", attn="eager"),
        "dtype": load(model_dirs["llama"], "bfloat16"),
    }
    for what, model in variants.items():
        with adapter(model, env) as kv:
            assert kv.fingerprint != model_fingerprint(base), what
            assert kv.restore(p)[1] == 0, what
    # The same weights under an immutable revision id: the id, not the bytes, identifies them.
    assert model_fingerprint(base, weights_id="rev-1") == model_fingerprint(
        other_weights, weights_id="rev-1"
    )
    assert model_fingerprint(base, weights_id="rev-1") != model_fingerprint(base)


def test_a_shard_worker_publishes_and_restores_only_its_layers(
    llama: PreTrainedModel, env: Env
) -> None:
    p = prompt(40)
    full = prefill(llama, p)
    shard = Shard(1, 3, 0, 2)
    with adapter(llama, env, shard=shard) as kv:
        kv.checkpoint(p, full)
        cache, n = kv.restore(p)
    assert n == 39
    assert same_kv(cache, cut(full, 39), range(1, 3))
    assert not cache.layers[0].is_initialized  # layer 0 belongs to another worker
    with adapter(llama, env) as whole:
        assert whole.restore(p)[1] == 0  # the whole-model shard was never published


class HeldPuts(Delegating):
    """A store whose puts wait for `go`; `waiting` is set once the first one does."""

    def __init__(self, inner: ChunkStore) -> None:
        super().__init__(inner)
        self.waiting = threading.Event()
        self.go = threading.Event()

    def put(self, key: str, data: Any) -> Any:
        self.waiting.set()
        assert self.go.wait(60), "nobody let the put through"
        return self.inner.put(key, data)


def test_submit_checkpoints_in_the_background_while_the_cache_moves_on(
    llama: PreTrainedModel, env: Env
) -> None:
    p = prompt(50)
    cache = prefill(llama, p[:40])
    snapshot = cache_digests(cache)
    # The first put waits until the cache has grown: the checkpoint is certainly in flight
    # (one chunk read from the snapshot, the rest still to read) while the cache moves on.
    held = HeldPuts(env.store)
    with HFAdapter(llama, env.catalog, [held], chunk_size=CHUNK) as kv:
        fut = kv.submit(p, cache, speculative=False)
        assert fut is not None
        try:
            assert held.waiting.wait(60), "the checkpoint never reached its first put"
            generate(llama, p, cache, 5)  # the cache grows while the checkpoint runs
        finally:
            held.go.set()
        assert fut.result(timeout=60).tokens == 40
        restored, n = kv.restore(p)
    assert n == 40 and cache_digests(restored) == snapshot


# -- refusals: clear errors, nothing stored ----------------------------------------------------


def test_encoder_decoder_and_unsupported_dtypes_are_refused(tmp_path: Path, env: Env) -> None:
    from transformers import AutoModelForSeq2SeqLM, T5Config

    t5 = AutoModelForSeq2SeqLM.from_config(
        T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    )
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        adapter(t5, env)
    from transformers import AutoModelForCausalLM, LlamaConfig

    f64 = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIGS["llama"])).to(torch.float64)
    with pytest.raises(UnsupportedModelError, match="float64"):
        adapter(f64, env)


def test_caches_kvc_cannot_represent_exactly_are_refused_and_nothing_is_stored(
    llama: PreTrainedModel, env: Env
) -> None:
    p = prompt(40)
    good = prefill(llama, p)
    static = StaticCache(config=llama.config, max_cache_len=64)
    # An offloading DynamicCache needs a GPU stream to be built (see the CUDA test below);
    # here it is the flag transformers sets on one.
    offloaded = copy.deepcopy(good)
    offloaded.offloading = True
    legacy = tuple((layer.keys, layer.values) for layer in good.layers)  # type: ignore[union-attr]
    with adapter(llama, env) as kv:
        for cache, named in [
            (static, "StaticCache"),
            (offloaded, "offloaded"),
            (legacy, "legacy tuple"),
            (object(), "object"),
        ]:
            with pytest.raises(UnsupportedModelError, match=named):
                kv.checkpoint(p, cache)
        with pytest.raises(InputError, match="batch of 2 rows"):
            kv.restore(torch.tensor([p, p]))
        with pytest.raises(InputError, match="only 39"):
            kv.checkpoint(p[:39], good)
        with pytest.raises(InputError, match="no positions"):
            kv.checkpoint(p, DynamicCache(config=llama.config))
        with pytest.raises(InputError, match="empty"):
            kv.restore([])
        with pytest.raises(InputError, match="integer"):
            kv.restore(torch.tensor([[0.5, 1.0]]))
        nan = copy.deepcopy(good)
        nan.layers[2].keys[0, 1, 33, 5] = float("nan")  # type: ignore[union-attr,index]
        with pytest.raises(ValueError, match="NaN"):
            kv.checkpoint(p, nan)
    assert list(env.store.keys()) == []
    assert env.catalog.stats("default")["chunks"] == 0


def test_the_core_imports_and_works_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import catalog, chunkstore, restore, restore.engines, restore.checkpoint, restore.restore\n"
        "import kvc.cli, kvc.service, kvc.daemon\n"
        "import kvc.demo\n"
        "try:\n"
        "    import restore.engines.hf\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


# -- CUDA: written now, run where a GPU exists ------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_restore_lands_on_the_device_bit_identical(
    model_dirs: dict[str, str], env: Env
) -> None:
    model = load(model_dirs["llama"], "bfloat16").to("cuda")
    p = prompt(70)
    with adapter(model, env) as kv:
        assert "device=cuda" in kv.fingerprint.descriptor["execution_variant"]
        kv.checkpoint(p, prefill(model, p[:60]))
        cache, n = kv.restore(p)
    assert n == 60
    assert all(layer.keys.device.type == "cuda" for layer in cache.layers)  # type: ignore[union-attr]
    want = prefill(model, p[:60])
    assert same_kv(cache, want)
    assert generate(model, p, cache, 8) == generate(model, p, want, 8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_offloaded_cache_is_refused(model_dirs: dict[str, str], env: Env) -> None:
    model = load(model_dirs["llama"], "bfloat16").to("cuda")
    p = prompt(20)
    cache = DynamicCache(config=model.config, offloading=True)
    with torch.no_grad():
        model(torch.tensor([p], device="cuda"), **{cache_kwarg(model): cache})
    with adapter(model, env) as kv, pytest.raises(UnsupportedModelError, match="offloaded"):
        kv.checkpoint(p, cache)


def test_greedy_decodes_like_generate_and_leaves_the_cache_one_short(
    llama: PreTrainedModel,
) -> None:
    """The demo's and benches' decoding: the same tokens as transformers' own greedy generate,
    and the cache holds every position but the last generated token's."""
    p = prompt(30)
    run = greedy(llama, p, llama_cache(llama), 0, 5)
    with torch.no_grad():
        want = llama.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, 30:]
    assert run.tokens == want.tolist()
    for new_tokens, held in (
        (0, 30),
        (1, 30),
        (3, 32),
    ):  # decoded tokens fed back: all but the last
        cache = llama_cache(llama)
        greedy(llama, p, cache, 0, new_tokens)
        assert cache.get_seq_length() == held, new_tokens


def llama_cache(model: PreTrainedModel) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def test_the_catalog_comes_back_from_the_store_alone_names_included(
    llama: PreTrainedModel, tmp_path: Path
) -> None:
    """The adapter journals by default: the name given to `checkpoint`, a pin and a deleted
    ref made through its catalog survive losing the catalog (`kvc rebuild --from` the store);
    a new adapter on the rebuilt catalog restores the cut cache bit for bit."""
    url, store_url = f"sqlite:///{tmp_path / 'catalog.db'}", f"file://{tmp_path / 'blobs'}"
    p = prompt(64)
    original = prefill(llama, p)
    cat = Catalog.open(url, upgrade=True)
    store = open_store(store_url)
    with HFAdapter(llama, cat, [store], chunk_size=CHUNK) as kv:
        kv.checkpoint(p, original, name="chat")
        head = cat.get_ref("default", "chat")
        cat.pin("default", "system", head.head_hash)
        cat.create_ref("default", "draft", head.fingerprint, head.head_hash)
        cat.delete_ref("default", "draft")
    store.close()
    cat.close()
    before = names(url, "default")
    assert set(before[0]) == {"chat"} and set(before[1]) == {"system"}
    lose_catalog(url)
    assert kvc_rebuild(url, [store_url])["complete"]
    assert names(url, "default") == before
    cat = Catalog.open(url)
    store = open_store(store_url)
    with HFAdapter(llama, cat, [store], chunk_size=CHUNK) as kv:
        cache, n = kv.restore([*p, 1])
    store.close()
    cat.close()
    assert n == 64 and same_kv(cache, original)
