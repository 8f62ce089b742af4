"""Tests of the data package: readers, cleaning, parallel tokenize-and-pack, splits, manifest."""
