"""The coordinator: a small key-value store with blocking gets and named barriers, hosted by rank 0.

Wire format: JSON objects as raw bytes (control traffic is tiny; data never goes through here).
Blocking calls wait on the server for at most ``wait_s`` (capped), the client loops until its own
deadline, so no call on either side waits without a bound.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Dict, Optional

import grpc

from ..core import grpc_util
from ..errors import RendezvousError

log = logging.getLogger("tf_commstrategy")
SERVICE = "Coordinator"
MAX_SERVER_WAIT_S = 5.0
MAX_KEY_CHARS = 512


class _Store:
    def __init__(self):
        self._cv = threading.Condition()
        self._kv: Dict[str, str] = {}
        self._barriers: Dict[str, set] = {}
        self._closed = False

    def close(self) -> None:
        """Wake every blocked get/barrier (the server is stopping: its handler threads must not linger)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def set(self, key: str, value: str) -> None:
        with self._cv:
            self._kv[key] = value
            self._cv.notify_all()

    def get(self, keys, wait_s: float):
        """The first of ``keys`` that is set, as (key, value), waiting up to ``wait_s``; (None, None) if none."""
        end = time.monotonic() + min(max(wait_s, 0.0), MAX_SERVER_WAIT_S)
        with self._cv:
            while True:
                for key in keys:
                    if key in self._kv:
                        return key, self._kv[key]
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    return None, None
                self._cv.wait(left)

    def add(self, key: str, amount: int) -> int:
        with self._cv:
            value = int(self._kv.get(key, "0")) + amount
            self._kv[key] = str(value)
            self._cv.notify_all()
            return value

    def barrier(self, name: str, rank: int, world: int, wait_s: float):
        end = time.monotonic() + min(max(wait_s, 0.0), MAX_SERVER_WAIT_S)
        with self._cv:
            arrived = self._barriers.setdefault(name, set())
            arrived.add(rank)
            self._cv.notify_all()
            while len(arrived) < world:
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    return False, sorted(arrived)
                self._cv.wait(left)
            return True, sorted(arrived)


