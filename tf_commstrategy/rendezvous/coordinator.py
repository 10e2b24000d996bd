"""The coordinator: a small key-value store with blocking gets and named barriers, hosted by rank 0.

Wire format: JSON objects as raw bytes (control traffic is tiny; data never goes through here).
Blocking calls wait on the server for at most ``wait_s`` (capped), the client loops until its own
deadline, so no call on either side waits without a bound.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Dict, Optional

import grpc

from ..core import grpc_util
from ..errors import RendezvousError

SERVICE = "Coordinator"
MAX_SERVER_WAIT_S = 5.0


class _Store:
    def __init__(self):
        self._cv = threading.Condition()
        self._kv: Dict[str, str] = {}
        self._barriers: Dict[str, set] = {}

    def set(self, key: str, value: str) -> None:
        with self._cv:
            self._kv[key] = value
            self._cv.notify_all()

    def get(self, key: str, wait_s: float) -> Optional[str]:
        end = time.monotonic() + min(max(wait_s, 0.0), MAX_SERVER_WAIT_S)
        with self._cv:
            while key not in self._kv:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            return self._kv[key]

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
                if left <= 0:
                    return False, sorted(arrived)
                self._cv.wait(left)
            return True, sorted(arrived)


class CoordinatorServer:
    """Rank 0's coordinator service. ``address`` is where it listens ('host:port')."""

    def __init__(self, bind: str, world_size: int, token: Optional[str] = None):
        self._store = _Store()
        handlers = {
            "Set": ("unary", self._set),
            "Get": ("unary", self._get),
            "Add": ("unary", self._add),
            "Barrier": ("unary", self._barrier),
        }
        # Every worker may hold one blocking call at a time, plus headroom.
        self._server, self.port = grpc_util.start_server(SERVICE, handlers, bind, token,
                                                         max_workers=2 * world_size + 8)

    def stop(self, grace: float = 0.2) -> None:
        self._server.stop(grace).wait(grace + 1.0)

    @staticmethod
    def _parse(request: bytes, context):
        try:
            return json.loads(request)
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed coordinator request")

    def _set(self, request, context):
        r = self._parse(request, context)
        self._store.set(str(r["key"]), str(r["value"]))
        return b"{}"

    def _get(self, request, context):
        r = self._parse(request, context)
        value = self._store.get(str(r["key"]), float(r.get("wait_s", 0)))
        return json.dumps({"found": value is not None, "value": value}).encode()

    def _add(self, request, context):
        r = self._parse(request, context)
        return json.dumps({"value": self._store.add(str(r["key"]), int(r["amount"]))}).encode()

    def _barrier(self, request, context):
        r = self._parse(request, context)
        done, arrived = self._store.barrier(str(r["name"]), int(r["rank"]), int(r["world"]),
                                            float(r.get("wait_s", 0)))
        return json.dumps({"done": done, "arrived": arrived}).encode()


class CoordinatorClient:
    """Client of the coordinator. Every method takes a deadline and raises RendezvousError past it."""

    def __init__(self, address: str, rank: int, token: Optional[str] = None):
        self.address = address
        self.rank = rank
        self._channel = grpc_util.open_channel(address)
        self._md = grpc_util.call_metadata(token)
        self._calls = {m: grpc_util.unary(self._channel, SERVICE, m) for m in ("Set", "Get", "Add", "Barrier")}

    def wait_ready(self, timeout: float) -> None:
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
        self._call("Set", {"key": key, "value": value}, timeout)

    def add(self, key: str, amount: int = 1, timeout: float = 30.0) -> int:
        return int(self._call("Add", {"key": key, "amount": amount}, timeout)["value"])

    def get(self, key: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            wait = max(0.0, min(left, MAX_SERVER_WAIT_S))
            r = self._call("Get", {"key": key, "wait_s": wait}, timeout=wait + 10.0)
            if r["found"]:
                return r["value"]
            if time.monotonic() >= end:
                raise RendezvousError(f"key {key!r} did not appear in the coordinator at {self.address} "
                                      f"within {timeout:.0f} s", rank=self.rank, address=self.address,
                                      fix="a worker did not start or crashed before publishing; check every "
                                          "rank's log and that all ranks use the same world size")

    def barrier(self, name: str, world: int, timeout: float) -> None:
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
        self._channel.close()
