"""The demo: corpus sources, the corpus build and `ayumi demo`."""
