"""Maintenance: the jobs run over a catalog and its stores (fsck, the orphan sweep, GC runs, rebuild, reading the journal back)."""
