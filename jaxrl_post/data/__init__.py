"""Data pipelines (grain)."""
