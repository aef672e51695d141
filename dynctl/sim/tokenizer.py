"""The main process's half of sglang: TokenizerManager (managers/tokenizer_manager.py) — request
validation, per-request state, output dicts, server status, drain state and the scheduler control calls
(`/server_info` internal state, `/set_internal_state`, `/flush_cache`) that the real one forwards over ZMQ.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from typing import Any, AsyncIterator, Callable

from dynctl.sim.batching import Batcher, Request
from dynctl.sim.speculation import THRESHOLD_ARG, Speculation


class ServerStatus(enum.Enum):
    Starting = "Starting"
    Up = "Up"
    UnHealthy = "UnHealthy"


def server_args_repr(args: dict[str, Any]) -> str:
    """`repr(ServerArgs(...))`, as sglang logs `server_args=` and `get_global_server_args()=`."""
    return "ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


def count_prompt_tokens(text: str) -> int:
    # A stand-in tokenizer: about four bytes of English per token.
    return max(1, (len(text.encode("utf-8", "replace")) + 3) // 4)


class TokenizerManager:
    def __init__(self, args: dict[str, Any], batcher: Batcher, speculation: Speculation, *, version: str,
                 context_len: int, scheduler_info: dict[str, Any], allowed_keys: set[str],
                 memory_usage: dict[str, Any], log: Any, scheduler_log: Any,
                 threshold_validator: Callable[[Any], Any] | None = None):
        self.server_args = args  # the tokenizer's static copy (top level of /server_info)
        self.runtime_args = dict(args)  # the scheduler's get_global_server_args(), changed by set_internal_state
        self.batcher = batcher
        self.speculation = speculation
        self.version = version
        self.context_len = context_len
        self.scheduler_info = scheduler_info
        self.allowed_keys = allowed_keys
        self.memory_usage = memory_usage
        self.log = log
        self.scheduler_log = scheduler_log
        self.threshold_validator = threshold_validator
        self.server_status = ServerStatus.Starting
        self.gracefully_exit = False
        self.first_request_hook: Callable[[], None] | None = None

    # ---------------------------------------------------------------------------------- generation

    def make_request(self, *, text: str | None, input_ids: list[int] | None, sampling_params: dict[str, Any],
                     rid: str | None, log_metrics: bool = True) -> Request:
        """Validate one request as tokenizer_manager._validate_one_request and SamplingParams.verify do."""
        if text is None and input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if input_ids is not None:
            if not isinstance(input_ids, list) or not all(isinstance(t, int) for t in input_ids):
                raise ValueError("input_ids must be a list of integers.")
            input_tokens = len(input_ids)
        else:
            if self.server_args.get("skip_tokenizer_init"):
                raise ValueError(
                    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please "
                    "provide input_ids or re-initialize the engine with skip_tokenizer_init=False.")
            if not isinstance(text, str):
                raise ValueError("text must be a string.")
            input_tokens = count_prompt_tokens(text)
        max_new_tokens = sampling_params.get("max_new_tokens", 128)
        min_new_tokens = sampling_params.get("min_new_tokens", 0) or 0
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)):
            raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}.")
        if max_new_tokens is not None and max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if max_new_tokens is not None and not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new_tokens}.")
        if input_tokens >= self.context_len:
            raise ValueError(f"The input ({input_tokens} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        if max_new_tokens is None:
            max_new_tokens = self.context_len - input_tokens - 1
        if max_new_tokens + input_tokens >= self.context_len:
            total = max_new_tokens + input_tokens
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {total} tokens: {input_tokens} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit.")
        return Request(rid=rid or uuid.uuid4().hex, input_tokens=input_tokens, max_new_tokens=max_new_tokens,
                       log_metrics=log_metrics)

    async def generate(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        """Yield the request's output dict each time it changes (coalesced like state.out_list[-1])."""
        if self.first_request_hook is not None:
            hook, self.first_request_hook = self.first_request_hook, None
            hook()
        self.batcher.submit(request)
        try:
            while True:
                await request.changed.wait()
                request.changed.clear()
                yield self.output(request)
                if request.finished:
                    return
        finally:
            if not request.finished:
                self.batcher.abort(request.rid)

    def output(self, request: Request) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": request.rid,
            "finish_reason": request.finish_reason,
            "prompt_tokens": request.input_tokens,
            "weight_version": self.server_args.get("weight_version", "default"),
            "total_retractions": 0,
            "completion_tokens": len(request.output_ids),
            "cached_tokens": 0,
        }
        if request.finished:
            meta["e2e_latency"] = time.time() - request.created
            draft = self.server_args.get("speculative_num_draft_tokens")
            if self.server_args.get("speculative_algorithm") and request.spec_verify_ct > 0 and draft:
                # tokenizer_manager.py:1825-1868 _calculate_spec_decoding_metrics
                guesses = request.spec_verify_ct * (draft - 1)
                if guesses > 0:
                    meta["spec_accept_rate"] = request.spec_accepted_tokens / guesses
                    meta["spec_accept_length"] = len(request.output_ids) / request.spec_verify_ct
                    meta["spec_accept_token_num"] = request.spec_accepted_tokens
                    meta["spec_draft_token_num"] = guesses
                    meta["spec_verify_ct"] = request.spec_verify_ct
        return {"text": request.text, "output_ids": list(request.output_ids), "meta_info": meta}

    # ---------------------------------------------------------------------------------- health

    async def check_health(self, timeout: float, poll: float) -> bool:
        """http_server.py:464-540: a 1-token generation; healthy once any output arrives after it started."""
        tic = time.time()
        request = Request(rid=f"HEALTH_CHECK_{tic}", input_tokens=1, max_new_tokens=1, log_metrics=False)
        self.batcher.submit(request)
        try:
            while time.time() < tic + timeout:
                await asyncio.sleep(poll)
                if self.batcher.last_output_at > tic:
                    self.server_status = ServerStatus.Up
                    return True
            tic_s = time.strftime("%H:%M:%S", time.localtime(tic))
            last_s = time.strftime("%H:%M:%S", time.localtime(self.batcher.last_output_at))
            self.log.error(f"Health check failed. Server couldn't get a response from detokenizer for last "
                           f"{timeout:g} seconds. tic start time: {tic_s}. last_heartbeat time: {last_s}")
            self.server_status = ServerStatus.UnHealthy
            return False
        finally:
            self.batcher.abort(request.rid)

    # ---------------------------------------------------------------------------------- scheduler control

    def internal_state(self) -> dict[str, Any]:
        """Scheduler.get_internal_state (scheduler.py:2650-2674)."""
        state = dict(self.runtime_args)
        state["last_gen_throughput"] = self.batcher.last_gen_throughput
        state["memory_usage"] = dict(self.memory_usage)
        state["effective_max_running_requests_per_dp"] = self.batcher.max_running_requests
        avg = self.batcher.avg_spec_accept_length()
        if self.server_args.get("speculative_algorithm") and avg is not None:
            state["avg_spec_accept_length"] = avg
        return state

    def set_internal_state(self, updates: dict[str, Any]) -> list[bool]:
        """Scheduler.set_internal_state (scheduler.py:2676-2714): answers updated=True even when it refused."""
        ok = True
        for key, value in updates.items():
            if key not in self.allowed_keys:
                self.scheduler_log.warning(f"Updating {key} is not supported.")
                ok = False
                break
            if key == "pp_max_micro_batch_size":
                limit = self.batcher.max_running_requests // (self.server_args.get("pp_size") or 1)
                if not isinstance(value, int) or value > limit or value < 1:
                    self.scheduler_log.warning(f"Updating {key} to {value} is rejected because it is out of the "
                                               f"valid range [1, {limit}].")
                    ok = False
                    break
            if key == THRESHOLD_ARG and self.threshold_validator is not None:
                try:
                    self.threshold_validator(value)
                except ValueError as err:
                    self.scheduler_log.warning(f"Updating {key} to {value!r} is rejected: {err}")
                    ok = False
                    break
        if ok:
            avg = self.batcher.avg_spec_accept_length()
            if self.server_args.get("speculative_algorithm") and avg is not None:
                self.scheduler_log.info(f"avg_spec_accept_length={avg}")
            self.batcher.reset_spec_totals()
            for key, value in updates.items():
                self.runtime_args[key] = value
                if key == THRESHOLD_ARG:
                    self.speculation.set_threshold(value)
            self.scheduler_log.info(f"Global server args updated! get_global_server_args()="
                                    f"{server_args_repr(self.runtime_args)}")
        return [True]

    def flush_cache(self) -> bool:
        if self.batcher.waiting or self.batcher.running:
            self.scheduler_log.warning(f"Cache not flushed because there are pending requests. "
                                       f"#queue-req: {len(self.batcher.waiting)}, "
                                       f"#running-req: {len(self.batcher.running)}")
            return False
        self.batcher.forward_ct_decode = 0
        self.batcher.num_generated_tokens = 0
        self.batcher.spec_num_accepted_tokens = self.batcher.spec_num_forward_ct = 0
        self.batcher.reset_spec_totals()
        self.scheduler_log.info("Cache flushed successfully!")
        return True
