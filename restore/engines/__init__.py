"""Engine adapters: models that compute with KV that kvc keeps in page-pool pages."""

from __future__ import annotations

from restore.engines.reference import ReferenceConfig, ReferenceModel

__all__ = ["ReferenceConfig", "ReferenceModel"]
