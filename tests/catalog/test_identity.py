"""Identity spec v1: golden vectors, process independence, and every field mattering."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from catalog import (
    AttentionLayout,
    Fingerprint,
    IdentityError,
    chain_hash,
    chain_root,
    fingerprint_hex,
    prefix_hashes,
)

LAYOUT = AttentionLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
FP_KW: dict[str, Any] = {
    "weights": "sha256:abc",
    "architecture": "llama",
    "config": {"a": 1},
    "attention_layout": LAYOUT,
}

# Pinned outputs of spec v1. If one of these changes, every stored chain and
# fingerprint becomes unreachable: that is a new spec version, not a fix.
GOLDEN_FINGERPRINT = "fe7ffa5291f92eac2509c6b5fb28c2a6da67a731f7ba8393d6180426f1278819"
GOLDEN_CANONICAL = (
    b'{"architecture":"llama","attention_layout":{"dtype":"float16","head_dim":8,'
    b'"num_kv_heads":2,"num_layers":2},"config":{"a":1},"execution_variant":"default",'
    b'"format":1,"weights":"sha256:abc"}'
)
GOLDEN_ROOT_DEFAULT = "2506c23de904d3646a48ec4bb9d67f1f87688247b87d2b55b6d32e7303b95c3d"
GOLDEN_PREFIXES_12345_BY_2 = [
    "cb0e320306553cee727942af56011a690268eacaa3ff6c743fe3183839177a3e",
    "14fb3e814c8343166bf1a73666af1ee68ab67c0d31c82292c3863a1b6ed9cb01",
    "9b41d8d59cc4045b4b180939789989685236b9265f5e436ecbed2b51def2c00d",
]


def _spec_chain(namespace: str, tokens: list[int], chunk_size: int) -> list[str]:
    """The spec's formulas written out literally, independent of the implementation."""
    parent = blake3.blake3(b"kvc/prefix/v1/root" + namespace.encode("utf-8")).digest()
    out = []
    for i in range(0, len(tokens), chunk_size):
        piece = tokens[i : i + chunk_size]
        body = struct.pack(f"<I{len(piece)}I", len(piece), *piece)
        parent = blake3.blake3(b"kvc/prefix/v1" + parent + body).digest()
        out.append(parent.hex())
    return out


def test_golden_fingerprint() -> None:
    fp = Fingerprint.create(**FP_KW)
    assert fp.canonical == GOLDEN_CANONICAL
    assert fp.hex == GOLDEN_FINGERPRINT
    assert fp.hex == blake3.blake3(GOLDEN_CANONICAL).hexdigest()
    assert fp.descriptor["attention_layout"] == {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float16",
    }
    assert fp.descriptor["format"] == 1
    assert fp.layout == LAYOUT


def test_golden_chain() -> None:
    assert chain_root("default").hex() == GOLDEN_ROOT_DEFAULT
    got = [h.hex() for h in prefix_hashes("default", [1, 2, 3, 4, 5], 2)]
    assert got == GOLDEN_PREFIXES_12345_BY_2
    assert got == _spec_chain("default", [1, 2, 3, 4, 5], 2)
    assert chain_hash(chain_root("default"), [1, 2]).hex() == GOLDEN_PREFIXES_12345_BY_2[0]


