"""Run in a fresh process by the token-exact tests: restore a prefix, finish the prompt, decode, report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3

from catalog.catalog import Catalog
from chunkstore import open_store
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer

ROOT = Path(__file__).resolve().parents[1]


def resume_in_new_process(args: dict[str, Any]) -> Any:
    """Run this worker in a fresh Python process with `args`; its JSON report."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.resume_worker", json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def main() -> None:
    args = json.loads(sys.argv[1])
    model = ReferenceModel.small(seed=args["seed"])
    pool = PagePool(model.layout, page_size=args["page_size"], num_pages=256)
    cat = Catalog.open(args["catalog"])
    stores = [open_store(u) for u in args["stores"]]
    prompt = args["prompt"]
    with Restorer(cat, stores, namespace=args["namespace"]) as restorer:
        res = restorer.restore(pool, prompt, model.fingerprint)
    route = res.route if res.route is not None else pool.new_route()
    tokens, logits = model.trace(pool, route, prompt[res.restored_tokens :], args["n"])
    cat.close()
    print(
        json.dumps(
            {
                "restored": res.restored_tokens,
                "tokens": tokens,
                "logits": [blake3.blake3(x.tobytes()).hexdigest() for x in logits],
            }
        )
    )


if __name__ == "__main__":
    main()
