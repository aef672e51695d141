"""What the patch inserts into each sglang file, and where (anchors), per compat variant.

Every change is an insertion of a fragment from `patches/fragments/` next to an anchor that
must occur exactly once, at the start of a line. Insertions only (nothing is deleted), so a
patched file can be un-patched by removing the fragments again, which is how an applied
patch is recognised and checked for hand edits.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from dynctl import resources, sglang

PACKAGE_PREFIX = "srt/"
SERVER_ARGS = "srt/server_args.py"
SCHEDULER = "srt/managers/scheduler.py"
EAGLE_WORKER = "srt/speculative/eagle_worker_v2.py"
NEW_MODULE = "srt/speculative/spec_batch_threshold.py"
OVERLAP_UTILS = "srt/managers/overlap_utils.py"
EAGLE_INFO_V2 = "srt/speculative/eagle_info_v2.py"

# Names only the patch brings into these files: their presence outside our fragments means a
# file was patched and then edited.
FEATURE_TOKENS = (
    sglang.THRESHOLD_KEY, "spec_batch_threshold", "_skip_speculation",
    "_forward_batch_generation_no_spec", "_spec_disable_",
)


@dataclass(frozen=True)
class Insertion:
    what: str  # said in refusals: "the speculative_num_draft_tokens field"
    fragment: str  # file name under patches/fragments/
    anchor: str = ""  # exact text, starting at a line start, that must occur exactly once
    before: bool = False  # insert before the anchor instead of after it
    at_end: bool = False  # append at the end of the file (anchor unused)

    @property
    def text(self) -> str:
        return fragment_text(self.fragment)


@dataclass(frozen=True)
class FileRecipe:
    path: str  # relative to the sglang package directory
    insertions: tuple[Insertion, ...]
    # Structural checks on the original text: each returns a problem description or None.
    checks: tuple[Callable[[str], str | None], ...] = field(default=())


@cache
def fragment_text(name: str) -> str:
    return (resources.patches_dir() / "fragments" / name).read_text(encoding="utf-8")


@cache
def new_module_text() -> str:
    return (resources.patches_dir() / "spec_batch_threshold.py").read_text(encoding="utf-8")


_NUM_DRAFT_TOKENS_ARG = (
    "        parser.add_argument(\n"
    '            "--speculative-num-draft-tokens",\n'
    "            type=int,\n"
    '            help="The number of tokens sampled from the draft model in Speculative Decoding.",\n'
    "            default=ServerArgs.speculative_num_draft_tokens,\n"
    "        )\n"
)


_NUM_DRAFT_TOKENS_FIELD_0_5_14 = (
    "    speculative_num_draft_tokens: A[\n"
    "        Optional[int],\n"
    '        "The number of tokens sampled from the draft model in Speculative Decoding.",\n'
    "    ] = None\n"
)


def _server_args(variant: str) -> FileRecipe:
    if variant == "0.5.14":
        # From 0.5.14 the command line is derived from the annotated fields: no add_argument.
        return FileRecipe(SERVER_ARGS, (
            Insertion("the speculative_num_draft_tokens field", "server_args.field-0.5.14.pyfrag",
                      _NUM_DRAFT_TOKENS_FIELD_0_5_14),
            Insertion("the handle_speculative_decoding(self) call in __post_init__", "server_args.check.pyfrag",
                      "        handle_speculative_decoding(self)\n"),
        ))
    return FileRecipe(SERVER_ARGS, (
        Insertion("the speculative_num_draft_tokens field", "server_args.field.pyfrag",
                  "    speculative_num_draft_tokens: Optional[int] = None\n"),
        Insertion("the _handle_speculative_decoding() call in __post_init__", "server_args.check.pyfrag",
                  "        self._handle_speculative_decoding()\n"),
        Insertion("the --speculative-num-draft-tokens add_argument block", "server_args.argument.pyfrag",
                  _NUM_DRAFT_TOKENS_ARG),
    ))


def _scheduler(variant: str) -> FileRecipe:
    # The metrics hand-over needs both the collector and the spec worker to exist; 0.5.6
    # creates the worker first, later releases create the metrics first.
    after_both = ("        self.init_metrics(tp_rank, pp_rank, dp_rank)\n" if variant == "0.5.6"
                  else "        self.init_model_worker()\n")
    lean = (Insertion("the init_overlap() call in Scheduler.__init__", "scheduler.future_map-0.5.12.pyfrag",
                      "        self.init_overlap()\n"),) if variant == "0.5.12" else ()
    return FileRecipe(SCHEDULER, lean + (
        Insertion("the set_internal_state allow-list", "scheduler.allow_list.pyfrag",
                  '                "speculative_accept_threshold_acc",\n'),
        Insertion("the set_internal_state key check", "scheduler.validate.pyfrag",
                  '                logging.warning(f"Updating {k} is not supported.")\n'
                  "                if_success = False\n"
                  "                break\n"),
        Insertion("the point where both metrics and the spec worker exist",
                  "scheduler.metrics-0.5.14.pyfrag" if variant == "0.5.14" else "scheduler.metrics.pyfrag",
                  after_both),
    ))


def _eagle_class_is_last(text: str) -> str | None:
    """The methods are appended at the end of the file, so EAGLEWorkerV2 must end it."""
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        return f"does not parse (line {err.lineno}: {err.msg})"
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.ClassDef) or last.name != "EAGLEWorkerV2":
        return "class EAGLEWorkerV2 is not the last definition in the file"
    if not text.endswith("\n"):
        return "the file does not end with a newline"
    return None


def _eagle_worker(variant: str) -> FileRecipe:
    if variant == "0.5.14":
        # 0.5.14 passes the ScheduleBatch and an on_publish callback; the fast path is one
        # fragment there (no one-token draft-extend, so no release-specific compat methods).
        return FileRecipe(EAGLE_WORKER, (
            Insertion("the SpeculativeAlgorithm import", "eagle_worker_v2.imports-0.5.14.pyfrag",
                      "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm\n"),
            Insertion("EAGLEWorkerV2.forward_batch_generation", "eagle_worker_v2.dispatch-0.5.14.pyfrag",
                      "    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None):\n"),
            Insertion("the end of class EAGLEWorkerV2", "eagle_worker_v2.methods-0.5.14.pyfrag", at_end=True),
            Insertion("the end of class EAGLEWorkerV2", "eagle_worker_v2.warm.pyfrag", at_end=True),
        ), checks=(_eagle_class_is_last,))
    return FileRecipe(EAGLE_WORKER, (
        Insertion("`import contextlib`", "eagle_worker_v2.stdlib.pyfrag", "import contextlib\n"),
        Insertion("the SpeculativeAlgorithm import", "eagle_worker_v2.imports.pyfrag",
                  "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm\n"),
        Insertion("EAGLEWorkerV2.forward_batch_generation", "eagle_worker_v2.dispatch.pyfrag",
                  "    def forward_batch_generation(self, model_worker_batch: ModelWorkerBatch):\n"),
        Insertion("the end of class EAGLEWorkerV2", "eagle_worker_v2.methods.pyfrag", at_end=True),
        Insertion("the end of class EAGLEWorkerV2", "eagle_worker_v2.warm.pyfrag", at_end=True),
        Insertion("the end of class EAGLEWorkerV2", f"eagle_worker_v2.compat-{variant}.pyfrag", at_end=True),
    ), checks=(_eagle_class_is_last,))


def _lean_plain_step(variant: str) -> tuple[FileRecipe, ...]:
    """Where a plain-decode step skips the speculative scheduler's bookkeeping: FutureMap
    resolves and stores only the bonus tokens and lengths, and prepare_for_decode takes the
    new lengths from the host instead of copying them back (sglang 0.5.12)."""
    if variant != "0.5.12":
        return ()
    return (
        FileRecipe(OVERLAP_UTILS, (
            Insertion("FutureMap.resolve_future's record_stream of the future indices",
                      "overlap_utils.resolve-0.5.12.pyfrag",
                      "            indices.record_stream(torch.get_device_module(self.device).current_stream())\n"),
            Insertion("FutureMap.store_to_map_for_new_batch's lazy buffer initialisation",
                      "overlap_utils.store-0.5.12.pyfrag", "        if not self.buf_initialized:\n", before=True),
        )),
        FileRecipe(EAGLE_INFO_V2, (
            Insertion("the seq_lens host copy in EagleDraftInputV2Mixin.prepare_for_decode",
                      "eagle_info_v2.known_lens-0.5.12.pyfrag", "        # FIXME(lsyin): make this sync optional\n",
                      before=True),
        )),
    )


def recipes(variant: str) -> tuple[FileRecipe, ...]:
    return (_server_args(variant), _scheduler(variant), _eagle_worker(variant)) + _lean_plain_step(variant)


def target_files() -> list[str]:
    """Files the patch strategy may touch (read for every release; each variant's recipes say
    which it changes), relative to the sglang package directory."""
    return [SERVER_ARGS, SCHEDULER, EAGLE_WORKER, OVERLAP_UTILS, EAGLE_INFO_V2, NEW_MODULE]
