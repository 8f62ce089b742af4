"""Corpus to token shards: readers, cleaning, parallel tokenize-and-pack, the .bin/.idx format, the manifest.

- `prepare.py` (`ayumi data prepare`), `workers.py`, `clean.py`, `sources.py`: corpus in, shards out;
- `shards.py`, `megatron.py`: Megatron's own .bin/.idx format; `manifest.py`, `integrity.py`, `keyset.py`:
  the data root's records and their checks; `register.py`, `token_root.py`: existing Megatron data;
- `packed.py`, `domains.py`: shards as training samples (fixed-length, shuffled, per domain);
- `cli.py`, `inspect.py`: the `ayumi data` commands.

May import: `common`, `tokenizer` (the tokenizer's identity and encoder); never `curriculum` or `pretrain`.
"""
