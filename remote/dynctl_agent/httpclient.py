"""HTTP to the server on this host: straight to its address with http.client, never through a proxy.

urllib would honour http_proxy from the host's environment and send a request for 127.0.0.1 to the proxy
(no_proxy is often unset), so a healthy server would look dead to a deploy's read-back.
"""

from __future__ import annotations

import http.client
import json
import socket

from dynctl.base import sglang


class HTTPError(OSError):
    """The server answered, with a status other than 200."""

    def __init__(self, status, path):
        reason = http.client.responses.get(status, "")
        super().__init__("%s answered HTTP %d %s" % (path, status, reason))
        self.status, self.reason = status, reason


# what a request to a server that is down, restarting or not an HTTP server raises
FAILURES = (OSError, http.client.HTTPException, ValueError)


def request(host, port, method, path, body=None, timeout=5.0, cap=None, keys=None):
    """(status, body bytes, at most cap of them); raises one of FAILURES when nothing sensible came back.

    keys: sglang.api_keys() of the server's argv; the one `path` needs goes along as a bearer token.
    """
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        token = sglang.bearer_for(keys, path)
        if token:
            headers["Authorization"] = "Bearer " + token
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read() if cap is None else resp.read(cap)
    finally:
        conn.close()


def get(host, port, path, timeout, cap=None, keys=None):
    """The body of a GET that answered 200; HTTPError otherwise."""
    status, data = request(host, port, "GET", path, timeout=timeout, cap=cap, keys=keys)
    if status != 200:
        raise HTTPError(status, path)
    return data


def get_json(host, port, path, timeout, cap=None, keys=None):
    return json.loads(get(host, port, path, timeout, cap, keys).decode("utf-8", "replace"))


def post_json(host, port, path, body, timeout, keys=None):
    status, data = request(host, port, "POST", path, body=body, timeout=timeout, keys=keys)
    if status != 200:
        raise HTTPError(status, path)
    return data


def server_info(host, port, timeout, cap=None, keys=None):
    """/server_info as a dict, from whichever of its names the server answers to."""
    first, older = sglang.SERVER_INFO_PATHS
    try:
        return get_json(host, port, first, timeout, cap, keys)
    except HTTPError as err:
        if err.status != 404:
            raise
        return get_json(host, port, older, timeout, cap, keys)


def is_refused(err):
    """Nothing listens there: the request was never sent."""
    return isinstance(err, ConnectionRefusedError)


def describe(err, timeout=None):
    """What went wrong with one request, in words ("answered HTTP 500 ...", "got no answer within 10 s")."""
    if isinstance(err, HTTPError):
        hint = " (the server wants an API key: dynctl sends the --api-key / --admin-api-key of its launch argv)" \
            if err.status in (401, 403) else ""
        return "answered HTTP %d %s%s" % (err.status, err.reason, hint)
    if isinstance(err, (socket.timeout, TimeoutError)):  # distinct classes before Python 3.10
        return "got no answer within %g s" % timeout if timeout is not None else "timed out"
    if isinstance(err, OSError) and err.strerror:
        return "failed: %s" % err.strerror
    return "failed: %s" % (err or type(err).__name__)


def short(err):
    """A few words for the live view: "HTTP 404", "timed out", "Connection refused"."""
    if isinstance(err, HTTPError):
        return "HTTP %d" % err.status
    if isinstance(err, (socket.timeout, TimeoutError)):
        return "timed out"
    return str(getattr(err, "strerror", None) or err or type(err).__name__)
