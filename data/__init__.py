"""Corpus to token shards: readers, cleaning, parallel tokenize-and-pack, the .bin/.idx format.

Imports `common` and `tokenizer` only; curriculum, pretrain and demo build on it, never the reverse
(the demo corpus is built in demo/).
"""
