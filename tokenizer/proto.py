"""SentencePiece's model protobuf (`ModelProto`), loaded on first use: the merge, the mixture's pruning, the
vocabulary expansion and the HF export edit models through it."""
from __future__ import annotations


def pb():
    """sentencepiece's generated protobuf module (imported lazily: sentencepiece loads protobuf on import)."""
    from sentencepiece import sentencepiece_model_pb2

    return sentencepiece_model_pb2
