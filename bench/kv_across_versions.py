"""Does a prompt's KV change across torch and transformers versions? The evidence behind the
fingerprint's version policy (docs/engines.md, "Versions in the fingerprint").

Usage (repository root, the project's venv; each `--env` is another Python with torch,
transformers and blake3, e.g. a venv made with `python3 -m venv` and pip):

    python bench/kv_across_versions.py \
        --env main=/work/main/.venv/bin/python \
        --env torch2.14.1=/work/venvs/t2141/bin/python \
        --env 'main,1 thread=/work/main/.venv/bin/python,threads=1' \
        [--threads 2] [--json]

It builds small random-weight models (fixed seed, `save_pretrained`, nothing downloaded):
Llama (multi-head), Qwen2 (GQA, biased K/V projections) and Mistral (GQA), each in float32
and bfloat16, and a few fixed prompts. Every environment loads the same checkpoint files
with `from_pretrained` in a process of its own, runs one real forward pass per prompt with
`attn_implementation` "sdpa" and "eager", and hashes the prompt's KV (blake3 of each layer's
K then V bytes). The first environment is the baseline. It prints, per environment and per
model, whether the sdpa KV is bit-identical to the baseline's and the largest absolute
difference where it is not; and two controls: the first environment run again in a new
process (must be identical: the runs are deterministic) and eager against sdpa in the
baseline (must differ: the comparison can see a difference).

An `--env` may end in `,threads=N` to run that environment with N intra-op threads instead
of `--threads`: the thread count is not in any fingerprint, so it is worth seeing too.

The worker part of this file (`--worker`) imports only torch, transformers, safetensors
(a dependency of transformers) and blake3, so it runs in environments without kvc.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SEED = 0
VOCAB = 1024
# Prompt lengths: one short, one that crosses a few of sdpa's CPU blocks, one longer.
PROMPTS = (5, 77, 600)
ATTENTION = ("sdpa", "eager")
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "bos_token_id": 0,
    "eos_token_id": None,
    "pad_token_id": None,
}
# (name, model_type, config fields beyond SHAPE)
FAMILIES = (
    ("llama", "llama", {"num_attention_heads": 8, "num_key_value_heads": 8}),
    ("qwen2", "qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    (
        "mistral",
        "mistral",
        {"num_attention_heads": 8, "num_key_value_heads": 2, "sliding_window": None},
    ),
)
DTYPES = ("float32", "bfloat16")


# --- worker: runs in each environment, imports no kvc code -------------------------------


def prompt_ids(length: int) -> list[int]:
    """A fixed prompt of `length` token ids (the same in every environment and version)."""
    import random

    rng = random.Random(f"kv-across-versions/{length}")
    return [rng.randrange(1, VOCAB) for _ in range(length)]


def cache_layers(cache: Any) -> list[tuple[Any, Any]]:
    """(K, V) per layer of the cache a forward returned, in any transformers this runs on:
    4.56+ and 5.x keep `layers[i].keys/values`, older 4.x `key_cache/value_cache`."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    return [(k, v) for k, v in cache]


def rope_frequencies(model: Any) -> list[float]:
    """The rotary frequencies the loaded model really uses (its `rotary_emb.inv_freq`): a
    version that read the saved config differently (4.x does not read the `rope_parameters`
    5.x writes) shows here, not as a numeric difference."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and hasattr(module, "inv_freq"):
            return [float(f) for f in module.inv_freq]
    raise SystemExit(f"{type(model).__name__} has no rotary_emb.inv_freq to check")


def quiet_loading() -> None:
    """No progress bar per loaded checkpoint (there are dozens)."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def worker(models_dir: Path, out: Path, threads: int) -> None:
    import blake3
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    quiet_loading()
    torch.set_num_threads(threads)
    dtype_kwarg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    results: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for model_dir in sorted(p for p in models_dir.iterdir() if p.is_dir()):
        for attn in ATTENTION:
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), attn_implementation=attn, **{dtype_kwarg: "auto"}
            )
            model.eval()
            for length in PROMPTS:
                ids = torch.tensor([prompt_ids(length)])
                with torch.no_grad():
                    cache = model(ids, use_cache=True).past_key_values
                key = f"{model_dir.name}/{attn}/{length}"
                layers = []
                for i, (k, v) in enumerate(cache_layers(cache)):
                    h = blake3.blake3()
                    for name, t in (("k", k), ("v", v)):
                        t = t.detach().contiguous()
                        h.update(t.view(torch.uint8).numpy().tobytes())
                        tensors[f"{key}/{i}/{name}"] = t.clone()
                    layers.append(h.hexdigest())
                results[key] = {
                    "layers": layers,
                    "dtype": str(model.dtype).removeprefix("torch."),
                    "rope": rope_frequencies(model),
                }
    save_file(tensors, str(out.with_suffix(".safetensors")))
    out.write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "cpu": torch.backends.cpu.get_cpu_capability(),
                "threads": torch.get_num_threads(),
                "results": results,
            }
        )
    )


# --- orchestration: builds the models, runs every environment, compares ------------------


def build_models(directory: Path) -> None:
    """Each family in each dtype, saved as the checkpoint every environment loads."""
    import torch

    from restore.engines.hf import load_model, save_random_model

    quiet_loading()
    for name, model_type, fields in FAMILIES:
        float32 = save_random_model(
            directory / f"{name}-float32", model_type, seed=SEED, **SHAPE, **fields
        )
        load_model(float32).to(torch.bfloat16).save_pretrained(directory / f"{name}-bfloat16")