def test_canonical_json_is_utf8_not_escaped() -> None:
    fp = Fingerprint.create(
        **{**FP_KW, "architecture": "llamá", "config": {"b": [1.5, "ü"], "a": None}}
    )
    text = fp.canonical.decode("utf-8")
    assert "llamá" in text and "\\u" not in text
    assert text.index('"a"') < text.index('"b"')
    expected = json.dumps(
        fp.descriptor, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()
    assert fp.canonical == expected
    assert fp.hex == blake3.blake3(expected).hexdigest()


def test_values_are_the_same_in_another_process() -> None:
    code = (
        "from catalog import *\n"
        "l = AttentionLayout(2, 2, 8, 'float16')\n"
        "f = Fingerprint.create(weights='sha256:abc', architecture='llama', config={'a': 1},"
        " attention_layout=l)\n"
        "print(f.hex)\n"
        "print(','.join(h.hex() for h in prefix_hashes('default', [1, 2, 3, 4, 5], 2)))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    outputs = set()
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        outputs.add(out)
    assert outputs == {GOLDEN_FINGERPRINT + "\n" + ",".join(GOLDEN_PREFIXES_12345_BY_2) + "\n"}


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
)
def test_equal_suffixes_under_different_parents_differ(a: list[int], b: list[int]) -> None:
    suffix = [7, 8, 9]
    if a == b:
        b = [*b, 0]
    ha = chain_hash(chain_hash(chain_root("ns"), a), suffix)
    hb = chain_hash(chain_hash(chain_root("ns"), b), suffix)
    assert ha != hb


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300), st.integers(1, 64))
def test_prefix_hashes_match_the_spec(tokens: list[int], chunk_size: int) -> None:
    got = prefix_hashes("tenant-ü", tokens, chunk_size)
    assert [h.hex() for h in got] == _spec_chain("tenant-ü", tokens, chunk_size)
    assert len(got) == -(-len(tokens) // chunk_size)
    # numpy input gives the same hashes as a list
    assert prefix_hashes("tenant-ü", np.array(tokens, dtype=np.uint32), chunk_size) == got


def test_namespaces_never_alias() -> None:
    assert prefix_hashes("a", [1, 2, 3], 2) != prefix_hashes("b", [1, 2, 3], 2)
    assert chain_root("a") != chain_root("b")


def test_length_is_committed() -> None:
    # [1, 2] then [3] must differ from [1] then [2, 3] even though the bytes concatenate alike.
    assert prefix_hashes("ns", [1, 2, 3], 2)[-1] != chain_hash(
        chain_hash(chain_root("ns"), [1]), [2, 3]
    )


@pytest.mark.parametrize(
    "change",
    [
        {"weights": "sha256:abd"},
        {"architecture": "mistral"},
        {"config": {"a": 2}},
        {"config": {"a": 1, "rope_theta": 10000.0}},
        {"attention_layout": AttentionLayout(3, 2, 8, "float16")},
        {"attention_layout": AttentionLayout(2, 4, 8, "float16")},
        {"attention_layout": AttentionLayout(2, 2, 16, "float16")},
        {"attention_layout": AttentionLayout(2, 2, 8, "bfloat16")},
        {"attention_layout": AttentionLayout(2, 2, 8, "float32")},
        {"execution_variant": "fp8-kernels"},
    ],
)
def test_every_descriptor_field_changes_the_fingerprint(change: dict[str, Any]) -> None:
    assert Fingerprint.create(**{**FP_KW, **change}).hex != GOLDEN_FINGERPRINT


def test_descriptor_round_trip() -> None:
    fp = Fingerprint.create(**FP_KW)
    assert Fingerprint.from_descriptor(json.loads(json.dumps(fp.descriptor))) == fp
    assert fingerprint_hex(fp) == fp.hex == fingerprint_hex(fp.hex)


@pytest.mark.parametrize("weights", ["", "   ", None])
def test_weights_are_required(weights: object) -> None:
    with pytest.raises(IdentityError, match="weights"):
        Fingerprint.create(**{**FP_KW, "weights": weights})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0, "num_kv_heads": 1, "head_dim": 1, "dtype": "float16"}, "num_layers"),
        ({"num_layers": 1, "num_kv_heads": -1, "head_dim": 1, "dtype": "float16"}, "num_kv_heads"),
        ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 1.5, "dtype": "float16"}, "head_dim"),
        ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "int8"}, "dtype"),
    ],
)
def test_layout_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(IdentityError, match=message):
        AttentionLayout(**kwargs)


def test_non_finite_config_is_refused() -> None:
    with pytest.raises(IdentityError, match="canonical JSON"):
        Fingerprint.create(**{**FP_KW, "config": {"x": float("nan")}})


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([], "empty"),
        ([1, -1], "out of range"),
        ([2**32], "out of range"),
        ([1, 2**70], "range"),
        ([1.5], "integers"),
        ("abc", "string"),
        ([[1, 2]], "one-dimensional"),
        ([True, False], "integers"),
    ],
)
def test_bad_tokens_are_clear_errors(tokens: Any, message: str) -> None:
    with pytest.raises(IdentityError, match=message):
        prefix_hashes("ns", tokens, 4)
    with pytest.raises(IdentityError, match=message):
        chain_hash(chain_root("ns"), tokens)


@pytest.mark.parametrize("chunk_size", [0, -3, 1.0, True])
def test_bad_chunk_size(chunk_size: Any) -> None:
    with pytest.raises(IdentityError, match="chunk_size"):
        prefix_hashes("ns", [1, 2], chunk_size)


def test_bad_namespace_and_parent() -> None:
    with pytest.raises(IdentityError, match="namespace"):
        chain_root("")
    with pytest.raises(IdentityError, match="parent"):
        chain_hash(b"short", [1])


@pytest.mark.parametrize("bad", ["", "ABC", "g" * 64, "A" * 64, 123])
def test_malformed_fingerprint_hex(bad: Any) -> None:
    with pytest.raises(IdentityError, match="malformed fingerprint"):
        fingerprint_hex(bad)


def test_fingerprint_is_hashable_and_compares_by_hex() -> None:
    a = Fingerprint.create(**FP_KW)
    b = Fingerprint.from_descriptor(dict(a.descriptor))
    assert a == b and hash(a) == hash(b) and {a, b} == {a}
