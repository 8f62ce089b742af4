"""ayumi's own Llama: layers, the model, presets, parameter and FLOP counts, the HF import, vocabulary growth and
`model.vocab_size=0` following the tokenizer (vocabulary.py), RoPE and its scalings (rope.py), document masking of packed samples (documents.py), and the tensor-parallel
layout (which weights are cut, and how shards merge back); inductor's cache folder per CPU instruction-set
setting (used when compiling); FP8 training of the blocks' Linear layers (fp8.py, model.fp8).

May import: `pretrain.ranges`, `tokenizer` (vocabulary growth reads SentencePiece models), `data` (a data root's
manifest records its tokenizer's vocabulary), `torchao` (fp8.py, only
when model.fp8 is on); never DeepSpeed.
"""
