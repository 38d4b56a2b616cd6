"""The cores this process may run on: what sizes the work that keeps every core busy."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The CPUs this process may be scheduled on (its affinity mask, which containers and
    `taskset` narrow), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
