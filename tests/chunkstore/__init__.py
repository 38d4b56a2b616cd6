"""Tests of chunkstore/ (see docs/architecture.md, "The rooms")."""
