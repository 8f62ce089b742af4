"""A set of 16-byte content keys that costs 16 bytes per key: the memory behind exact de-duplication.

A Python set of 16-byte `bytes` costs ~83 bytes per key (object header, hash slot, spare room),
so de-duplicating a web-crawl domain of 100 M documents took ~8 GB in the parent process. Here
the keys live in a few sorted runs of two uint64 columns (the key's first and last 8 bytes,
big-endian), merged as they grow (a log-structured merge): 16 bytes per key, plus a transient
copy of the runs being merged. Lookups and inserts take a whole chunk of keys at once.

The first 8 bytes order the runs; blake2b output is uniform, so two different keys share them
with probability ~2^-64 per pair, and those rare ties are settled by comparing the last 8 bytes.
"""
from __future__ import annotations

import numpy as np


def split_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first 8 bytes, last 8 bytes) of each row of an (n, 16) uint8 array, as big-endian uint64."""
    halves = np.ascontiguousarray(keys).view(">u8")
    return halves[:, 0].astype(np.uint64), halves[:, 1].astype(np.uint64)


class KeySet:
    """Sorted runs of (high, low) uint64 pairs; `add_new` is the only operation a de-duplicator needs."""

    def __init__(self):
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # each sorted by its high column
        self.size = 0

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """For (n, 16) uint8 keys: a bool per row, True where the key is in the set."""
        high, low = split_keys(keys)
        order = np.argsort(high, kind="stable")
        return self._contains_sorted(high[order], low[order])[np.argsort(order)]

    def _contains_sorted(self, high: np.ndarray, low: np.ndarray) -> np.ndarray:
        """`contains` for keys already sorted by their high half: searching sorted needles walks
        each run in one direction, several times faster than random probes into a large array."""
        found = np.zeros(len(high), dtype=bool)
        for run_high, run_low in self._runs:
            at = np.minimum(np.searchsorted(run_high, high), len(run_high) - 1)
            same_high = run_high[at] == high
            hit = same_high & (run_low[at] == low)
            # The first entry with this high half is another key: look at the others (~never taken).
            for row in np.flatnonzero(same_high & ~hit):
                position = at[row] + 1
                while position < len(run_high) and run_high[position] == high[row]:
                    if run_low[position] == low[row]:
                        hit[row] = True
                        break
                    position += 1
            found |= hit
        return found

    def add_new(self, keys: np.ndarray) -> np.ndarray:
        """Add the rows not yet in the set; returns a bool per row, True where it was new.

        The rows must be distinct among themselves (a chunk the worker already de-duplicated).
        """
        high, low = split_keys(keys)
        order = np.argsort(high, kind="stable")
        high, low = high[order], low[order]
        new_sorted = ~self._contains_sorted(high, low)
        if new_sorted.any():
            self._runs.append((high[new_sorted], low[new_sorted]))
            self.size += int(new_sorted.sum())
            self._compact()
        new = np.empty(len(order), dtype=bool)
        new[order] = new_sorted
        return new

    def _compact(self) -> None:
        """Merge the newest runs while the older one is at most twice as large: O(log n) runs."""
        while len(self._runs) >= 2 and len(self._runs[-2][0]) <= 2 * len(self._runs[-1][0]):
            newer = self._runs.pop()
            older = self._runs.pop()
            self._runs.append(_merge(older, newer))

    @property
    def runs(self) -> int:
        return len(self._runs)

    @property
    def nbytes(self) -> int:
        return sum(high.nbytes + low.nbytes for high, low in self._runs)


def _merge(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Two runs sorted by their high column as one. NumPy's stable sort is a timsort for 64-bit
    integers: it finds the two sorted runs and merges them in linear time."""
    high = np.concatenate([a[0], b[0]])
    order = high.argsort(kind="stable")
    return high[order], np.concatenate([a[1], b[1]])[order]