class CoordinatorServer:
    """Rank 0's coordinator service. ``address`` is where it listens ('host:port').

    Args:
      bind: "host:port" to listen on.
      world_size: number of workers (sizes the server's thread pool; barriers check it).
      token: the job token every call must carry (None: no check).

    Attributes:
      port: the port it listens on.

    Raises:
      RendezvousError: the address cannot be bound.
    """

    def __init__(self, bind: str, world_size: int, token: Optional[str] = None, tls=None):
        self._store = _Store()
        self._world = world_size
        self._bad_logged = False
        handlers = {
            "Set": ("unary", self._checked(self._set)),
            "Get": ("unary", self._checked(self._get)),
            "Add": ("unary", self._checked(self._add)),
            "Barrier": ("unary", self._checked(self._barrier)),
        }
        # Every worker may hold one blocking call at a time, plus headroom.
        self._server, self.port = grpc_util.start_server(SERVICE, handlers, bind, token,
                                                         max_workers=2 * world_size + 8, tls=tls)

    def _checked(self, handler):
        """Malformed requests (bad JSON, missing or mistyped fields, ranks out of range, oversized keys)
        get INVALID_ARGUMENT, logged once; the store is left untouched."""
        def call(request, context):
            try:
                r = json.loads(request)
                if not isinstance(r, dict):
                    raise ValueError("request is not a JSON object")
                return handler(r, context)
            except (ValueError, KeyError, TypeError, OverflowError) as e:
                if not self._bad_logged:
                    self._bad_logged = True
                    log.warning("tf_commstrategy coordinator: rejected a malformed request (%s: %s); further "
                                "ones are not logged", type(e).__name__, e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed coordinator request: {e}")
        return call

    @staticmethod
    def _key(r, name="key") -> str:
        k = r[name]
        if not isinstance(k, str) or not 0 < len(k) <= MAX_KEY_CHARS:
            raise ValueError(f"{name} must be a string of 1..{MAX_KEY_CHARS} characters")
        return k

    @staticmethod
    def _wait(r) -> float:
        w = float(r.get("wait_s", 0))
        if not 0 <= w <= MAX_SERVER_WAIT_S + 1:
            raise ValueError(f"wait_s={w} outside 0..{MAX_SERVER_WAIT_S}")
        return w

    def stop(self, grace: float = 0.2) -> None:
        """Stop serving; calls in flight get ``grace`` seconds to finish.

        Args:
          grace: seconds.
        """
        self._store.close()  # blocked gets/barriers return now, so no handler thread outlives the server
        self._server.stop(grace).wait(grace + 1.0)

    def _set(self, r, context):
        value = r["value"]
        if not isinstance(value, str):
            raise TypeError("value must be a string")
        self._store.set(self._key(r), value)
        return b"{}"

    def _get(self, r, context):
        keys = [self._key(r)] + ([self._key(r, "or_key")] if r.get("or_key") is not None else [])
        key, value = self._store.get(keys, self._wait(r))
        return json.dumps({"found": value is not None, "key": key, "value": value}).encode()

    def _add(self, r, context):
        amount = r["amount"]
        if not isinstance(amount, int) or isinstance(amount, bool) or abs(amount) > 1 << 31:
            raise TypeError("amount must be an int of at most 2**31")
        return json.dumps({"value": self._store.add(self._key(r), amount)}).encode()

    def _barrier(self, r, context):
        rank, world = r["rank"], r["world"]
        if not (isinstance(rank, int) and isinstance(world, int) and world == self._world and 0 <= rank < world):
            raise ValueError(f"barrier rank={rank!r} world={world!r} do not fit this job of {self._world}")
        done, arrived = self._store.barrier(self._key(r, "name"), rank, world, self._wait(r))
        return json.dumps({"done": done, "arrived": arrived}).encode()


class CoordinatorClient:
    """Client of the coordinator. Every method takes a deadline and raises RendezvousError past it.

    Args:
      address: the coordinator's "host:port".
      rank: this worker's rank (for barriers and messages).
      token: the job token to send with every call.
    """

    def __init__(self, address: str, rank: int, token: Optional[str] = None, tls=None):
        self.address = address
        self.rank = rank
        self._channel = grpc_util.open_channel(address, tls=tls)
        self._md = grpc_util.call_metadata(token)
        self._calls = {m: grpc_util.unary(self._channel, SERVICE, m) for m in ("Set", "Get", "Add", "Barrier")}

    def wait_ready(self, timeout: float) -> None:
        """Wait until the coordinator answers.

        Args:
          timeout: seconds.

        Raises:
          RendezvousError: it could not be reached in time.
        """
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise RendezvousError(
                f"could not reach the coordinator at {self.address} within {timeout:.0f} s",
                rank=self.rank, address=self.address,
                fix="check that rank 0 is running and that TFCS_COORDINATOR (or the launcher's "
                    "host:port) names rank 0's host and a port open between the hosts; raise "
                    "TFCS_RENDEZVOUS_TIMEOUT if rank 0 starts late") from None

    def _call(self, method: str, payload: dict, timeout: float) -> dict:
        try:
            raw = self._calls[method](json.dumps(payload).encode(), timeout=timeout, metadata=self._md)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise RendezvousError(f"the coordinator at {self.address} rejected this worker's job token",
                                      rank=self.rank, address=self.address,
                                      fix="give every worker the same TFCS_TOKEN") from None
            raise RendezvousError(f"coordinator call {method} to {self.address} failed: {code} "
                                  f"{e.details() if hasattr(e, 'details') else e}",
                                  rank=self.rank, address=self.address,
                                  fix="rank 0 (which hosts the coordinator) may have exited; see its log"
                                  ) from None
        return json.loads(raw)

    def set(self, key: str, value: str, timeout: float = 30.0) -> None:
        """Store ``value`` under ``key`` (waking up whoever waits for it).

        Args:
          key: the key.
          value: the value.
          timeout: seconds for the call.

        Raises:
          RendezvousError: the call failed, or the job token was rejected.
        """
        self._call("Set", {"key": key, "value": value}, timeout)

    def add(self, key: str, amount: int = 1, timeout: float = 30.0) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (0 if absent).

        Args:
          key: the key.
          amount: what to add.
          timeout: seconds for the call.

        Returns:
          The new value.

        Raises:
          RendezvousError: the call failed, or the job token was rejected.
        """
        return int(self._call("Add", {"key": key, "amount": amount}, timeout)["value"])

    def get(self, key: str, timeout: float) -> str:
        """The value under ``key``, waiting up to ``timeout`` seconds for it to be set.

        Args:
          key: the key.
          timeout: seconds to wait.

        Returns:
          The value.

        Raises:
          RendezvousError: the key did not appear in time, or a call failed.
        """
        return self.get_either(key, None, timeout)[1]

    def get_either(self, key: str, or_key: Optional[str], timeout: float):
        """Whichever of ``key`` and ``or_key`` is set first, waiting up to ``timeout`` seconds.

        Args:
          key: the key waited for.
          or_key: a second key (say, one that announces a failure) that ends the wait too; None: only ``key``.
          timeout: seconds to wait.

        Returns:
          (the key found, its value); ``key`` wins when both are set.

        Raises:
          RendezvousError: neither key appeared in time, or a call failed.
        """
        end = time.monotonic() + timeout
        payload = {"key": key} if or_key is None else {"key": key, "or_key": or_key}
        while True:
            left = end - time.monotonic()
            wait = max(0.0, min(left, MAX_SERVER_WAIT_S))
            r = self._call("Get", dict(payload, wait_s=wait), timeout=wait + 10.0)
            if r["found"]:
                return r.get("key", key), r["value"]
            if time.monotonic() >= end:
                raise RendezvousError(f"key {key!r} did not appear in the coordinator at {self.address} "
                                      f"within {timeout:.0f} s", rank=self.rank, address=self.address,
                                      fix="a worker did not start or crashed before publishing; check every "
                                          "rank's log and that all ranks use the same world size")

    def try_get(self, key: str, timeout: float = 10.0) -> Optional[str]:
        """The value under ``key`` now, or None when it is not set (no waiting for it).

        Args:
          key: the key.
          timeout: seconds for the call.

        Returns:
          The value, or None.

        Raises:
          RendezvousError: the call failed (the coordinator is gone), or the job token was rejected.
        """
        r = self._call("Get", {"key": key, "wait_s": 0.0}, timeout=timeout)
        return r["value"] if r["found"] else None

    def barrier(self, name: str, world: int, timeout: float) -> None:
        """Return once ``world`` ranks have entered the barrier ``name``.

        Args:
          name: the barrier's name (each name is one barrier).
          world: how many ranks must arrive.
          timeout: seconds to wait.

        Raises:
          RendezvousError: not every rank arrived in time (the message names the missing ones).
        """
        end = time.monotonic() + timeout
        arrived = []
        while True:
            left = end - time.monotonic()
            wait = max(0.0, min(left, MAX_SERVER_WAIT_S))
            r = self._call("Barrier", {"name": name, "rank": self.rank, "world": world, "wait_s": wait},
                           timeout=wait + 10.0)
            if r["done"]:
                return
            arrived = r["arrived"]
            if time.monotonic() >= end:
                missing = sorted(set(range(world)) - set(arrived))
                raise RendezvousError(f"barrier {name!r} timed out after {timeout:.0f} s: ranks {missing} "
                                      f"never arrived (arrived: {arrived})", rank=self.rank,
                                      address=self.address,
                                      fix="those ranks were not started, crashed, or are stuck; see their logs")

    def close(self) -> None:
        """Close the channel to the coordinator."""
        self._channel.close()
