"""Tests of maintenance/ (see docs/architecture.md, "The rooms")."""
