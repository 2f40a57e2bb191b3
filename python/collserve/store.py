"""A client of the coordinator's key-value store, with torch.distributed.Store semantics
(torch/csrc/distributed/c10d/Store.hpp): set, get, add, compare_set, wait, check,
delete_key, num_keys, multi_get, multi_set, append.

Keys are str; values str or bytes (stored as bytes; get returns bytes). Keys live in a
job's namespace (COLLSERVE_JOB, default "default"), shared with the job's ranks. Errors:
DistStoreTimeoutError (a get/wait timed out; the message names the keys), DistNetworkError
(the coordinator is unreachable), DistStoreError (anything else, e.g. add on a value that
is not an integer). Thread-safe.
"""
import datetime as _datetime
import os as _os

from . import _collserve
from .errors import raise_for_store


def _seconds(timeout):
    if isinstance(timeout, _datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _b(value):
    return value.encode() if isinstance(value, str) else bytes(value)


class Store:
    """Store(host, port) or Store(address="host:port"): connects to a collserve coordinator.

    timeout (timedelta or seconds, default 300 s) is how long get/wait/multi_get wait for
    missing keys; connecting waits up to connect_timeout (default 30 s). token: the job's (or
    the admin) token sent with every call (default: COLLSERVE_TOKEN, else the file named by
    COLLSERVE_TOKEN_FILE; docs/security.md); a refused one raises DistAuthError.
    """

    def __init__(self, host=None, port=None, *, address=None, job=None, timeout=_datetime.timedelta(seconds=300),
                 connect_timeout=_datetime.timedelta(seconds=30), token=None):
        if address is None:
            if host is None or port is None:
                raise ValueError("Store needs host and port, or address='host:port'")
            address = f"{host}:{int(port)}"
        self._timeout = _seconds(timeout)
        code, message, client = _collserve.connect_store(address, job or _os.environ.get("COLLSERVE_JOB", ""),
                                                         self._timeout, _seconds(connect_timeout), token or "")
        raise_for_store(code, message)
        self._client = client

    @classmethod
    def _wrap(cls, client, timeout=300.0):
        s = cls.__new__(cls)
        s._client, s._timeout = client, timeout
        return s

    @property
    def timeout(self):
        return _datetime.timedelta(seconds=self._timeout)

    def set_timeout(self, timeout):
        """Sets the default timeout of get/wait/multi_get."""
        self._timeout = _seconds(timeout)

    def set(self, key, value):
        raise_for_store(*self._client.set(key, _b(value)))

    def get(self, key):
        """The value of `key` (bytes), waiting up to the timeout for it to be set."""
        code, message, value = self._client.get(key, self._timeout)
        raise_for_store(code, message)
        return value

    def add(self, key, amount):
        """Adds `amount` to the integer at `key` (created as 0) and returns the new value."""
        code, message, value = self._client.add(key, int(amount))
        raise_for_store(code, message)
        return value

    def compare_set(self, key, expected_value, desired_value):
        """Sets `key` to desired_value if it holds expected_value (or is missing and
        expected_value is empty); returns the value it holds afterwards."""
        code, message, value = self._client.compare_set(key, _b(expected_value), _b(desired_value))
        raise_for_store(code, message)
        return value

    def wait(self, keys, timeout=None):
        """Waits until every key is set, up to `timeout` (default: the store's)."""
        raise_for_store(*self._client.wait(list(keys), self._timeout if timeout is None else _seconds(timeout)))

    def check(self, keys):
        """True if every key is set (does not wait)."""
        code, message, value = self._client.check(list(keys))
        raise_for_store(code, message)
        return value

    def delete_key(self, key):
        """Deletes `key`; True if it existed."""
        code, message, value = self._client.delete_key(key)
        raise_for_store(code, message)
        return value

    def delete_keys_with_prefix(self, prefix):
        """Deletes the job's keys that start with `prefix` (not empty: ValueError) and returns
        how many it deleted, a page of 1000 at a time; not atomic (a key set meanwhile may
        stay). collserve's own, not torch's Store API (collservectl delete-keys does the same)."""
        if not prefix:
            raise ValueError("delete_keys_with_prefix: the prefix may not be empty")
        code, message, value = self._client.delete_keys_with_prefix(prefix)
        raise_for_store(code, message)
        return value

    def num_keys(self):
        """The number of keys in the job's namespace."""
        code, message, value = self._client.num_keys("")
        raise_for_store(code, message)
        return value

    def multi_get(self, keys):
        """The values of `keys` (bytes), waiting up to the timeout for all of them."""
        code, message, value = self._client.multi_get(list(keys), self._timeout)
        raise_for_store(code, message)
        return value

    def multi_set(self, keys, values):
        keys, values = list(keys), [_b(v) for v in values]
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        raise_for_store(*self._client.multi_set(keys, values))

    def append(self, key, value):
        """Appends `value` to the value at `key` (created if missing)."""
        raise_for_store(*self._client.append(key, _b(value)))