def parse_env(spec: str, threads: int) -> tuple[str, str, int]:
    """`NAME=PYTHON[,threads=N]` as (name, python, threads)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"--env {spec!r}: expected NAME=PYTHON[,threads=N]")
    python, _, option = rest.partition(",")
    if option:
        key, _, value = option.partition("=")
        if key != "threads" or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--env {spec!r}: the only option is threads=N (N >= 1)")
        threads = int(value)
    return name, python, threads


def run_env(python: str, models: Path, out: Path, threads: int) -> dict[str, Any]:
    subprocess.run(
        [python, __file__, "--worker", str(models), str(out), "--threads", str(threads)],
        check=True,
    )
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def compare(
    base: dict[str, Any],
    base_path: Path,
    other: dict[str, Any],
    other_path: Path,
    keys: list[tuple[str, str]],
) -> dict[str, Any]:
    """For each (key in base, key in other): are all layers bit-identical, and the largest
    absolute difference over the layers that are not."""
    from safetensors import safe_open

    identical, layers_same, layers_all, worst = 0, 0, 0, 0.0
    config_mismatch = []
    with (
        safe_open(str(base_path.with_suffix(".safetensors")), "pt") as a,
        safe_open(str(other_path.with_suffix(".safetensors")), "pt") as b,
    ):
        for key_a, key_b in keys:
            ra, rb = base["results"][key_a], other["results"][key_b]
            if ra["rope"] != rb["rope"]:
                config_mismatch.append(
                    f"{key_b}: other rotary frequencies (config read differently)"
                )
            same = [x == y for x, y in zip(ra["layers"], rb["layers"], strict=True)]
            layers_same += sum(same)
            layers_all += len(same)
            identical += all(same)
            for i, ok in enumerate(same):
                if ok:
                    continue
                for kv in ("k", "v"):
                    ta = a.get_tensor(f"{key_a}/{i}/{kv}").float()
                    tb = b.get_tensor(f"{key_b}/{i}/{kv}").float()
                    worst = max(worst, float((ta - tb).abs().max()))
    return {
        "identical": identical,
        "total": len(keys),
        "layers_identical": layers_same,
        "layers": layers_all,
        "max_abs_diff": worst,
        "config_mismatch": config_mismatch,
    }


def model_names() -> list[str]:
    return [f"{name}-{dtype}" for name, _, _ in FAMILIES for dtype in DTYPES]


def cell(c: dict[str, Any]) -> str:
    if c["config_mismatch"]:
        return "config read differently"
    if c["identical"] == c["total"]:
        return "identical"
    return f"{c['identical']}/{c['total']} same, max {c['max_abs_diff']:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--env", action="append", default=[], metavar="NAME=PYTHON[,threads=N]")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads in each environment")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("MODELS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), Path(args.worker[1]), args.threads)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    envs = [parse_env(s, args.threads) for s in args.env] or [
        ("this", sys.executable, args.threads)
    ]
    with tempfile.TemporaryDirectory(prefix="kvc-kv-versions-") as tmp:
        root = Path(tmp)
        models = root / "models"
        build_models(models)
        runs: list[tuple[str, Path, dict[str, Any]]] = []
        for i, (name, python, threads) in enumerate(envs):
            out = root / f"env{i}.json"
            runs.append((name, out, run_env(python, models, out, threads)))
        base_name, base_path, base = runs[0]
        again_path = root / "again.json"
        again = run_env(envs[0][1], models, again_path, envs[0][2])

        def keys(attn_a: str, attn_b: str, model: str) -> list[tuple[str, str]]:
            return [(f"{model}/{attn_a}/{n}", f"{model}/{attn_b}/{n}") for n in PROMPTS]

        rows = []
        for name, path, data in runs[1:]:
            rows.append(
                (
                    name,
                    data,
                    {
                        m: compare(base, base_path, data, path, keys("sdpa", "sdpa", m))
                        for m in model_names()
                    },
                )
            )
        rows.append(
            (
                f"control: {base_name} again",
                again,
                {
                    m: compare(base, base_path, again, again_path, keys("sdpa", "sdpa", m))
                    for m in model_names()
                },
            )
        )
        rows.append(
            (
                f"control: {base_name} eager",
                base,
                {
                    m: compare(base, base_path, base, base_path, keys("sdpa", "eager", m))
                    for m in model_names()
                },
            )
        )

    if args.json:
        print(
            json.dumps(
                {
                    "baseline": base_name,
                    "envs": [(n, d["torch"], d["transformers"], d["threads"]) for n, _, d in runs],
                    "rows": [
                        {
                            "env": n,
                            "torch": d["torch"],
                            "transformers": d["transformers"],
                            "threads": d["threads"],
                            "models": c,
                        }
                        for n, d, c in rows
                    ],
                },
                indent=1,
            )
        )
        return
    print(
        f"baseline: {base_name} (torch {base['torch']}, transformers {base['transformers']}, "
        f"{base['threads']} threads, cpu {base['cpu']}); sdpa KV of {len(PROMPTS)} prompts "
        f"({', '.join(map(str, PROMPTS))} tokens) per model, compared bit for bit"
    )
    header = ["environment", "torch", "transformers", "threads", *model_names()]
    table = [header] + [
        [n, d["torch"], d["transformers"], str(d["threads"]), *(cell(c[m]) for m in model_names())]
        for n, d, c in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print(" | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    for n, _, c in rows:
        for m in model_names():
            for line in c[m]["config_mismatch"]:
                print(f"{n}: {line}")


if __name__ == "__main__":
    main()
