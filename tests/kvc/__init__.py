"""Tests of kvc/ (see docs/architecture.md, "The rooms")."""
