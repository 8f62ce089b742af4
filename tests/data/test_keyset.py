"""KeySet: the de-duplication set at 16 bytes per key, against a plain Python set."""
import numpy as np

from data.keyset import KeySet


def rows(values: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(values), dtype=np.uint8).reshape(-1, 16)


def test_add_new_agrees_with_a_python_set_over_many_chunks():
    rng = np.random.default_rng(0)
    universe = [bytes(row) for row in rng.integers(0, 256, size=(3000, 16), dtype=np.uint8)]
    # Keys that share their first 8 bytes and differ after: the rare tie the runs must settle.
    twins = [universe[0][:8] + bytes(8 * [value]) for value in range(1, 6)]
    universe += twins
    keys, reference = KeySet(), set()
    for _ in range(400):
        chunk = list({universe[i] for i in rng.integers(0, len(universe), size=rng.integers(1, 40))})
        if rng.random() < 0.1:
            chunk = list(dict.fromkeys(chunk + twins))  # distinct within a chunk, as workers send them
        new = keys.add_new(rows(chunk))
        assert new.tolist() == [key not in reference for key in chunk]
        reference.update(chunk)
    assert keys.size == len(reference)
    assert keys.contains(rows(universe)).tolist() == [key in reference for key in universe]
    assert keys.nbytes == 16 * keys.size, "16 bytes per key"
    assert keys.runs <= 2 * int(np.log2(keys.size)) + 1, "runs are merged as they grow"


def test_empty_chunk_and_first_insert():
    keys = KeySet()
    assert keys.add_new(rows([])).tolist() == []
    assert keys.add_new(rows([b"a" * 16, b"b" * 16])).tolist() == [True, True]
    assert keys.add_new(rows([b"b" * 16, b"c" * 16])).tolist() == [False, True]
