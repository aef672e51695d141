"""`python -m dynctl.sim`: start like sglang's launch_server, serve, and end like it.

Order of events as in 0.5.9 (launch_server.py, entrypoints/engine.py _launch_subprocesses,
entrypoints/http_server.py launch_server and _wait_and_warmup):
  import server_args → parse argv (exit 2 on a bad flag) → import the HTTP server (and scheduler.py) →
  log `server_args=...` → start scheduler(s) and detokenizer → wait for every scheduler's ready message →
  bind and listen (uvicorn) → warm-up request over HTTP → "The server is fired up and ready to roll!"
The port stays closed while the model "loads"; /health answers 503 until the warm-up is done.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

from dynctl.base import sglang
from dynctl.sim import costmodel, processes, sgltree
from dynctl.sim.batching import Batcher
from dynctl.sim.endpoints import Api
from dynctl.sim.gpus import GpuBoard
from dynctl.sim.httpserver import bind_socket, request_once, serve
from dynctl.sim.loglines import configure_logger, scheduler_logger, scheduler_prefix, uvicorn_loggers
from dynctl.sim.metrics import ServerMetrics
from dynctl.sim.options import OptionError, SimOptions, split_sim_options
from dynctl.sim.serverargs import PROG, ServerArgsSpec, merge_config_file, parse_server_args, read_server_args
from dynctl.sim.serverdefaults import ARCHITECTURE, ServerArgsError, finalize, plan_memory, spec_v2_enabled
from dynctl.sim.speculation import (
    THRESHOLD_ARG, ArgsView, build_speculation, captured_batch_sizes, read_adaptive_defaults,
)
from dynctl.sim.tokenizer import ServerStatus, TokenizerManager, server_args_repr

BANNER = "SIMULATED SGLang server (dynctl.sim): no GPU, no model; step times from GPU measurements"
WARMUP_TEXT = "The capital city of France is"


def main(argv: list[str]) -> int:
    try:
        options, sglang_argv = split_sim_options(argv)
    except OptionError as err:
        print(f"usage: {PROG} [-h] ...\n{PROG}: error: {err}", file=sys.stderr)
        return 2
    try:
        tree = sgltree.locate_sglang()
    except sgltree.TreeMissing:
        # What `python -m sglang.launch_server` prints when sglang is not installed (runpy).
        print(f"{sys.executable}: Error while finding module specification for 'sglang.launch_server' "
              f"(ModuleNotFoundError: No module named 'sglang')", file=sys.stderr)
        return 1
    checks = sgltree.main_process_checks(tree)
    try:
        sgltree.check_file(tree, *checks[0])  # launch_server.py imports server_args first
        spec = read_server_args(tree.file("srt/server_args.py"))
    except sgltree.TreeBroken as err:
        sys.stderr.write(err.report)
        return 1
    if sglang_argv[:1] == ["serve"]:  # `sglang serve ...`: the console script hands the rest to the same parser
        sglang_argv = sglang_argv[1:]
    if spec.declares(sglang.CONFIG_FLAG) and sglang.CONFIG_FLAG in sglang_argv:
        try:
            sglang_argv = merge_config_file(spec, sglang_argv)
        except (OSError, ValueError) as err:  # prepare_server_args raises; the server dies of it at start
            sys.stderr.write(_runpy_traceback(ValueError(str(err))))
            return 1
    args = parse_server_args(spec, sglang_argv)  # argparse: usage + exit 2 on a bad flag
    board = GpuBoard(options.gpu_dir)
    try:
        warnings = finalize(args, tree.version, board.gpus[0]["memory_total_mib"] if board.gpus else 143771)
    except ServerArgsError as err:
        sys.stderr.write(_runpy_traceback(err))
        return 1
    # Logged before configure_logger runs, so Python's last-resort handler prints the bare message.
    for line in warnings:
        print(line, file=sys.stderr)
    policy_module = None
    if tree.has_policy_module and spec.has_field(THRESHOLD_ARG):
        # The patched ServerArgs.__post_init__ validates the threshold through the policy module.
        try:
            policy_module = sgltree.load_policy_module(tree)
            check = (getattr(policy_module, "check_threshold_args", None)
                     or getattr(policy_module, "check_server_args", None))
            if check is not None:
                check(ArgsView(args))
        except Exception as err:  # noqa: BLE001 - the real server dies of it at start
            sys.stderr.write(_runpy_traceback(err, tree))
            return 1
    try:
        sgltree.check_file(tree, *checks[1])  # run_server imports the HTTP server, which imports scheduler.py
    except sgltree.TreeBroken as err:
        sys.stderr.write(err.report)
        return 1
    return Launch(options, tree, spec, args, board, policy_module).run()


def _runpy_traceback(err: BaseException, tree: sgltree.SglangTree | None = None) -> str:
    """Python's report for an exception raised while `python -m` runs: runpy's frames, then the frames
    that lie in the sglang tree (the simulator's own frames are not the server's)."""
    frames = []
    if tree is not None:
        root = str(tree.package_dir)
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename.startswith(root)]
    return ("Traceback (most recent call last):\n"
            '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
            '  File "<frozen runpy>", line 88, in _run_code\n'
            + "".join(traceback.format_list(frames))
            + "".join(traceback.format_exception_only(type(err), err)))


class Launch:
    def __init__(self, options: SimOptions, tree: sgltree.SglangTree, spec: ServerArgsSpec, args: dict[str, Any],
                 board: GpuBoard, policy_module: Any = None):
        self.options = options
        self.tree = tree
        self.spec = spec
        self.args = args
        self.board = board
        self.started = time.time()
        self.schedulers: list[processes.Child] = []
        self.detokenizer: processes.Child | None = None
        self.log = logging.getLogger("sglang.srt.entrypoints.http_server")
        self.policy_module = policy_module

    def run(self) -> int:
        args = self.args
        configure_logger("", args.get("log_level") or "info")
        engine_log = logging.getLogger("sglang.srt.entrypoints.engine")
        processes.set_ulimit()
        self.costs = costmodel.load_table()
        engine_log.info(f"{BANNER} ({self.costs.label}) at time scale {self.options.time_scale:g}")
        engine_log.info(f"server_args={server_args_repr(args)}")
        signal.signal(signal.SIGQUIT, self._launch_phase_sigquit)
        self.board.prune_dead()
        plan = plan_memory(args, self.board.total_gib(0) if self.board.gpus else 140.4)
        self.plan = plan
        try:
            self._start_children(plan)
            if self.options.ignore_sigterm:
                # After the children exist: SIG_IGN would be inherited across exec.
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            infos = processes.wait_ready(self.schedulers)
        except processes.SchedulerDied as err:
            engine_log.error(str(err))
            engine_log.error(f"Exit code: {err.exit_code}")
            processes.kill_process_tree(include_parent=False)
            sys.stderr.write(_runpy_traceback(EOFError()))
            return 1
        try:
            sock = bind_socket(args["host"], args["port"])
        except OSError as err:
            error_log, _ = uvicorn_loggers()
            error_log.error(f"[Errno {err.errno}] error while attempting to bind on address "
                            f"({args['host']!r}, {args['port']}): {err.strerror.lower() if err.strerror else err}")
            processes.kill_process_tree(include_parent=False)
            return 1
        return asyncio.run(self._serve(sock, infos[0]))

    # ---------------------------------------------------------------------------------------- children

    def _start_children(self, plan) -> None:
        args = self.args
        tp = args.get("tp_size") or 1
        speculative = args.get("speculative_algorithm") in ("EAGLE", "EAGLE3")
        common = {
            "tp_size": tp, "gpu_dir": str(self.options.gpu_dir) if self.options.gpu_dir else None,
            "load_wall_seconds": self.options.load_seconds / self.options.time_scale,
            "memory": {"context_gib": plan.context_gib, "weights_gib": plan.weights_gib, "kv_gib": plan.kv_gib,
                       "graph_gib": plan.graph_gib, "draft_gib": plan.draft_gib,
                       "draft_graph_gib": plan.draft_graph_gib},
            "architecture": ARCHITECTURE, "max_total_num_tokens": plan.max_total_num_tokens,
            "max_req_input_len": plan.context_len - 1, "max_running_requests": plan.max_running_requests,
            "chunked_prefill_size": args.get("chunked_prefill_size"), "context_len": plan.context_len,
            "capture_bs": captured_batch_sizes({**args, "max_running_requests": plan.max_running_requests}),
            "speculative": speculative, "spec_v2": spec_v2_enabled(self.tree.version, dict(os.environ)),
            "tree": str(self.tree.package_dir), "version": self.tree.version,
            "hang_on_start": self.options.hang_on_start, "log_level": args.get("log_level") or "info",
            "crash_at": (self.started + self.options.crash_after) if self.options.crash_after is not None else None,
        }
        base_gpu = args.get("base_gpu_id") or 0
        for rank in range(tp):
            prefix = scheduler_prefix(rank, tp)
            self.schedulers.append(processes.spawn_scheduler(
                {**common, "tp_rank": rank, "gpu_id": base_gpu + rank, "prefix": prefix}))
        self.detokenizer = processes.Child("detokenizer", processes.spawn("detokenizer", "sglang::detokenizer", {}))

    def schedulers_alive(self) -> bool:
        return all(child.alive() for child in self.schedulers)

    def _launch_phase_sigquit(self, signum, frame) -> None:
        logging.getLogger("sglang.srt.entrypoints.engine").error(
            "Received sigquit from a child process. It usually means the child failed.")
        processes.kill_process_tree(include_parent=True)

    # ---------------------------------------------------------------------------------------- serving

    async def _serve(self, sock, scheduler_info: dict) -> int:
        args, options, plan = self.args, self.options, self.plan
        loop = asyncio.get_running_loop()
        error_log, access_log = uvicorn_loggers()
        sched_log = scheduler_logger(scheduler_prefix(0, args.get("tp_size") or 1))
        metrics = ServerMetrics(args.get("served_model_name") or args["model_path"]) if args.get("enable_metrics") else None
        adaptive_defaults = read_adaptive_defaults(self.tree.file("srt/speculative/adaptive_spec_params.py")) if sgltree.version_tuple(self.tree.version) >= (0, 5, 14) else None
        speculation = build_speculation(
            {**args, "max_running_requests": plan.max_running_requests}, self.policy_module, adaptive_defaults,
            metrics.scheduler_labels if metrics else {}, metrics.registry if metrics else None, sched_log)
        costs = self.costs
        accept_rate = options.accept_rate if options.accept_rate is not None else costs.accept_rate
        batcher = Batcher(args, speculation, time_scale=options.time_scale, accept_rate=accept_rate, costs=costs,
                          seed=options.seed, max_total_num_tokens=plan.max_total_num_tokens,
                          max_running_requests=plan.max_running_requests, log=sched_log, metrics=metrics,
                          schedulers_alive=self._children_alive)
        allowed = sgltree.allowed_internal_state_keys(self.tree)
        validator = getattr(self.policy_module, "validate_threshold", None) if self.policy_module else None
        tokenizer = TokenizerManager(args, batcher, speculation, version=self.tree.version,
                                     context_len=plan.context_len, scheduler_info=scheduler_info,
                                     allowed_keys=allowed, memory_usage=plan.usage(), log=self.log,
                                     scheduler_log=sched_log, threshold_validator=validator)
        self.tokenizer = tokenizer
        if metrics is not None:
            metrics.set_gauge("max_total_num_tokens", plan.max_total_num_tokens)
        api = Api(tokenizer, metrics, options.time_scale, options.slow_health, options.slow_server_info)
        self._child_exited, self._alive = True, True
        loop.add_signal_handler(signal.SIGCHLD, self._on_sigchld)
        loop.add_signal_handler(signal.SIGQUIT, self._running_phase_sigquit)
        loop.add_signal_handler(signal.SIGINT, self._sigint)
        self._stop = loop.create_future()
        tokenizer.first_request_hook = self._create_handle_loop
        error_log.info(f"Started server process [{os.getpid()}]")
        error_log.info("Waiting for application startup.")
        server = await serve(sock, api.router(), access_log)
        tasks = [loop.create_task(batcher.run()), loop.create_task(self._publish_activity(batcher))]
        error_log.info("Application startup complete.")
        host = args["host"]
        error_log.info(f"Uvicorn running on http://{host}:{args['port']} (Press CTRL+C to quit)")
        tasks.append(loop.create_task(self._warmup(host, args["port"])))
        try:
            await self._stop
        finally:
            server.close()
            for task in tasks:
                task.cancel()
        error_log.info("Shutting down")
        error_log.info("Waiting for application shutdown.")
        error_log.info("Application shutdown complete.")
        error_log.info(f"Finished server process [{os.getpid()}]")
        processes.kill_process_tree(include_parent=False)
        return 0

    def _children_alive(self) -> bool:
        """Re-checked only after a SIGCHLD, so a dead scheduler stops the batching at once and cheaply."""
        if self._child_exited:
            self._child_exited = False
            self._alive = self.schedulers_alive()
        return self._alive

    async def _warmup(self, host: str, port: int) -> None:
        """_execute_server_warmup: GET /model_info, then one /generate of 8 tokens, over real HTTP."""
        target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
        await asyncio.sleep(1.0 / self.options.time_scale)
        await request_once(target, port, "GET", "/model_info", None)
        body = {"sampling_params": {"temperature": 0, "max_new_tokens": 8}, "text": WARMUP_TEXT}
        await request_once(target, port, "POST", "/generate", body)
        self.tokenizer.server_status = ServerStatus.Up
        self.log.info("The server is fired up and ready to roll!")
        if self.options.orphan_child:
            self._leave_orphan()

    def _leave_orphan(self) -> None:
        fd = processes.listening_fd(self.args["port"])
        if fd is None:
            return
        launcher = processes.spawn("orphan", "sglang::orphan", {"listen_fd": fd,
                                   "lifetime": self.options.orphan_lifetime}, pass_fds=(fd,))
        launcher.wait()

    async def _publish_activity(self, batcher: Batcher) -> None:
        while True:
            busy = 97 if batcher.running else 0
            self.board.set_activity(busy)
            await asyncio.sleep(1.0)

    # ---------------------------------------------------------------------------------------- signals

    def _create_handle_loop(self) -> None:
        """TokenizerManager.auto_create_handle_loop: the SIGTERM handler exists from the first request on."""
        if self.options.ignore_sigterm:
            return
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._sigterm)
        loop.create_task(self._sigterm_watchdog())

    def _sigterm(self) -> None:
        self.log.warning("SIGTERM received. signum=None frame=None. Draining requests and shutting down...")
        self.tokenizer.gracefully_exit = True

    async def _sigterm_watchdog(self) -> None:
        """tokenizer_manager.py:2113-2149, with its 5 s period divided by --time-scale."""
        period = 5.0 / self.options.time_scale
        tm = self.tokenizer
        while not tm.gracefully_exit:
            await asyncio.sleep(period)
        while True:
            if tm.server_status == ServerStatus.UnHealthy:
                self.log.error("Signal SIGTERM received while health check failed. Force exiting.")
                break
            if os.environ.get("SGL_FORCE_SHUTDOWN", "").lower() in ("1", "true", "yes"):
                self.log.error("Signal SIGTERM received while force shutdown flag set. Force exiting.")
                break
            remaining = list(tm.batcher.in_flight)
            self.log.info(f"Gracefully exiting... Remaining number of requests {len(remaining)}. "
                          f"Remaining requests remaining_rids={remaining}.")
            if not remaining:
                break
            await asyncio.sleep(period)
        processes.kill_process_tree(include_parent=True)

    def _on_sigchld(self) -> None:
        self._child_exited = True

    def _running_phase_sigquit(self) -> None:
        self.log.error("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
        processes.kill_process_tree(include_parent=True)

    def _sigint(self) -> None:
        if not self._stop.done():
            self._stop.set_result(None)
