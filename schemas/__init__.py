"""The cache contract. `read_cache(dir)`: a verified cache as a polars LazyFrame."""

from .format import read_cache  # noqa: F401  (re-exported)
