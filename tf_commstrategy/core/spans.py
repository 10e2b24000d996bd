"""Several 1-D arrays of one dtype seen as one concatenation, without concatenating them.

A fused all-reduce of a gradient list reads the gradients where they are and writes the results
where they go: ``core.ring`` cuts its chunks at the arrays' boundaries (``cuts``), so every slice it
takes, ``spans[a:b]``, lies inside one array and is a view of it. ``read_into`` / ``write_from``
copy any range, across boundaries.
"""

from __future__ import annotations

import bisect
from typing import List, Sequence

import numpy as np


class Spans:
    """The concatenation of ``arrays`` (one dtype, C-contiguous), by reference.

    Args:
      arrays: the arrays, in order; each is used through a flat view.
    """

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = [a.reshape(-1) for a in arrays]
        self.starts = [0]
        for a in self.arrays:
            self.starts.append(self.starts[-1] + a.size)
        self.size = self.starts[-1]
        self.dtype = self.arrays[0].dtype if self.arrays else np.dtype(np.uint8)
        self.nbytes = self.size * self.dtype.itemsize

    @property
    def cuts(self) -> List[int]:
        """The offsets where one array ends and the next begins."""
        return self.starts[1:-1]

    def _locate(self, key: slice):
        lo, hi, step = key.indices(self.size)
        if step != 1:
            raise IndexError("Spans take contiguous slices only")
        if hi <= lo:
            return self.arrays[0] if self.arrays else np.empty(0, self.dtype), 0, 0
        i = bisect.bisect_right(self.starts, lo) - 1
        if hi > self.starts[i + 1]:
            raise IndexError(f"slice [{lo}:{hi}] crosses the boundary at {self.starts[i + 1]}; cut chunks at "
                             "Spans.cuts")
        return self.arrays[i], lo - self.starts[i], hi - self.starts[i]

    def __getitem__(self, key: slice) -> np.ndarray:
        a, lo, hi = self._locate(key)
        return a[lo:hi]

    def __setitem__(self, key: slice, value) -> None:
        a, lo, hi = self._locate(key)
        a[lo:hi] = value

    def _pieces(self, lo: int, hi: int):
        i = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi and i < len(self.arrays):
            take = min(hi, self.starts[i + 1]) - lo
            if take > 0:
                yield self.arrays[i], lo - self.starts[i], take
                lo += take
            i += 1

    def read_into(self, dst: np.ndarray, lo: int, hi: int) -> None:
        """``dst[0 : hi - lo] = concatenation[lo:hi]``."""
        at = 0
        for a, off, n in self._pieces(lo, hi):
            dst[at:at + n] = a[off:off + n]
            at += n

    def write_from(self, src: np.ndarray, lo: int, hi: int) -> None:
        """``concatenation[lo:hi] = src[0 : hi - lo]``."""
        at = 0
        for a, off, n in self._pieces(lo, hi):
            a[off:off + n] = src[at:at + n]
            at += n

    def shares_memory(self, other: "Spans") -> bool:
        """Any of these arrays overlaps any of ``other``'s (exact for contiguous arrays, whose memory is
        one range: only the bounds are compared, ``np.shares_memory`` would solve for every pair)."""
        return any(np.may_share_memory(a, b) for a in self.arrays for b in other.arrays)
