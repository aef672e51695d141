"""The smg gateway's worker API (`/workers`), as far as a rolling deploy needs it (UI-free).

smg 1.13.0: `POST /workers` answers 202 and registers in the background (409 when the URL is there);
`GET /workers` lists each worker with `status` (pending, ready, not_ready, failed, draining; the case
varies between releases) and `load`, the gateway's own count of in-flight requests on it; `PATCH
/workers/{id}` takes `{"health": {"drain_settle_secs": T}}`; `DELETE /workers/{id}` marks it draining (out
of selection), sleeps the settle time, then unregisters it, without waiting for its requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from dynctl.base.errors import OperationFailed, UnreachableError, UsageError
from dynctl.base.groups import Gateway
from dynctl.base.httpjson import HttpError, JsonHttp, Response

ROUTED_HEADER = "x-smg-routed-worker-id"  # smg names the worker URL that served a request
TARGET_HEADER = "x-smg-target-worker"
# GET /workers is answered from smg's registry in about a millisecond on a LAN: the waits for a worker to go
# and to be ready look this often, so a rollout moves on within tens of ms of the change.
POLL_S = 0.02


@dataclass
class Worker:
    id: str
    url: str
    status: str  # lower case: ready, pending, not_ready, failed, draining
    load: int | None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Worker":
        status = str(raw.get("status") or ("ready" if raw.get("is_healthy") else "unknown"))
        load = raw.get("load")
        return cls(str(raw.get("id")), str(raw.get("url", "")).rstrip("/"),
                   status.lower().replace("notready", "not_ready"), load if isinstance(load, int) else None)


class GatewayClient:
    """One gateway; every call raises UnreachableError (exit 4) or OperationFailed naming the gateway."""

    def __init__(self, gateway: Gateway, timeout: float = 10.0):
        self.gateway = gateway
        key = gateway.admin_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = JsonHttp(gateway.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kw: Any) -> Response:
        try:
            response = self._http.request(method, path, **kw)
        except HttpError as err:
            raise UnreachableError(f"gateway {self.gateway.url} (group {self.gateway.group}): {method} {path}: "
                                   f"{type(err).__name__}: {err or 'no answer'}") from None
        if response.status_code in (401, 403):
            how = (f"the key in ${self.gateway.admin_key_env}" if self.gateway.admin_key_env
                   else "no key: set admin_key_env in the group to the variable that holds it")
            raise UsageError(f"gateway {self.gateway.url}: {method} {path} refused ({response.status_code}) with "
                             f"{how}; nothing was changed")
        return response

    def workers(self) -> list[Worker]:
        response = self._request("GET", "/workers")
        if response.status_code != 200:
            raise OperationFailed(f"gateway {self.gateway.url}: GET /workers answered {response.status_code}: "
                                  f"{response.text[:200]}")
        try:
            return [Worker.from_json(w) for w in response.json().get("workers", [])]
        except (ValueError, AttributeError) as err:
            raise OperationFailed(f"gateway {self.gateway.url}: GET /workers: not a worker list ({err})") from None

    def find(self, url: str) -> Worker | None:
        url = url.rstrip("/")
        return next((w for w in self.workers() if w.url == url), None)

    def set_drain(self, worker: Worker, seconds: float) -> None:
        response = self._request("PATCH", f"/workers/{worker.id}",
                                 json={"health": {"drain_settle_secs": max(1, int(seconds + 0.999))}})
        if response.status_code >= 300:
            raise OperationFailed(f"gateway {self.gateway.url}: PATCH /workers/{worker.id} (drain time) answered "
                                  f"{response.status_code}: {response.text[:200]}")

    def remove(self, worker: Worker) -> None:
        response = self._request("DELETE", f"/workers/{worker.id}")
        if response.status_code >= 300 and response.status_code != 404:
            raise OperationFailed(f"gateway {self.gateway.url}: DELETE /workers/{worker.id} answered "
                                  f"{response.status_code}: {response.text[:200]}")

    def add(self, url: str) -> None:
        response = self._request("POST", "/workers", json={"url": url})
        if response.status_code not in (200, 201, 202, 409):
            raise OperationFailed(f"gateway {self.gateway.url}: POST /workers {url} answered "
                                  f"{response.status_code}: {response.text[:200]}")

    def wait_gone(self, url: str, deadline: float, poll: float = POLL_S) -> int:
        """Until `url` is no longer listed; returns the last in-flight load seen while it was."""
        last = 0
        while True:
            worker = self.find(url)
            if worker is None:
                return last
            last = worker.load or 0
            if time.monotonic() > deadline:
                raise OperationFailed(f"gateway {self.gateway.url}: {url} still listed ({worker.status}, load "
                                      f"{worker.load}) when the drain time was over")
            time.sleep(poll)

    def wait_ready(self, url: str, deadline: float, poll: float = POLL_S) -> Worker:
        while True:
            worker = self.find(url)
            if worker is not None and worker.status == "ready":
                return worker
            if worker is not None and worker.status == "failed":
                raise OperationFailed(f"gateway {self.gateway.url}: {url} registered as failed")
            if time.monotonic() > deadline:
                state = worker.status if worker else "not listed"
                raise OperationFailed(f"gateway {self.gateway.url}: {url} not ready in time ({state})")
            time.sleep(poll)

    def probe(self, url: str, attempts: int = 8) -> str | None:
        """One small /generate through the gateway (asking for `url`); the worker that served it, when named."""
        routed = None
        for i in range(attempts):
            try:
                response = self._http.post("/generate", headers={TARGET_HEADER: url},
                                           json={"text": f"dynctl rollout probe {i}",
                                                 "sampling_params": {"max_new_tokens": 1}})
            except HttpError as err:
                raise OperationFailed(f"gateway {self.gateway.url}: a request through it failed: {err}") from None
            if response.status_code != 200:
                raise OperationFailed(f"gateway {self.gateway.url}: a request through it answered "
                                      f"{response.status_code}: {response.text[:200]}")
            routed = response.headers.get(ROUTED_HEADER, "").rstrip("/") or None
            if routed is None or routed == url:
                return routed
        return routed
