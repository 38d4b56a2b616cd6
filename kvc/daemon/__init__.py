"""The checkpoint/restore daemon (`kvc daemon`): one page pool beside an inference engine, over loopback HTTP.

`core` holds the `Daemon` (no HTTP), `app` its FastAPI app, `wire` the request
bodies. See docs/daemon.md.
"""

from __future__ import annotations

from kvc.daemon.app import create_daemon_app
from kvc.daemon.core import Daemon

__all__ = ["Daemon", "create_daemon_app"]
