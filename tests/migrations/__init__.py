"""Tests of migrations/ (see docs/architecture.md, "The rooms")."""
