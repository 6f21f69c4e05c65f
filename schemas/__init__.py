"""The cache contract. `read_cache(dir_or_url)`: a verified cache (a folder, or s3://, gs://, az://: storage/places.py)
as a polars LazyFrame of its current rows in their logical types; `to_dataset(dir_or_url)`: the same as a
`datasets.Dataset`."""

READERS = ("read_cache", "to_dataset")


def __getattr__(name):
    # the readers re-exported on first use: importing schemas.encoding (every command line) need not load pyarrow
    if name in READERS:
        from . import cache

        return getattr(cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
