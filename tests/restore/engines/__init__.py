"""Tests of restore/engines/ (see docs/architecture.md, "The rooms")."""
