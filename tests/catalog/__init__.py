"""Tests of catalog/ (see docs/architecture.md, "The rooms")."""
