"""`python -m dynctl.sim.child TITLE`: the simulator's child processes, shaped like sglang's.

  scheduler    one per TP rank (managers/scheduler.py run_scheduler_process): titled
               `sglang::scheduler[_TPn]`, dies with its parent (PR_SET_PDEATHSIG), logs the model-loading
               lines, "allocates" GPU memory step by step, imports (compiles) the speculative worker files,
               then reports ready on a pipe. On an exception it logs "Scheduler hit an exception: <traceback>"
               and sends SIGQUIT to the parent, as the real one does.
  detokenizer  managers/detokenizer_manager.py run_detokenizer_process: titled, dies with its parent.
  orphan       the fault switch --sim-orphan-child: forks a grandchild that leaves the session (setsid),
               keeps the inherited listening socket open and outlives the server.

The decode loop itself runs in the main process (batching.py); these processes exist for the process
tree, the GPU memory, the start-up log and the failure modes.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from dynctl.sim import sgltree
from dynctl.sim.gpus import GpuBoard
from dynctl.sim.loglines import configure_logger

CONFIG_ENV = "DYNCTL_SIM_CHILD"
PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def kill_itself_when_parent_died(parent: int) -> None:
    """utils/common.py:2440-2447 kill_itself_when_parent_died."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died before prctl took effect.
    if os.getppid() != parent:
        os._exit(1)


def set_title(title: str) -> None:
    """setproctitle as sglang calls it; without the package, at least the kernel's comm name."""
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(title)
        return
    except ImportError:
        pass
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def run_scheduler(cfg: dict) -> int:
    rank = cfg["tp_rank"]
    prefix = cfg["prefix"]
    set_title(cfg["title"])
    kill_itself_when_parent_died(cfg["parent_pid"])
    configure_logger(prefix, cfg.get("log_level", "info"))
    log = logging.getLogger("sglang.srt.managers.scheduler")
    board = GpuBoard(Path(cfg["gpu_dir"]) if cfg.get("gpu_dir") else None)
    ready_fd = cfg["ready_fd"]
    parent = cfg["parent_pid"]
    total_wall = cfg["load_wall_seconds"]
    mem = cfg["memory"]
    gpu = cfg["gpu_id"]
    title = cfg["title"]
    try:
        total = board.total_gib(gpu)
        held = 0.0

        def hold(gib: float) -> None:
            nonlocal held
            held += gib
            board.hold(gpu, held, title)

        tic = time.perf_counter()
        log.info("Init torch distributed begin.")
        _sleep(total_wall * 0.03)
        hold(mem["context_gib"])
        log.info(f"Init torch distributed ends. elapsed={time.perf_counter() - tic:.2f} s, "
                 f"mem usage={mem['context_gib']:.2f} GB")
        tic = time.perf_counter()
        log.info(f"Load weight begin. avail mem={total - held:.2f} GB")
        if cfg.get("hang_on_start"):
            while True:  # a load that never finishes (a stuck NFS read, a deadlocked NCCL init)
                time.sleep(3600)
        for _ in range(5):
            _sleep(total_wall * 0.11)
            hold(mem["weights_gib"] / 5)
        log.info(f"Load weight end. elapsed={time.perf_counter() - tic:.2f} s, type={cfg['architecture']}, "
                 f"dtype=torch.bfloat16, avail mem={total - held:.2f} GB, mem usage={mem['weights_gib']:.2f} GB.")
        _sleep(total_wall * 0.05)
        hold(mem["kv_gib"])
        log.info(f"KV Cache is allocated. #tokens: {cfg['max_total_num_tokens']}, KV size: {mem['kv_gib']:.2f} GB")
        log.info(f"Memory pool end. avail mem={total - held:.2f} GB")
        if cfg["capture_bs"]:
            log.info(f"Capture cuda graph bs {cfg['capture_bs']}")
            _sleep(total_wall * 0.12)
            hold(mem["graph_gib"])
        if cfg.get("speculative"):
            tree = sgltree.SglangTree(Path(cfg["tree"]), cfg["version"])
            for relative, frames in sgltree.scheduler_process_checks(tree, cfg["spec_v2"]):
                sgltree.check_file(tree, relative, frames, runpy=False)
            _sleep(total_wall * 0.05)
            hold(mem["draft_gib"])
            before = total - held
            tic = time.perf_counter()
            log.info(f"Capture draft cuda graph begin. This can take up to several minutes. avail mem={before:.2f} GB")
            _sleep(total_wall * 0.05)
            hold(mem["draft_graph_gib"])
            log.info(f"Capture draft cuda graph end. Time elapsed: {time.perf_counter() - tic:.2f} s. "
                     f"mem usage={mem['draft_graph_gib']:.2f} GB. avail mem={total - held:.2f} GB.")
        if rank == 0:
            log.info(f"max_total_num_tokens={cfg['max_total_num_tokens']}, "
                     f"chunked_prefill_size={cfg['chunked_prefill_size']}, max_prefill_tokens=16384, "
                     f"max_running_requests={cfg['max_running_requests']}, context_len={cfg['context_len']}, "
                     f"available_gpu_mem={total - held:.2f} GB")
    except sgltree.TreeBroken as err:
        log.error(f"Scheduler hit an exception: {err.report}")
        os.kill(parent, signal.SIGQUIT)
        return 0
    except Exception as err:  # noqa: BLE001 - any start-up failure is reported the sglang way
        log.error(f"Scheduler hit an exception: Traceback (most recent call last):\n{type(err).__name__}: {err}")
        os.kill(parent, signal.SIGQUIT)
        return 0
    with os.fdopen(ready_fd, "w") as pipe:
        pipe.write(json.dumps({"status": "ready", "max_total_num_tokens": cfg["max_total_num_tokens"],
                               "max_req_input_len": cfg["max_req_input_len"]}) + "\n")
    if cfg.get("crash_at") is not None and rank == 0:
        _sleep(cfg["crash_at"] - time.time())
        report = _crash_report(cfg)
        log.error(f"Scheduler hit an exception: {report}")
        os.kill(parent, signal.SIGQUIT)
        return 0
    while True:
        signal.pause()


