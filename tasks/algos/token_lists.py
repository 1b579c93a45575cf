"""Response-token list columns as flat buffers: Arrow's layout of one values buffer plus N+1 offsets, which
numpy and compiled loops read without a copy and which turn back into List columns without one. Pure: no I/O."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa


def flat_lists(column: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a List column: response i's tokens are values[offsets[i]:offsets[i+1]].
    A null list counts as an empty one."""
    if column.null_count():
        column = column.fill_null(pl.lit([], dtype=column.dtype))
    arr = column.rechunk().to_arrow()
    offsets = arr.offsets.to_numpy().astype(np.int64, copy=False)
    values = arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]  # a sliced array starts past 0
    return values, offsets - offsets[0]


def from_flat(name: str, values: np.ndarray, offsets: np.ndarray) -> pl.Series:
    """A List(Float32) column over `offsets`, the inverse of flat_lists (no copy of the values)."""
    lists = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.float32, copy=False)))
    return pl.Series(name, lists)


def offsets_of(lengths: pl.Series) -> np.ndarray:
    """N+1 offsets from N list lengths (a null length counts as 0)."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths.fill_null(0).to_numpy(), out=offsets[1:])
    return offsets
