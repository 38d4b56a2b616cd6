"""A new SGLang process, as after a restart: its radix tree is empty, so it prefetches from the root.

Run as `python -m tests.sglang.restart_worker ARGS` (ARGS: JSON with the
`--hicache-storage-backend-extra-config` value, the host layouts and the token
ids). For each layout it builds SGLang's own pools and cache controller with kvc
attached (tests/sglang/harness.py), prefetches the tokens from the root and
prints what came back: the tokens the hit query counted and the IO thread
loaded, and each loaded page's bytes as hex.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.sglang.harness import SGLangRank, single_rank_group


def main() -> None:
    args = json.loads(sys.argv[1])
    group = single_rank_group(str(Path(tempfile.mkdtemp()) / "init"))
    out = {}
    for layout in args["layouts"]:
        rank = SGLangRank(args["config"], layout=layout, group=group)
        got = rank.prefetch(args["tokens"], [])
        loaded = got.host_indices[: got.loaded_tokens]
        out[layout] = {
            "hit": got.hit_tokens,
            "loaded": got.loaded_tokens,
            "pages": [page.hex() for page in rank.page_bytes(loaded)],
        }
        rank.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
