"""The cache contract. `read_cache(dir_or_url)`: a verified cache (a folder, or s3://, gs://, az://: schemas/store.py)
as a polars LazyFrame."""


def __getattr__(name):
    # read_cache re-exported on first use: importing schemas.encoding (every command line) need not load pyarrow
    if name == "read_cache":
        from .cache import read_cache

        return read_cache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