def _crash_report(cfg: dict) -> str:
    scheduler = Path(cfg["tree"]) / "srt/managers/scheduler.py"
    lines = ["Traceback (most recent call last):\n"]
    for function, needle in (("run_scheduler_process", "scheduler.event_loop_overlap()"),):
        found = sgltree.find_line(scheduler, function, needle)
        if found:
            lines.append(f'  File "{scheduler}", line {found[0]}, in {function}\n    {found[1].strip()}\n')
    lines.append("RuntimeError: CUDA error: an illegal memory access was encountered\n"
                 "(simulated fault: --sim-crash-after / DYNCTL_SIM_CRASH_AFTER)")
    return "".join(lines)


def run_detokenizer(cfg: dict) -> int:
    kill_itself_when_parent_died(cfg["parent_pid"])
    set_title(cfg["title"])
    while True:
        signal.pause()


def run_orphan(cfg: dict) -> int:
    """Double fork: the grandchild is re-parented away from the server and keeps the port's socket."""
    fd = cfg["listen_fd"]
    if os.fork() > 0:
        return 0
    os.setsid()
    set_title(cfg["title"])
    # Stdout/stderr stay on the server log; nothing else of the parent is kept.
    timer = threading.Timer(cfg["lifetime"], lambda: os._exit(0))
    timer.daemon = True
    timer.start()
    os.set_inheritable(fd, False)
    while True:
        signal.pause()


def main(argv: list[str]) -> int:
    """argv[0] is only the process title; what to do comes from the parent through the environment."""
    cfg = json.loads(os.environ.pop(CONFIG_ENV, "{}"))
    runners = {"scheduler": run_scheduler, "detokenizer": run_detokenizer, "orphan": run_orphan}
    role = cfg.get("role")
    if role not in runners:
        print(f"dynctl.sim.child: started without a role in ${CONFIG_ENV}; the simulator starts these itself",
              file=sys.stderr)
        return 2
    return runners[role](cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
