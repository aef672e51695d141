"""A small HTTP/1.1 client on the standard library, for the JSON APIs dynctl calls itself (a fleet's gateway).

One kept-alive connection per client and thread (a rollout's hosts call the gateway from threads of
their own), no proxies (the URLs are the operator's own hosts, named in the config), every failure to
get an answer raised as `HttpError`. A connection the server closed while it
was idle is opened again once.
"""

from __future__ import annotations

import http.client
import json as jsonlib
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class HttpError(Exception):
    """No answer: refused, reset, timed out, or not HTTP."""


@dataclass
class Response:
    status_code: int
    headers: dict[str, str]  # names in lower case
    text: str

    def json(self) -> Any:
        return jsonlib.loads(self.text)


class JsonHttp:
    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 10.0):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self._headers = dict(headers or {})
        self._timeout = timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = self._local.conn = cls(self._host, self._port, timeout=self._timeout)
            with self._lock:
                self._open.add(conn)
        return conn

    def _drop(self) -> None:
        """This thread's connection closed (its next request opens another)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _send(self, method: str, path: str, json: Any, headers: dict[str, str] | None) -> http.client.HTTPResponse:
        sent = dict(self._headers, **(headers or {}))
        body = None
        if json is not None:
            body = jsonlib.dumps(json).encode()
            sent["Content-Type"] = "application/json"
        for attempt in (1, 2):
            conn = self._connection()
            try:
                conn.request(method, self._prefix + path, body=body, headers=sent)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as err:
                self._drop()
                if attempt == 2:
                    raise HttpError(f"{type(err).__name__}: {err}") from None
            except (OSError, http.client.HTTPException) as err:
                self._drop()
                raise HttpError(f"{type(err).__name__}: {err or 'no answer'}") from None
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, json: Any = None, headers: dict[str, str] | None = None) -> Response:
        response = self._send(method, path, json, headers)
        try:
            data = response.read()
        except (OSError, http.client.HTTPException) as err:
            self._drop()
            raise HttpError(f"{type(err).__name__}: {err or 'cut short'}") from None
        if response.will_close:
            self._drop()
        return Response(response.status, {k.lower(): v for k, v in response.getheaders()},
                        data.decode("utf-8", "replace"))

    def post(self, path: str, json: Any = None, headers: dict[str, str] | None = None) -> Response:
        return self.request("POST", path, json=json, headers=headers)

    def stream_lines(self, method: str, path: str, json: Any = None) -> Iterator[bytes]:
        """The answer's lines as they arrive (a streaming completion); the connection is not reused after."""
        response = self._send(method, path, json, None)
        try:
            if response.status >= 300:
                raise HttpError(f"{method} {path} answered {response.status}")
            while line := response.readline():
                yield line
        except (OSError, http.client.HTTPException) as err:
            raise HttpError(f"{type(err).__name__}: {err or 'cut short'}") from None
        finally:
            self._drop()

    def close(self) -> None:
        """Every thread's connection closed."""
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()
        self._local = threading.local()
