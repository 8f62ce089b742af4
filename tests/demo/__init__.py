"""Tests of the demo package."""
