"""Tests of restore/ (see docs/architecture.md, "The rooms")."""
