"""Corpus to token shards: readers, cleaning, parallel tokenize-and-pack, the .bin/.idx format."""
