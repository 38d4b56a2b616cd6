"""Execution: page pools, the checkpoint and restore pipelines, the planner."""
