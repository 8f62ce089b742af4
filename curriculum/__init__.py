"""Staged data curriculum: stages, schedule, deterministic mixer, plan."""
