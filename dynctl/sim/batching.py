"""Continuous batching, as sglang's scheduler event loop does it: each iteration either prefills newly
admitted requests or runs one decode step over every running request (managers/scheduler.py
get_next_batch_to_run), and logs its "Prefill batch" / "Decode batch" lines and metrics like
scheduler_metrics_mixin.py. Step durations come from the cost model; this runs in the main process's
event loop, so a request's progress is shared memory rather than ZMQ messages.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from dynctl.sim import costmodel
from dynctl.sim.costmodel import SKIP, SPECULATE, StepCosts
from dynctl.sim.loglines import decode_batch_line, prefill_batch_line
from dynctl.sim.metrics import ServerMetrics
from dynctl.sim.speculation import Speculation

_WORDS = ("The", " simulated", " server", " answers", " with", " tokens", " that", " mean", " nothing", ",",
          " but", " arrive", " at", " the", " pace", " of", " a", " real", " GPU", ".")


@dataclass
class Request:
    rid: str
    input_tokens: int
    max_new_tokens: int
    log_metrics: bool = True
    created: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    aborted: bool = False
    finish_reason: dict | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    queue_start: float = field(default_factory=time.perf_counter)
    queue_end: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def seq_len(self) -> int:
        return self.input_tokens + len(self.output_ids)


class Batcher:
    def __init__(self, args: dict[str, Any], speculation: Speculation, *, time_scale: float, accept_rate: float,
                 seed: int, max_total_num_tokens: int, max_running_requests: int, log: Any,
                 metrics: ServerMetrics | None, costs: StepCosts | None = None,
                 schedulers_alive: Callable[[], bool] = lambda: True):
        self.args = args
        self.speculation = speculation
        self.costs = costs or costmodel.load_table()
        self.time_scale = time_scale
        self.accept_rate = accept_rate
        self.rng = random.Random(seed)
        self.max_total_num_tokens = max_total_num_tokens
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = args.get("max_prefill_tokens") or 16384
        self.log_interval = max(1, args.get("decode_log_interval") or 40)
        self.stream_interval = max(1, args.get("stream_interval") or 1)
        self.log = log
        self.metrics = metrics
        self.schedulers_alive = schedulers_alive
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: dict[str, Request] = {}  # TokenizerManager.rid_to_state
        self.wake = asyncio.Event()
        self.last_output_at = 0.0  # TokenizerManager.last_receive_tstamp
        self.stalled = False
        self.last_plan = None
        # scheduler_metrics_mixin counters
        self.forward_ct_decode = 0
        self.num_generated_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_num_forward_ct = 0
        self.spec_total_num_accepted_tokens = 0
        self.spec_total_num_forward_ct = 0
        self.last_gen_throughput = 0.0
        self.last_decode_stats_tic = time.perf_counter()
        self.last_prefill_stats_tic = time.perf_counter()
        self.last_prefill_tokens = 0

    # ------------------------------------------------------------------------------- requests in and out

    def submit(self, request: Request) -> None:
        self.in_flight[request.rid] = request
        self.waiting.append(request)
        self.wake.set()

    def abort(self, rid: str) -> None:
        request = self.in_flight.pop(rid, None)
        if request is not None and not request.finished:
            request.aborted = True
            request.finished = True
            request.finish_reason = {"type": "abort", "message": "Abort before prefill" if request.queue_end is None
                                     else "Abort in running", "status_code": None, "err_type": None}
            request.changed.set()
            if request.log_metrics and self.metrics is not None:
                self.metrics.num_aborted_requests_total.inc()

    @property
    def used_tokens(self) -> int:
        return sum(r.seq_len for r in self.running)

    def token_usage(self) -> float:
        return self.used_tokens / self.max_total_num_tokens if self.max_total_num_tokens else 0.0

    # ------------------------------------------------------------------------------------------ the loop

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            self._drop_aborted()
            if not self.schedulers_alive():
                # A dead scheduler stops all progress; the tokenizer only notices through /health.
                self.stalled = True
                await asyncio.sleep(0.5)
                continue
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
                deadline = loop.time()
                continue
            admitted = self._admit()
            if admitted:
                new_tokens = sum(r.input_tokens for r in admitted)
                seconds = self.costs.prefill_step_seconds(new_tokens)
                deadline = await self._sleep_until(loop, deadline + seconds / self.time_scale)
                self._finish_prefill(admitted, new_tokens)
            else:
                batch = len(self.running)
                plan = self.speculation.decide(batch)
                if plan.transition:
                    self.log.info(plan.transition)
                # the patch writes its gauges as it decides, right after the line, before the step runs
                self.speculation.observe_metrics(plan)
                seconds = self.costs.decode_step_seconds(batch, plan.kind, plan.steps, plan.draft_tokens)
                deadline = await self._sleep_until(loop, deadline + seconds / self.time_scale)
                self._finish_decode(plan)

    async def _sleep_until(self, loop: asyncio.AbstractEventLoop, when: float) -> float:
        now = loop.time()
        if when > now:
            await asyncio.sleep(when - now)
            return when
        # Behind schedule (a busy event loop): catch up at most 50 ms, so throughput stays what the table
        # says without a burst after a long stall. Each step still yields once, as a scheduler hands every
        # step's outputs on: a stream reads them step by step, not all at once when the loop catches up.
        await asyncio.sleep(0)
        return max(when, now - 0.05)

    def _drop_aborted(self) -> None:
        if any(r.aborted for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.aborted)
        self.running = [r for r in self.running if not r.aborted]

    def _admit(self) -> list[Request]:
        """PrefillAdder: admit while slots, the prefill token budget and the KV pool allow."""
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        used = self.used_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_running_requests:
            request = self.waiting[0]
            reserve = request.input_tokens + request.max_new_tokens
            if used + reserve > self.max_total_num_tokens and (self.running or admitted):
                break
            if admitted and request.input_tokens > budget:
                break
            self.waiting.popleft()
            admitted.append(request)
            budget -= request.input_tokens
            used += reserve
        return admitted

    def _finish_prefill(self, admitted: list[Request], new_tokens: int) -> None:
        now = time.perf_counter()
        running_before = len(self.running)
        for request in admitted:
            request.queue_end = now
            if request.aborted:
                continue
            if request.log_metrics and self.metrics is not None:
                self.metrics.queue_time.observe(now - request.queue_start)
            # The extend step samples the first output token (max_new_tokens 0 yields none).
            if request.max_new_tokens > 0:
                self._emit(request, 1, now)
            else:
                self._finish(request, {"type": "length", "length": 0})
            if not request.finished:
                self.running.append(request)
        gap = now - self.last_prefill_stats_tic
        self.last_prefill_stats_tic = now
        input_throughput = self.last_prefill_tokens / gap if gap > 0 else 0.0
        self.last_prefill_tokens = new_tokens
        self.log.info(prefill_batch_line(
            new_seqs=len(admitted), new_tokens=new_tokens, cached_tokens=0, token_usage=self.token_usage(),
            running=running_before, queued=len(self.waiting), input_throughput=input_throughput,
            cuda_graph=False))
        if self.metrics is not None:
            self.metrics.count_prefill(new_tokens, 0)
            self._set_gauges(running_before, gen_throughput=None, accept=None, cuda_graph=False)

    def _finish_decode(self, plan) -> None:
        now = time.perf_counter()
        batch = self.running
        generated = 0
        accepted_counts = []
        for request in batch:
            if request.aborted or request.finished:
                continue
            if plan.kind == SPECULATE:
                accepted = costmodel.draw_accepted_drafts(self.rng, self.accept_rate, plan.steps)
                accepted_counts.append(accepted)
            else:
                accepted = 0
            if plan.kind in (SPECULATE, SKIP):
                request.spec_verify_ct += 1
                request.spec_accepted_tokens += accepted
            generated += self._emit(request, 1 + accepted, now)
        if plan.kind in (SPECULATE, SKIP):
            # update_spec_metrics: a plain step of the patch counts as a verify that accepted nothing.
            self.spec_num_accepted_tokens += sum(accepted_counts) + len(batch)
            self.spec_num_forward_ct += len(batch)
        if accepted_counts:
            note = self.speculation.after_verify(len(batch), accepted_counts)
            if note:
                self.log.info(note)
        self.num_generated_tokens += generated
        self.forward_ct_decode += 1
        self.last_plan = plan
        if self.metrics is not None:
            self.metrics.count_decode_step(plan.cuda_graph, generated)
        running = len(batch)
        self.running = [r for r in self.running if not r.finished]
        if self.forward_ct_decode % self.log_interval == 0:
            self._log_decode_stats(running, plan, batch)

    def _emit(self, request: Request, count: int, now: float) -> int:
        count = min(count, request.max_new_tokens - len(request.output_ids))
        if count <= 0:
            return 0
        start = len(request.output_ids)
        for i in range(start, start + count):
            request.output_ids.append(1000 + (zlib.crc32(request.rid.encode()) + 7919 * i) % 150000)
            request.text += _WORDS[i % len(_WORDS)]
        if request.log_metrics and self.metrics is not None:
            if request.first_token_at is None:
                self.metrics.time_to_first_token.observe(now - request.queue_start)
            else:
                self.metrics.observe_inter_token_latency(now - request.last_token_at, count)
        if request.first_token_at is None:
            request.first_token_at = now
        request.last_token_at = now
        self.last_output_at = time.time()
        if len(request.output_ids) >= request.max_new_tokens:
            self._finish(request, {"type": "length", "length": request.max_new_tokens})
        elif self._streams_now(len(request.output_ids)):
            request.changed.set()
        return count

    def _streams_now(self, output_len: int) -> bool:
        """output_streamer.py accept: with --stream-interval K > 1 a running request's output goes out when its
        length is 1 modulo K (the first token at once), every step when K is 1; a finished one always does."""
        return output_len % self.stream_interval == (1 if self.stream_interval > 1 else 0)

    def _finish(self, request: Request, reason: dict) -> None:
        request.finished = True
        request.finish_reason = reason
        self.in_flight.pop(request.rid, None)
        request.changed.set()
        if request.log_metrics and self.metrics is not None:
            m = self.metrics
            m.num_requests_total.inc()
            m.prompt_tokens_total.inc(request.input_tokens)
            m.generation_tokens_total.inc(len(request.output_ids))
            m.e2e_request_latency.observe(time.time() - request.created)

    def _log_decode_stats(self, running: int, plan, batch: list[Request]) -> None:
        now = time.perf_counter()
        gap = now - self.last_decode_stats_tic
        self.last_decode_stats_tic = now
        self.last_gen_throughput = self.num_generated_tokens / gap if gap > 0 else 0.0
        self.num_generated_tokens = 0
        accept = None
        if self.args.get("speculative_algorithm") is not None and self.spec_num_forward_ct:
            length = self.spec_num_accepted_tokens / self.spec_num_forward_ct
            draft = self.args.get("speculative_num_draft_tokens") or (self.args.get("speculative_num_steps") or 0) + 1
            rate = self.spec_num_accepted_tokens / (self.spec_num_forward_ct * draft)
            self.spec_total_num_accepted_tokens += self.spec_num_accepted_tokens
            self.spec_total_num_forward_ct += self.spec_num_forward_ct
            self.spec_num_accepted_tokens = self.spec_num_forward_ct = 0
            accept = (length, rate)
        self.log.info(decode_batch_line(
            running=running, used_tokens=self.used_tokens, token_usage=self.token_usage(), accept=accept,
            cuda_graph=plan.cuda_graph, gen_throughput=self.last_gen_throughput, queued=len(self.waiting),
            forward_ct=self.forward_ct_decode))
        if self.metrics is not None:
            self.metrics.set_gauge("decode_sum_seq_lens", sum(r.seq_len for r in batch))
            self._set_gauges(running, self.last_gen_throughput, accept, plan.cuda_graph)

    def _set_gauges(self, running: int, gen_throughput: float | None, accept, cuda_graph: bool) -> None:
        m = self.metrics
        m.set_gauge("num_running_reqs", running)
        m.set_gauge("num_used_tokens", self.used_tokens)
        m.set_gauge("token_usage", self.token_usage())
        m.set_gauge("num_queue_reqs", len(self.waiting))
        m.set_gauge("max_total_num_tokens", self.max_total_num_tokens)
        m.set_gauge("is_cuda_graph", 1 if cuda_graph else 0)
        m.set_gauge("utilization", min(1.0, running / max(1, self.max_running_requests)))
        if gen_throughput is not None:
            m.set_gauge("gen_throughput", gen_throughput)
        if accept is not None:
            m.set_gauge("spec_accept_length", accept[0])
            m.set_gauge("spec_accept_rate", accept[1])

    def avg_spec_accept_length(self) -> float | None:
        if self.spec_total_num_forward_ct <= 0:
            return None
        return self.spec_total_num_accepted_tokens / self.spec_total_num_forward_ct

    def reset_spec_totals(self) -> None:
        self.spec_total_num_accepted_tokens = self.spec_total_num_forward_ct = 0
