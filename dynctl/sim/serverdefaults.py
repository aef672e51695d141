"""What sglang derives from its arguments before it serves: the part of ServerArgs.__post_init__ that
shows from the outside (0.5.9 server_args.py), and the memory plan a scheduler reports while loading.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dynctl.sim.sgltree import version_tuple

ARCHITECTURE = "SimulatedForCausalLM"
CONTEXT_LEN = 131072
KV_BYTES_PER_TOKEN = 70_000  # per GPU; MLA-like, so a big pool fits
WEIGHTS_GIB_PER_GPU = 48.0


class ServerArgsError(ValueError):
    """What __post_init__ raises for a combination sglang refuses."""


def _env_true(environ: dict[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def spec_v2_enabled(version: str, environ: dict[str, str]) -> bool:
    """SGLANG_ENABLE_SPEC_V2: off by default up to 0.5.10, on in 0.5.11-0.5.13, the only path from 0.5.14."""
    v = version_tuple(version)
    if v >= (0, 5, 14):
        return True
    return _env_true(environ, "SGLANG_ENABLE_SPEC_V2", v >= (0, 5, 11))


def finalize(args: dict[str, Any], version: str, gpu_total_mib: int,
             environ: dict[str, str] | None = None) -> list[str]:
    """Fill in derived values in place; returns the warnings sglang prints (before logging is set up)."""
    environ = os.environ if environ is None else environ
    warnings: list[str] = []
    if args.get("tokenizer_path") is None:
        args["tokenizer_path"] = args["model_path"]
    if args.get("served_model_name") is None:
        args["served_model_name"] = args["model_path"]
    if args.get("device") is None and "device" in args:
        args["device"] = "cuda"
    tp = args.get("tp_size") or 1
    # _handle_gpu_memory_settings (server_args.py:935-1004), H200 class (90-160 GB).
    if args.get("chunked_prefill_size") is None:
        args["chunked_prefill_size"] = 8192 if gpu_total_mib >= 60 * 1024 else 4096
    if args.get("cuda_graph_max_bs") is None:
        args["cuda_graph_max_bs"] = (256 if tp < 4 else 512) if gpu_total_mib >= 60 * 1024 else 160
    if args.get("mem_fraction_static") is None:
        reserved = max(512 + args["chunked_prefill_size"] * 1.5 + args["cuda_graph_max_bs"] * 2 + tp / 8 * 1024,
                       10 * 1024)
        if args.get("speculative_algorithm") in ("EAGLE", "EAGLE3"):
            reserved += 2 * 1024
        args["mem_fraction_static"] = round((gpu_total_mib - reserved) / gpu_total_mib, 3)
    algorithm = args.get("speculative_algorithm")
    if algorithm in ("EAGLE", "EAGLE3", "STANDALONE"):
        # server_args.py:2362-2366
        if args.get("max_running_requests") is None:
            args["max_running_requests"] = 48
            warnings.append("Max running requests is reset to 48 for speculative decoding. You can override this "
                            "by explicitly setting --max-running-requests.")
        if algorithm in ("EAGLE", "EAGLE3") and spec_v2_enabled(version, environ):
            args["disable_overlap_schedule"] = False
            warnings.append("Spec v2 is enabled for eagle/eagle3 speculative decoding and overlap schedule is "
                            "turned on.")
            topk = args.get("speculative_eagle_topk")
            if topk is not None and topk > 1:
                raise ServerArgsError("Spec v2 currently only supports topk = 1 for speculative decoding.")
        else:
            args["disable_overlap_schedule"] = True
            warnings.append("Overlap scheduler is disabled when spec v2 is off or using unsupported speculative "
                            "algorithm. You can set env SGLANG_ENABLE_SPEC_V2=True to enable the experimental "
                            "overlap scheduler. ")
        if args.get("speculative_num_steps") is None:
            if args.get("speculative_eagle_topk") is not None or args.get("speculative_num_draft_tokens") is not None:
                raise ServerArgsError("speculative_num_steps is not set but speculative_eagle_topk or "
                                      "speculative_num_draft_tokens is (server_args.py auto_choose_speculative_params)")
            # auto_choose_speculative_params: the default for architectures it does not list.
            args["speculative_num_steps"], args["speculative_eagle_topk"], args["speculative_num_draft_tokens"] = 3, 1, 4
        if args.get("speculative_eagle_topk") is None:
            args["speculative_eagle_topk"] = 1
        if args["speculative_eagle_topk"] == 1 and args.get("speculative_num_draft_tokens") != args["speculative_num_steps"] + 1:
            warnings.append("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                            "speculative_eagle_topk == 1")
            args["speculative_num_draft_tokens"] = args["speculative_num_steps"] + 1
    if "cuda_graph_config" in args and args.get("cuda_graph_config") is None:
        args["cuda_graph_config"] = _cuda_graph_config(args)
    return warnings


def _cuda_graph_config(args: dict[str, Any]) -> dict[str, Any]:
    """ServerArgs.cuda_graph_config as /server_info shows it (0.5.14 _handle_cuda_graph_config: the decode
    batch sizes are generated whether or not the decode graphs are then captured)."""
    from dynctl.sim.speculation import captured_batch_sizes

    decode_bs = args.get("cuda_graph_bs_decode") or captured_batch_sizes(
        {**args, "max_running_requests": None, "disable_cuda_graph": False})
    off = args.get("disable_cuda_graph") or args.get("disable_decode_cuda_graph")
    return {"decode": {"backend": "disabled" if off else "full", "max_bs": max(decode_bs) if decode_bs else None,
                       "bs": list(decode_bs), "tc_compiler": "eager"},
            "prefill": {"backend": "disabled", "max_bs": args.get("chunked_prefill_size"), "bs": None,
                        "tc_compiler": "eager"}}


@dataclass(frozen=True)
class MemoryPlan:
    context_gib: float
    weights_gib: float
    kv_gib: float
    graph_gib: float
    draft_gib: float
    draft_graph_gib: float
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int

    def usage(self) -> dict[str, float]:
        """Scheduler.get_internal_state()['memory_usage'] (scheduler.py:2650-2660)."""
        return {"weight": round(self.weights_gib, 2), "kvcache": round(self.kv_gib, 2),
                "token_capacity": self.max_total_num_tokens, "graph": round(self.graph_gib, 2)}


def plan_memory(args: dict[str, Any], gpu_total_gib: float) -> MemoryPlan:
    speculative = args.get("speculative_algorithm") in ("EAGLE", "EAGLE3")
    context = 0.59
    weights = WEIGHTS_GIB_PER_GPU
    draft = 1.6 if speculative else 0.0
    static = gpu_total_gib * (args.get("mem_fraction_static") or 0.88)
    kv = max(1.0, static - weights - draft - context)
    graph = 0.0 if args.get("disable_cuda_graph") else 1.3
    tokens = int(kv * (1 << 30) // KV_BYTES_PER_TOKEN)
    if args.get("max_total_tokens"):
        tokens = min(tokens, args["max_total_tokens"])
    context_len = args.get("context_length") or CONTEXT_LEN
    pool = max(2048, min(4096, int(tokens / context_len * 512)))
    requested = args.get("max_running_requests")
    running = min(tokens // 2 if requested is None else requested // (args.get("dp_size") or 1), pool)
    return MemoryPlan(context, weights, kv, graph, draft, 0.4 if speculative else 0.0, tokens, running, context_len)
