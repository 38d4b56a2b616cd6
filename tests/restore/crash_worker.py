"""A publisher run in a subprocess by the crash matrix: it signals at one step of the publish, then waits to be killed."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import restore.checkpoint as checkpoint_module
from catalog import Catalog
from chunkstore import open_store
from chunkstore.base import DOCUMENTS_DIR
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool


def park(marker: Path) -> None:
    """Tell the parent we are at the step, then wait for SIGKILL (never return)."""
    marker.write_text(str(os.getpid()))
    while True:
        time.sleep(3600)


def main() -> None:
    args = json.loads(sys.argv[1])
    marker = Path(args["marker"])
    step = args["step"]
    model = ReferenceModel.small(seed=0)
    pool = PagePool(model.layout, page_size=16, num_pages=64)
    route = pool.new_route()
    tokens = args["tokens"]
    model.prefill(pool, route, tokens)
    cat = Catalog.open(args["catalog"])
    store = open_store(args["store"])

    if step == "after_encode":
        real_finish = checkpoint_module.finish_record

        def encode_then_park(*a: Any, **kw: Any) -> Any:
            real_finish(*a, **kw)
            park(marker)

        checkpoint_module.finish_record = encode_then_park
    elif step == "during_put":
        if store.name.startswith("file:"):
            import chunkstore.local as local_module

            real_fsync = local_module.os.fsync

            def fsync_then_park(fd: int) -> None:
                real_fsync(fd)
                # The fingerprint descriptor document goes first: park in the blob's put.
                if f"/{DOCUMENTS_DIR}/" not in os.readlink(f"/proc/self/fd/{fd}"):
                    park(marker)  # the temp file is written and synced, not yet renamed

            local_module.os.fsync = fsync_then_park  # type: ignore[attr-defined]
        else:

            def before_send(request: Any, **_: Any) -> None:
                if f"/{DOCUMENTS_DIR}/" not in request.url:  # the blob's PUT, not the descriptor's
                    park(marker)  # the PUT request is built and about to go out

            store.client.meta.events.register("before-send.s3.PutObject", before_send)  # type: ignore[attr-defined]
    elif step == "after_put":
        real_record = cat.record_chunks

        def record_parks(*a: Any, **kw: Any) -> Any:
            park(marker)
            return real_record(*a, **kw)

        cat.record_chunks = record_parks  # type: ignore[method-assign]
    elif step == "in_txn":

        @sa.event.listens_for(cat.engine, "after_cursor_execute")
        def after(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
            if statement.lstrip().upper().startswith("INSERT INTO CHUNKS"):
                park(marker)  # rows inserted, transaction open, not committed

    with Checkpointer(cat, store, chunk_size=32) as cp:
        cp.checkpoint(pool, route, tokens, model.fingerprint, name="crash")
    marker.write_text("finished")


if __name__ == "__main__":
    main()
