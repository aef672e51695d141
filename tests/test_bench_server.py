"""A tiny real HTTP server speaking sglang's streaming /v1/completions, and the load generator against it.

`TokenServer` is a genuine asyncio HTTP/1.1 server on 127.0.0.1 (chunked SSE like uvicorn, sglang's event
shapes): each request streams `max_tokens` tokens, `tokens_per_chunk` per event every `interval` seconds,
so throughput at concurrency C is exactly C * tokens_per_chunk / interval. Faults can be switched on.
Other bench tests import it; the simulated host (dynctl.sim) is used where the GPU table's numbers matter.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import pytest
from polling import finishes

from dynctl.agent.client import AgentClient, AgentError
from dynctl.bench.stats import decode_samples
from dynctl.base.config import HostConfig
from dynctl.transport.local import Local

pytestmark = pytest.mark.slow


class TokenServer:
    def __init__(self, interval: float = 0.01, tokens_per_chunk: int = 1, threshold: int | None = 4,
                 spec: str | None = "EAGLE3", metrics: bool = True) -> None:
        self.interval = interval
        self.tokens_per_chunk = tokens_per_chunk
        self.threshold = threshold
        self.spec = spec
        self.metrics = metrics
        self.fail_every = 0  # every n-th completion answers HTTP 500
        self.break_every = 0  # every n-th completion sends an error event mid-stream
        self.requests = 0
        self.running = 0
        self.steps = {"decode_cuda_graph": 0.0, "decode_none": 0.0}
        self.disabled_steps = 0.0
        self.bodies: list[dict] = []
        self.extra_info: dict = {}  # more /server_info fields
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- lifecycle (called from the test thread)
    def start(self) -> TokenServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(5)
        return self

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
        asyncio.run_coroutine_threadsafe(self._cancel_rest(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def restart(self) -> None:
        """Drop every connection and listen again on the same port, as a restarted server would."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(5)
        self.steps = {k: 0.0 for k in self.steps}  # counters of a new process start at zero
        self.disabled_steps = 0.0

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ticker = asyncio.ensure_future(self._tick())

    async def _shutdown(self) -> None:
        self._ticker.cancel()
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        await self._server.wait_closed()

    async def _cancel_rest(self) -> None:
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    async def _tick(self) -> None:
        while True:  # decode steps as the patched sglang counts them
            await asyncio.sleep(self.interval)
            if self.running:
                spec_on = self.threshold is None or self.threshold < 0 or self.running <= self.threshold
                self.steps["decode_cuda_graph" if spec_on else "decode_none"] += 1
                if not spec_on:
                    self.disabled_steps += 1

    # -- HTTP
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self._route(method, path, body, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _send(self, writer: asyncio.StreamWriter, status: int, payload: bytes,
                    ctype: str = "application/json") -> bool:
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                     % (status, ctype.encode(), len(payload)) + payload)
        await writer.drain()
        return True

    async def _route(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if path == "/v1/models":
            return await self._send(writer, 200, json.dumps({"data": [{"id": "tiny-model"}]}).encode())
        if path in ("/server_info", "/get_server_info"):
            state = {} if self.threshold is None else {"speculative_disable_batch_threshold": self.threshold}
            return await self._send(writer, 200, json.dumps({
                "version": "tiny", "speculative_algorithm": self.spec, "internal_states": [state],
                **self.extra_info}).encode())
        if path == "/set_internal_state":
            args = json.loads(body).get("server_args", {})
            if self.threshold is not None and "speculative_disable_batch_threshold" in args:
                self.threshold = int(args["speculative_disable_batch_threshold"])
            return await self._send(writer, 200, b'{"updated": true}')
        if path == "/metrics":
            if not self.metrics:
                return await self._send(writer, 404, b"not found", "text/plain")
            return await self._send(writer, 200, self._metrics_text().encode(), "text/plain")
        if path == "/v1/completions" and method == "POST":
            return await self._complete(json.loads(body), writer)
        return await self._send(writer, 404, b'{"detail": "Not Found"}')

    def _metrics_text(self) -> str:
        labels = '{model_name="tiny",tp_rank="0"}'
        spec_on = self.threshold is None or self.threshold < 0 or self.running <= self.threshold
        lines = [
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{labels} {self.running}.0",
            f"sglang:gen_throughput{labels} 1.0",
            f"sglang:spec_accept_length{labels} {float(self.tokens_per_chunk)}",
            f"sglang:spec_enabled{labels} {1.0 if spec_on else 0.0}",
            f"sglang:spec_disable_threshold{labels} {float(self.threshold if self.threshold is not None else -1)}",
            f"sglang:spec_disabled_steps_total{labels} {self.disabled_steps}",
        ]
        for mode, n in self.steps.items():
            lines.append(f'sglang:cuda_graph_passes_total{{mode="{mode}",tp_rank="0"}} {n}')
        return "\n".join(lines) + "\n"

    async def _chunk(self, writer: asyncio.StreamWriter, obj: object) -> None:
        data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()

    async def _complete(self, req: dict, writer: asyncio.StreamWriter) -> bool:
        self.requests += 1
        n = self.requests
        self.bodies.append(req)
        if self.fail_every and n % self.fail_every == 0:
            return await self._send(writer, 500, b'{"object": "error", "message": "injected failure"}')
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        self.running += 1
        try:
            sent = 0
            while sent < req["max_tokens"]:
                await asyncio.sleep(self.interval)
                if self.break_every and n % self.break_every == 0 and sent >= req["max_tokens"] // 2:
                    await self._chunk(writer, {"error": {"object": "error", "message": "injected stream error",
                                                         "type": "BadRequestError", "code": 400}})
                    break
                step = min(self.tokens_per_chunk, req["max_tokens"] - sent)
                sent += step
                await self._chunk(writer, {"choices": [{"index": 0, "text": "ab" * step, "finish_reason": None}],
                                           "usage": {"prompt_tokens": len(req["prompt"]),
                                                     "completion_tokens": sent}})
            await self._chunk(writer, {"choices": [], "usage": {"completion_tokens": sent}})
            await self._chunk(writer, b"[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            self.running -= 1
        return True


@pytest.fixture
def token_server():
    server = TokenServer().start()
    try:
        yield server
    finally:
        server.close()


def local_agent(port: int, serves_here: bool = False) -> AgentClient:
    """The real agent in a subprocess on this machine, pointed at `port`; `serves_here` records this process
    (which serves the test server's HTTP) as the host's server, as `dynctl start` would."""
    import sys

    host = HostConfig(name="benchtest", port=port, python=sys.executable)
    agent = AgentClient(Local(), host)
    if serves_here:
        from watch_server import record_as_server

        workdir = Path(os.path.expanduser(host.workdir))
        workdir.mkdir(parents=True, exist_ok=True)
        record_as_server(workdir)
    # Upload the agent with a plain call first: a stream to a missing agent can meet a closed stdin pipe
    # (LocalStream writes the request after the boot stub may already have exited 97).
    agent.call("ping")
    return agent


def run_level(agent: AgentClient, **params) -> tuple[list[dict], dict]:
    ticks, result = [], None
    for item in agent.stream("bench_level", **params):
        if item["type"] == "tick":
            ticks.append(item)
        else:
            result = item
    assert result is not None
    return ticks, result


def test_level_streams_exact_lengths_and_counts_tokens(token_server):
    agent = local_agent(token_server.port)
    _, raw = run_level(agent, concurrency=4, input_len=32, output_len=10, num_prompts=12, warmup=4, tick_s=0.2)
    assert raw["failed"] == 0 and raw["errors"] == {}
    assert len(raw["records"]) == 12
    assert all(r["n"] == 10 and len(r["t"]) == 10 for r in raw["records"])
    # 4 warm-up + 12 measured requests reached the server, each with a 32-token prompt and ignore_eos
    assert token_server.requests == 16
    body = token_server.bodies[-1]
    assert len(body["prompt"]) == 32 and body["ignore_eos"] is True and body["stream"] is True
    assert body["max_tokens"] == 10


def test_level_counts_http_errors_and_stream_errors(token_server):
    token_server.fail_every = 5
    token_server.break_every = 7
    agent = local_agent(token_server.port)
    _, raw = run_level(agent, concurrency=3, input_len=8, output_len=6, num_prompts=30, warmup=0)
    failed = raw["failed"]
    assert failed == sum(raw["errors"].values())
    assert any("HTTP 500" in k for k in raw["errors"]) and any("injected stream error" in k for k in raw["errors"])
    assert len(raw["records"]) + failed == 30
    assert 30 - len(raw["records"]) >= 6  # 1 in 5 plus 1 in 7, minus overlaps


def test_unreachable_server_is_reported_as_such():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        agent = local_agent(port)
        with pytest.raises(AgentError) as info:
            run_level(agent, concurrency=1, input_len=4, output_len=4, num_prompts=1)
    assert info.value.kind == "unreachable" and str(port) in str(info.value)


def test_server_restart_mid_level_is_counted_not_fatal(token_server):
    token_server.interval = 0.02
    token_server.steps["decode_cuda_graph"] = 1e6  # so the restart's return to zero shows in every sample
    agent = local_agent(token_server.port)
    ticks, result = [], None
    restarted = False
    for item in agent.stream("bench_level", concurrency=4, input_len=8, output_len=20, duration=2.5,
                             warmup=0, tick_s=0.25):
        if item["type"] == "tick":
            ticks.append(item)
            if not restarted and item["completed"] >= 4:
                token_server.restart()
                restarted = True
        else:
            result = item
    assert restarted and result is not None
    assert result["failed"] >= 1  # the streams cut by the restart
    assert any("Error" in k or "closed" in k for k in result["errors"])
    post = [r for r in result["records"] if not r.get("a") and r["s"] > ticks[0]["elapsed"]]
    assert post, "requests after the restart completed again"
    # the metrics counters went back to zero with the restart: the samples show the drop
    steps = [s.get("passes_decode_cuda_graph", 0) + s.get("passes_decode_none", 0)
             for s in decode_samples(result["samples"])]
    assert any(b < a for a, b in zip(steps, steps[1:]))


def test_idle_stream_is_cut_by_the_watchdog(token_server):
    token_server.interval = 600.0  # a server that stalls: waited out, the answer would take half an hour
    agent = local_agent(token_server.port)
    _, raw = finishes(lambda: run_level(agent, concurrency=1, input_len=4, output_len=3, num_prompts=1, warmup=0,
                                        idle_timeout=1.0), 120, "a level whose server stalls")
    assert raw["failed"] == 1
    assert any("no data from the server for 1 s" in k for k in raw["errors"])
