"""The closed-loop load generator of one bench level: C workers over raw HTTP/1.1, and /metrics samples."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

from dynctl.base import sglang

VOCAB = range(1000, 20000)  # token ids every real vocabulary has

async def read_head(reader):
    """Status, lower-cased headers and whether the server spoke HTTP/1.0 (no keep-alive)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("server closed the connection before answering")
    parts = status_line.split(None, 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip().lower()
    return status, headers, status_line.startswith(b"HTTP/1.0")


async def read_body(reader, headers):
    """The response body as it arrives: chunked, sized, or until the server closes."""
    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionResetError("connection closed in the middle of the response")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                raise ConnectionResetError("connection closed in the middle of the response")
            left -= len(data)
            yield data
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


class Level:
    """One closed-loop level: C workers, warm-up, then a window of a duration or a request count."""

    def __init__(self, host, port, model, concurrency, input_len, output_len, duration, num_prompts,
                 warmup, seed, sample_s, idle_timeout, max_level_s, token_ids=False, bearer=None):
        self.host, self.port, self.model = host, port, model
        self.auth = "Authorization: Bearer %s\r\n" % bearer if bearer else ""
        self.token_ids = token_ids
        self.concurrency = concurrency
        self.input_len, self.output_len = input_len, output_len
        self.duration, self.num_prompts = duration, num_prompts
        self.warmup = warmup
        self.rng = random.Random(seed)
        self.sample_s, self.idle_timeout, self.max_level_s = sample_s, idle_timeout, max_level_s
        self.t0 = time.perf_counter()
        self.w0 = 0.0 if warmup == 0 else None
        self.w1 = None
        self.warm_claimed = self.warm_done = 0
        self.measured_claimed = self.measured_done = 0
        self.failed = self.warmup_failed = 0
        self.records = []
        self.errors = {}
        self.samples = []
        self.metrics_note = None
        self.metrics_missing = False
        self.timed_out = False
        self.stop = False
        self.window_open = asyncio.Event()
        self.finished = asyncio.Event()
        self.busy = {}  # worker id -> (writer, last activity)
        if self.w0 is not None:
            self.w1 = duration
            self.window_open.set()

    def now(self):
        return time.perf_counter() - self.t0

    # -- requests
    def _body(self):
        if self.token_ids:  # ids low enough for any vocabulary
            return json.dumps({
                "input_ids": [self.rng.randrange(10, 1000) for _ in range(self.input_len)], "stream": True,
                "sampling_params": {"max_new_tokens": self.output_len, "temperature": 0.0, "ignore_eos": True},
            }).encode()
        prompt = self.rng.choices(VOCAB, k=self.input_len)  # exact length without a tokenizer
        return json.dumps({
            "model": self.model, "prompt": prompt, "max_tokens": self.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }).encode()

    def _claim(self):
        """'warm' or 'measure' for the next request, None when this level sends no more."""
        if self.stop:
            return None
        if self.warm_claimed < self.warmup:
            self.warm_claimed += 1
            return "warm"
        if self.num_prompts is not None:
            if self.measured_claimed >= self.num_prompts:
                return None
            self.measured_claimed += 1
        return "measure"

    def _note_error(self, message):
        message = message.strip().splitlines()[0][:200] if message.strip() else "error"
        if message in self.errors or len(self.errors) < 20:
            self.errors[message] = self.errors.get(message, 0) + 1

    def _finish(self, kind, record, error):
        now = self.now()
        if kind == "warm":
            self.warm_done += 1
            if error:
                self.warmup_failed += 1
                self._note_error(error)
            if self.warm_done >= self.warmup and self.w0 is None:
                self.w0 = now
                if self.duration is not None:
                    self.w1 = now + self.duration
                self.window_open.set()
            return
        if error:
            if self.num_prompts is not None or (self.w0 is not None and (self.w1 is None or now <= self.w1)):
                self.failed += 1
            self._note_error(error)
        elif record is not None:
            self.records.append(record)
        if self.num_prompts is not None:
            self.measured_done += 1
            if self.measured_done >= self.num_prompts:
                self.w1 = now
                self.stop = True
                self.finished.set()

    async def _connect(self):
        return await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 10.0)

    async def _request(self, wid, conn, record):
        """One streaming request on `conn`; fills `record`; returns (conn to reuse or None, error or None)."""
        reader, writer = conn
        body = self._body()
        path = "/generate" if self.token_ids else "/v1/completions"
        head = ("POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n%s"
                "Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                % (path, self.host, self.port, self.auth, len(body)))
        start = time.perf_counter()
        record["s"] = round(start - self.t0, 6)
        self.busy[wid] = [writer, start, None]  # writer, last activity, why the watchdog cut it
        writer.write(head.encode() + body)
        await writer.drain()
        status, headers, http10 = await read_head(reader)
        keep = headers.get("connection") != "close" and not http10
        times, cums = [], []
        state = {"buf": b"", "cum": 0, "usage": None, "error": None}

        def on_data(data, t):
            buf = state["buf"] + data
            while True:
                i = buf.find(b"\n")
                if i < 0:
                    break
                line, buf = buf[:i].strip(), buf[i + 1:]
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                try:
                    obj = json.loads(payload)
                except ValueError:
                    state["error"] = "unparsable stream event: %r" % payload[:80]
                    continue
                if "error" in obj or obj.get("object") == "error":
                    err = obj.get("error", obj)
                    state["error"] = "server error: %s" % (err.get("message") if isinstance(err, dict) else err)
                    continue
                # OpenAI completions carry usage and choices; sglang's /generate meta_info and output_ids
                usage = obj.get("usage") or obj.get("meta_info") or {}
                choices = obj.get("choices") or []
                text = choices[0].get("text") if choices else (obj.get("output_ids") or obj.get("text"))
                if usage.get("completion_tokens") is not None:
                    state["usage"] = int(usage["completion_tokens"])
                if text:
                    state["cum"] = state["usage"] if state["usage"] is not None else state["cum"] + 1
                    times.append(int((t - start) * 1e6))
                    cums.append(state["cum"])
            state["buf"] = buf

        record["t"], record["k"] = times, cums
        async for data in read_body(reader, headers):
            now = time.perf_counter()
            self.busy[wid][1] = now
            if status == 200:
                on_data(data, now)
            else:
                state["error"] = "HTTP %d: %s" % (status, data[:200].decode("utf-8", "replace"))
        record["e"] = int((time.perf_counter() - start) * 1e6)
        if status != 200 and state["error"] is None:
            state["error"] = "HTTP %d" % status
        record["n"] = state["usage"] if state["usage"] is not None else state["cum"]
        if cums and cums[-1] == len(cums):  # one token per chunk: the counts say nothing new
            del record["k"]
        if state["error"] is None and not times:
            state["error"] = "stream ended without any token"
        return (conn if keep else None), state["error"]

    async def _worker(self, wid):
        conn = None
        while True:
            kind = self._claim()
            if kind is None:
                break
            record, error = {}, None
            for attempt in (1, 2):
                reused = conn is not None
                try:
                    if conn is None:
                        conn = await self._connect()
                    conn, error = await self._request(wid, conn, record)
                    break
                except asyncio.CancelledError:
                    if kind == "measure" and record.get("t"):
                        record["a"] = 1  # cut at the end of the window: its tokens so far still count
                        record["e"] = int((time.perf_counter() - self.t0 - record["s"]) * 1e6)
                        record["n"] = record["k"][-1]
                        self.records.append(record)
                    self._close(conn)
                    raise
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as err:
                    self._close(conn)
                    conn = None
                    entry = self.busy.get(wid)
                    # a kept-alive connection the server closed in between: one silent retry, nothing was sent
                    if attempt == 1 and reused and not record.get("t") and not (entry and entry[2]):
                        record = {}
                        continue
                    error = entry[2] if entry and entry[2] else ("%s: %s" % (type(err).__name__, err)).rstrip(": ")
                    break
                finally:
                    self.busy.pop(wid, None)
            self._finish(kind, None if error else record, error)
            if error and conn is None:
                await asyncio.sleep(0.2)  # server down or restarting: do not spin
        self._close(conn)

    @staticmethod
    def _close(conn):
        if conn is not None:
            with contextlib.suppress(Exception):
                conn[1].transport.abort()

    async def _watchdog(self):
        while True:
            await asyncio.sleep(1.0)
            now = time.perf_counter()
            for entry in list(self.busy.values()):
                if entry[2] is None and now - entry[1] > self.idle_timeout:
                    entry[2] = "no data from the server for %g s" % self.idle_timeout
                    entry[0].transport.abort()

    async def _sample(self, edge=False):
        """One /metrics scrape (bench's series only); `edge` ones are taken at the window's ends, for exact
        counter deltas."""
        if self.metrics_missing:
            return
        try:
            status, text = await asyncio.wait_for(self._get_text("/metrics"), 5.0)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError) as err:
            self.metrics_note = "metrics unreadable: %s" % (err or type(err).__name__,)
            return  # a restarting server: try again at the next tick
        if status == 404 or (status == 200 and "sglang:" not in text):
            self.metrics_missing = True
            self.metrics_note = "no sglang metrics at /metrics (start the server with --enable-metrics)"
            return
        if status != 200:
            self.metrics_note = "/metrics answered HTTP %d" % status
            return
        # raw text: the client reads it with the same parser as every other /metrics
        sample = {"t": round(self.now(), 3), "text": sglang.metric_lines(text, sglang.BENCH_SERIES)}
        if edge:
            sample["edge"] = 1
        self.samples.append(sample)

    async def _sampler(self):
        while not self.metrics_missing:
            await self._sample()
            await asyncio.sleep(self.sample_s)

    async def _get_text(self, path):
        """(status, body) of one GET on a fresh connection."""
        reader, writer = await self._connect()
        try:
            writer.write(("GET %s HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n"
                          % (path, self.host, self.port)).encode())
            await writer.drain()
            status, headers, _ = await read_head(reader)
            chunks = [c async for c in read_body(reader, headers)]
            return status, b"".join(chunks).decode("utf-8", "replace")
        finally:
            writer.transport.abort()

    async def _until(self, event, *others):
        """Wait for `event` (or any of `others` to end) until the level's time cap; True if it fired."""
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait([waiter, *others], timeout=max(0.0, self.max_level_s - self.now()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return event.is_set()

    async def run(self):
        workers = [asyncio.ensure_future(self._worker(i)) for i in range(self.concurrency)]
        helpers = [asyncio.ensure_future(self._watchdog()), asyncio.ensure_future(self._sampler())]
        all_done = asyncio.ensure_future(asyncio.gather(*workers, return_exceptions=True))
        try:
            if not await self._until(self.window_open, all_done):
                self.timed_out = not all_done.done()
                return
            await self._sample(edge=True)
            if self.duration is not None:
                cap = min(self.w1, self.max_level_s) - self.now()
                await asyncio.wait([all_done], timeout=max(0.0, cap))
                self.timed_out = self.now() < self.w1 - 0.01 and not all_done.done()
            elif not await self._until(self.finished, all_done):
                self.timed_out = not all_done.done()
            await self._sample(edge=True)  # the load still runs: counters up to the window's end
        finally:
            self.stop = True
            end = self.now()
            if self.w0 is None:
                self.w0 = end
            if self.w1 is None or self.w1 > end:
                self.w1 = end
            for task in workers + helpers:
                task.cancel()
            # bounded: a task that ignores its cancellation must not keep the level (and the host) busy
            await asyncio.wait([*workers, *helpers, all_done], timeout=10.0)

    def tick(self):
        phase = "warmup" if self.w0 is None else "measure"
        latest = self.samples[-1] if self.samples else {}
        return {"ok": True, "type": "tick", "phase": phase, "elapsed": round(self.now(), 3),
                "warmup_done": self.warm_done, "completed": len(self.records), "failed": self.failed,
                "metrics": latest.get("text"), "window_elapsed": round(self.now() - self.w0, 3)
                if self.w0 is not None else None}

    def result(self, cpu_s):
        wall = self.now()
        return {
            "ok": True, "type": "level", "concurrency": self.concurrency, "window": [self.w0, self.w1],
            "records": self.records, "failed": self.failed, "warmup": self.warmup,
            "warmup_failed": self.warmup_failed, "errors": self.errors, "samples": self.samples,
            "metrics_note": self.metrics_note, "timed_out": self.timed_out,
            "loadgen": {"cpu_s": round(cpu_s, 3), "wall_s": round(wall, 3),
                        "cpu_percent": round(100.0 * cpu_s / wall, 1) if wall > 0 else None},
        }
