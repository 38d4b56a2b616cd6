"""Execution: page pools, the checkpoint and restore pipelines, the planner, engine adapters."""

from __future__ import annotations

from restore.checkpoint import Checkpointer, CheckpointResult
from restore.errors import CheckpointBusyError, PoolExhaustedError, RestoreError, UnknownRouteError
from restore.planner import Decision, Planner
from restore.pool import Lease, PagePool
from restore.restore import Restorer, RestoreReport, RestoreResult
from restore.session import Session

__all__ = [
    "CheckpointBusyError",
    "CheckpointResult",
    "Checkpointer",
    "Decision",
    "Lease",
    "PagePool",
    "Planner",
    "PoolExhaustedError",
    "RestoreError",
    "RestoreReport",
    "RestoreResult",
    "Restorer",
    "Session",
    "UnknownRouteError",
]
