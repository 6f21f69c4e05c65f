"""When the store itself is the problem, not a cache on it: its endpoint cannot be reached, the bucket does not
exist, there are no credentials or access is denied. Every call a job makes on a store's filesystem goes through
`Guarded`, so no caller takes an unreachable endpoint for a missing object or a crash."""

from __future__ import annotations

import errno
import functools
import socket

BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")  # a URL's first part is a bucket (container)
ENDPOINT = {"s3": "AWS_ENDPOINT_URL, ~/.aws/config", "gs": "STORAGE_EMULATOR_HOST, the gcloud config",
            "az": "AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_CONNECTION_STRING"}
UNREACHABLE = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT,
               errno.EHOSTDOWN}
# the store clients' "no credentials at all" errors, by class name (botocore's, google-auth's, azure-identity's), so
# that no driver need be imported to classify them
NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
                  "CredentialUnavailableError"}


class StoreUnavailable(Exception):
    """The store itself is the problem, not a cache on it: its endpoint cannot be reached, the bucket does not
    exist, or access is denied. Not a CacheError (no rule of a cache judged it; audit-ref fails no check on it) and
    not an OSError (the handlers of a missing file must not take it for one): a command stops with the cause and the
    remedy (exit 2)."""

    def __init__(self, kind: str, message: str, remedy: str):
        self.kind, self.message, self.remedy = kind, message, remedy
        super().__init__(f"{message}\n  remedy:   {remedy}")


def settings(protocol: str) -> str:
    """Where a store's endpoint and credentials are set, for a remedy."""
    return ENDPOINT.get({"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "adl": "az"}.get(protocol, protocol),
                        "the store's own settings")


def store_fault(url: str, protocol: str, error: BaseException) -> StoreUnavailable | None:
    """The store fault behind `error` (anywhere in its chain), or None: an endpoint that cannot be reached
    (connection refused or reset, no route, a name that does not resolve, a timeout: by exception type and errno,
    botocore's and aiohttp's included), no credentials at all, or access denied."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        kind = type(e)
        names = {c.__name__ for c in kind.__mro__}
        if (isinstance(e, (ConnectionError, TimeoutError, socket.gaierror))
                or isinstance(e, OSError) and e.errno in UNREACHABLE
                or names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                            "ServerTimeoutError", "ClientConnectorError"}):
            detail = " ".join(str(e).split())[:300] or kind.__name__
            return StoreUnavailable(
                "unreachable", f"{url}: the store cannot be reached ({detail})",
                f"check the endpoint and the network ({settings(protocol)}), then re-run the same command")
        if names & NO_CREDENTIALS:
            detail = " ".join(str(e).split())[:300] or kind.__name__
            return StoreUnavailable(
                "no_credentials", f"{url}: no credentials for the store were found ({detail})",
                f"give this process the store's credentials ({settings(protocol)}), then re-run the same command")
        if isinstance(e, PermissionError):
            detail = " ".join(str(e).split())[:300] or kind.__name__
            return StoreUnavailable(
                "denied", f"{url}: the store refused access ({detail})",
                f"check the credentials and their permissions on this bucket and prefix ({settings(protocol)})")
        e = e.__cause__ or e.__context__
    return None


class Guarded:
    """A session's filesystem: every call that fails because of the store itself (store_fault) raises
    StoreUnavailable, so no caller takes an unreachable endpoint for a missing object or a crash."""

    def __init__(self, fs, url: str, protocol: str):
        self._fs, self._url, self._protocol = fs, url, protocol

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except Exception as e:
                fault = store_fault(self._url, self._protocol, e)
                if fault is None:
                    raise
                raise fault from e

        return call


def missing_bucket(root) -> StoreUnavailable | None:
    """A bucket (container) that does not exist on the store, or None (it exists, or the store has no buckets).
    `root`: a storage.places.StorePath."""
    if root._s.protocol not in BUCKETED:
        return None
    bucket = root.key.split("/", 1)[0]
    try:
        root.fs.info(bucket)
    except FileNotFoundError:
        return StoreUnavailable(
            "no_bucket", f"{root.url}: the bucket {bucket!r} does not exist on this store",
            f"check the URL's bucket name (and the endpoint: {settings(root._s.protocol)}), or create the bucket "
            "first; refcache makes prefixes, never buckets")
    except StoreUnavailable:
        raise
    except Exception:  # e.g. no permission to look at the bucket itself: nothing to say about it here
        return None
    return None
