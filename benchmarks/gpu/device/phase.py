#!/usr/bin/env python3
"""Device side of the GPU benchmark: install the carried trees, make the models, run sglang, measure.

Run from the repository root on the GPU machine, the carry folder (default .gpu, see prepare.sh)
next to it; one call per phase, each within the device's 10-minute limit:

  python3 .gpu/bin/phase.py speed --version 0.5.12.post1   # no-spec, pristine EAGLE-3, the patched tree
                                                           # with the draft kept warm and skipped, and a
                                                           # server `dynctl deploy` patches and starts:
                                                           # sweeps at 0, -1 and N (dynctl's own
                                                           # recommendation), greedy outputs scored on
                                                           # the no-spec server, 1,000 flips under load
  python3 .gpu/bin/phase.py check --version 0.5.11         # correctness: outputs, flips, scoring, a
                                                           # dynctl-deployed server: 1,000 flips, bench
  python3 .gpu/bin/phase.py repeat --version 0.5.12.post1  # the speed table, modes interleaved per level
  python3 .gpu14/bin/phase.py native --version 0.5.14      # >= 0.5.14: adaptive config (and its knob)
                                                           # against the patched fast path
  python3 .gpu/bin/phase.py tp --tp 2 --version 0.5.12.post1   # TP N: flips under load, no hang

Servers run in their own session; their logs, the sweeps and the scores land in $GPU_ENV/results and
come back in $OUT (results-<phase>-<version>.tar.gz, summary-<phase>-<version>.txt,
sweeps-<phase>-<version>.json, run-<phase>-<version>.json); `summarize.py` turns a run into
benchmarks/gpu/results/<version>.json. Each call starts from an empty results folder and empty server
logs (a warm machine's previous ones move to $GPU_ENV/previous/) and stamps every sweep row with its run
id, phase, release and the target's shape (runinfo.py), which summarize.py checks.

SERVER_CORES=N pins each server a phase launches to N cores of its own (see `_cores_for_next_server`);
SERVER_CORES_SHARED=1 pins every server to the same N cores instead;
SERVER_SLOT_SHIFT=k gives each server the cores of the one k places on (`launch_all`), and every call
with pinned servers times each core with one Python loop (`core_probe`, results/core-probe.json).

Two phases in one call (`a; b`, each with its own PHASE_BUDGET_S) name their files apart with
PHASE_TAG (e.g. PHASE_TAG=5.9b: results-profile-0.5.16-5.9b.tar.gz): the second one's start moves the
first one's results folder aside, after the first has bundled it into $OUT.
"""
import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
CARRY = os.path.dirname(HERE)
REPO = os.path.dirname(CARRY)
sys.path.insert(0, HERE)
import client  # noqa: E402
import runinfo  # noqa: E402

ENV = os.environ.get("GPU_ENV", "/tmp/gpuenv")
RES = os.path.join(ENV, "results")
T0 = time.time()
BUDGET = float(os.environ.get("PHASE_BUDGET_S", "560"))
LEVELS = os.environ.get("LEVELS", "1,2,4,8,16,32,64,128,256")
SWEEP = dict(warmup=float(os.environ.get("SWEEP_WARMUP", "1.2")),
             window=float(os.environ.get("SWEEP_WINDOW", "1.2")),
             windows=int(os.environ.get("SWEEP_WINDOWS", "3")))
SUMMARY = []
SUMMARY_FILE = None
RUN = {"run_id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(T0)) + f"-{os.getpid()}", "phase": None,
       "sglang": None, "model": None}  # stamped on every sweep row (runinfo.py); main() fills it in


def say(msg):
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    print(line, flush=True)
    SUMMARY.append(line)
    if SUMMARY_FILE:
        with open(SUMMARY_FILE, "a") as f:
            f.write(line + "\n")


def left():
    return BUDGET - (time.time() - T0)


STORED = os.path.join(ENV, "stored")  # files an earlier `store` call left on this (warm) machine


def carried(name):
    """Path of a file of the carry: in this carry folder, else stored on this machine by a `store` call
    (prepare.sh moves what does not fit one call into <carry>a), else joined from its two parts
    (<name>.part-a stored, <name>.part-b here); one that did not travel here is checked against the
    carry's SHA256SUMS."""
    here = os.path.join(CARRY, name)
    if os.path.exists(here):
        return here
    stored, a, b = os.path.join(STORED, name), os.path.join(STORED, name + ".part-a"), here + ".part-b"
    if not os.path.exists(stored) and os.path.exists(a) and os.path.exists(b):
        with open(stored + ".part", "wb") as out:
            for part in (a, b):
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        os.rename(stored + ".part", stored)
    if not os.path.exists(stored):
        raise SystemExit(not_stored(f"{name} is"))
    check_sum(name, stored)
    return stored


def not_stored(what):
    """The error for carry files (`what`: "NAME is") that this machine lacks, and what to do about it."""
    return (f"{what} neither in {CARRY} nor stored on this machine ({STORED}): carry "
            f"{os.path.basename(CARRY)}a (and {os.path.basename(CARRY)}b ... where prepare.sh made "
            f"them) each in a `store` call first, then this one at once (benchmarks/gpu/README.md)")


def has(name):
    """Whether the carry has the file `name`: here, stored by a `store` call, or as its stored part-a
    with the part-b here."""
    return (os.path.exists(os.path.join(CARRY, name)) or os.path.exists(os.path.join(STORED, name))
            or (os.path.exists(os.path.join(STORED, name + ".part-a"))
                and os.path.exists(os.path.join(CARRY, name + ".part-b"))))


def missing_tarballs():
    """The carry's tarballs (SHA256SUMS's `*.tar.xz`) that this machine lacks (`has`): a phase that
    needs them would stop at the first, so setup stops before it starts anything (a fresh machine has
    none of an earlier call's stores)."""
    return [n for n in carry_sums() if n.endswith(".tar.xz") and "/" not in n and not has(n)]


def carry_sums():
    """{file: sha256} of the carry as prepare.sh built it (its SHA256SUMS; empty without one)."""
    sums = os.path.join(CARRY, "SHA256SUMS")
    want = {}
    for line in (open(sums).read().splitlines() if os.path.exists(sums) else []):
        digest, listed = line.split(None, 1)
        want[listed[2:] if listed.startswith("./") else listed] = digest
    return want


def check_sum(name, path):
    """A file that did not travel in this call must be the one prepare.sh built for this carry."""
    want = carry_sums()
    if name not in want:
        raise SystemExit(f"{name}: stored on this machine, but {os.path.join(CARRY, 'SHA256SUMS')} does not "
                         f"list it; rebuild the carry")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != want[name]:
        raise SystemExit(f"{name}: the stored copy {path} is not this carry's (sha256 {h.hexdigest()[:12]}, "
                         f"SHA256SUMS {want[name][:12]}); carry its store folder in a `store` call again")


def extract(tar, dest, over=None):
    """`tar` unpacked at `dest` (over a copy of the folder `over`, for a tarball of changed files only),
    again whenever the tarball differs from the one unpacked there (a warm machine keeps ENV)."""
    tar = carried(os.path.basename(tar)) if os.path.dirname(tar) == CARRY else tar
    st = os.stat(tar)
    stamp = f"{os.path.basename(tar)} {st.st_size} {int(st.st_mtime)} {over or ''}"
    try:
        current = open(dest + ".stamp").read()
    except OSError:
        current = None
    if os.path.isdir(dest) and current == stamp:
        return
    shutil.rmtree(dest, ignore_errors=True)
    shutil.rmtree(dest + ".part", ignore_errors=True)
    if over:
        shutil.copytree(over, dest + ".part", symlinks=True)
    else:
        os.makedirs(dest + ".part")
    subprocess.run(["tar", "-xJf", tar, "-C", dest + ".part"], check=True)
    os.rename(dest + ".part", dest)
    with open(dest + ".stamp", "w") as f:
        f.write(stamp)


def release(version):
    """"0.5.15.post1" -> (0, 5, 15)."""
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def is_native(version):
    return release(version) >= (0, 5, 14)


def tree_env(version, kind, copy_as=None):
    """PYTHONPATH environment for the carried sglang tree `kind` (pristine/patched); `copy_as` gives
    a private copy of the tree (for dynctl to patch in place)."""
    kv = open(os.path.join(CARRY, f"sglang-{version}.kernels")).read().strip()
    extract(os.path.join(CARRY, "site.tar.xz"), os.path.join(ENV, "site"))
    extract(os.path.join(CARRY, f"kernels-{kv}.tar.xz"), os.path.join(ENV, f"kernels-{kv}"))
    t = f"sglang-{version}-{kind}"
    changed = os.path.join(CARRY, t + ".files.tar.xz")
    if not has(t + ".tar.xz") and has(os.path.basename(changed)):
        # a patched tree carried as the files the patch changes, laid over the pristine tree
        pristine = f"sglang-{version}-pristine"
        extract(os.path.join(CARRY, pristine + ".tar.xz"), os.path.join(ENV, pristine))
        extract(changed, os.path.join(ENV, t), over=os.path.join(ENV, pristine))
    else:
        extract(os.path.join(CARRY, t + ".tar.xz"), os.path.join(ENV, t))
    tree = os.path.join(ENV, t)
    if copy_as:
        tree = os.path.join(ENV, copy_as)
        if not os.path.isdir(tree):
            shutil.copytree(os.path.join(ENV, t), tree)
    path = [tree, os.path.join(ENV, f"kernels-{kv}")]
    overlay = os.path.join(CARRY, f"site-{version}.tar.xz")
    if has(os.path.basename(overlay)):
        extract(overlay, os.path.join(ENV, f"site-{version}"))
        path.append(os.path.join(ENV, f"site-{version}"))
    for name in extra_names(version):
        extract(os.path.join(CARRY, name + ".tar.xz"), os.path.join(ENV, name))
        path += [os.path.join(ENV, name)] + pth_dirs(os.path.join(ENV, name))
    env = dict(os.environ)
    env["PYTHONPATH"] = ":".join(path + [os.path.join(ENV, "site")])
    if not is_native(version):
        env["SGLANG_ENABLE_SPEC_V2"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def extra_names(version):
    """The large-package bundles (extra-<D>.tar.xz, deps-<D>-large.txt) this release's carry lists."""
    listed = os.path.join(CARRY, f"sglang-{version}.extra")
    return open(listed).read().split() if os.path.exists(listed) else []


def pth_dirs(site):
    """The folders that the .pth files of `site` add to sys.path, as site.addsitedir would (PYTHONPATH
    entries get no .pth processing: nvidia-cutlass-dsl is found only through its .pth)."""
    dirs = []
    for pth in sorted(glob.glob(os.path.join(site, "*.pth"))):
        for line in open(pth).read().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import ", "import\t")):
                d = os.path.normpath(os.path.join(site, line))
                if os.path.isdir(d):
                    dirs.append(d)
    return dirs


def run_py(env, code):
    r = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True)
    return r.returncode, (r.stdout.strip() or r.stderr.strip()[-2500:])


def import_check(env, version):
    """The launch path's modules; where the tree has them, also those that the EAGLE worker imports
    while it captures its CUDA graphs (dsa_backend, from 0.5.15) and the cutlass chain they need."""
    mods = ["sglang.srt.server_args", "sglang.srt.managers.scheduler", "sglang.srt.entrypoints.http_server",
            "sglang.srt.speculative.eagle_worker_v2"]
    tree = env["PYTHONPATH"].split(":")[0]
    # 0.5.14's dsa_backend imports deep_gemm at the top, and its EAGLE worker never imports it
    later = release(version) >= (0, 5, 15)
    for mod in ("sglang.srt.layers.attention.dsa_backend", "sglang.jit_kernel.dsa.cutedsl_paged_mqa_logits"):
        if later and os.path.exists(os.path.join(tree, *mod.split(".")) + ".py") and (
                "cutedsl" not in mod or extra_names(version)):
            mods.append(mod)
    if extra_names(version):
        mods.insert(0, "cutlass")
    # sgl_kernel loads its sm90 build only where a GPU says sm90 (it needs libcuda): on a CPU machine the
    # check stops short of it, and of the CUDA-only imports that sglang guards with is_cuda()
    first = "torch, sgl_kernel, flashinfer" if shutil.which("nvidia-smi") else "torch, flashinfer"
    rc, out = run_py(env, f"import {first}, transformers, sglang;"
                          f"import {', '.join(mods)};"
                          "print('torch', torch.__version__, 'sglang', sglang.__version__)")
    say(f"import check rc={rc} ({', '.join(mods)}): {out}")
    # what those modules import only where CUDA is present, which a CPU machine's check never reaches
    guarded = cuda_guarded_imports(tree, [m for m in mods if m.startswith("sglang")])
    missing_rc, missing = run_py(env, "import importlib.util, json, sys;"
                                      f"print(json.dumps([n for n in {sorted(guarded)!r}"
                                      " if importlib.util.find_spec(n) is None]))")
    missing = json.loads(missing.strip().splitlines()[-1]) if missing_rc == 0 else sorted(guarded)
    say(f"imports under a CUDA condition: {', '.join(sorted(guarded)) or 'none'}; not carried: "
        + (", ".join(f"{n} ({guarded[n][0][0]}:{guarded[n][0][1]})" for n in missing) or "none"))
    return rc == 0 and not missing


def cuda_guarded_imports(root, modules):
    """{top-level package: [(sglang module, line), ...]} of the imports that `modules` and the sglang
    modules they import at import time make inside an `if` whose condition names CUDA (`if is_cuda():`,
    `if _is_cuda:`), read from the source. Function bodies, `if TYPE_CHECKING:` and imports in a `try`
    that catches the ImportError are left out: they do not run, or fail softly, at import time."""
    import ast

    def path_of(mod):
        base = os.path.join(root, *mod.split("."))
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.exists(path):
                return path
        return None

    seen, todo, found = set(), list(modules), {}
    while todo:
        mod = todo.pop()
        path = None if mod in seen else path_of(mod)
        seen.add(mod)
        if path is None:
            continue
        pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]

        def visit(body, cuda, mod=mod, pkg=pkg):
            for node in body:
                if isinstance(node, ast.If):
                    test = ast.unparse(node.test).lower()
                    if "type_checking" not in test:
                        visit(node.body, cuda or ("cuda" in test and "hip" not in test))
                    visit(node.orelse, cuda)
                elif isinstance(node, ast.Try):
                    soft = any(h.type is None or "Error" in ast.unparse(h.type) or "Exception" in ast.unparse(h.type)
                               for h in node.handlers)
                    if not soft:
                        visit(node.body, cuda)
                    visit(node.orelse, cuda)
                    visit(node.finalbody, cuda)
                elif isinstance(node, (ast.With, ast.ClassDef)):
                    visit(node.body, cuda)
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    if isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    else:
                        base = node.module or ""
                        if node.level:
                            up = pkg
                            for _ in range(node.level - 1):
                                up = up.rpartition(".")[0]
                            base = up + ("." + node.module if node.module else "")
                        names = [base] + [f"{base}.{a.name}" for a in node.names]
                    for name in names:
                        if name.split(".")[0] == "sglang":
                            todo.append(name)
                        elif cuda:
                            found.setdefault(name.split(".")[0], []).append((mod, node.lineno))

        visit(ast.parse(open(path, encoding="utf-8").read(), path).body, False)
    return found


def jit_warmup(env):
    rc, out = run_py(env, "import time, torch, sgl_kernel; t=time.time();"
                          "x=torch.randn(8,4096,device='cuda',dtype=torch.bfloat16); w=torch.ones(4096,device='cuda',"
                          "dtype=torch.bfloat16); r=torch.randn_like(x); sgl_kernel.rmsnorm(x,w,1e-5);"
                          "sgl_kernel.fused_add_rmsnorm(x,r,w,1e-5); torch.cuda.synchronize();"
                          "print('flashinfer norm ready in %.0fs' % (time.time()-t))")
    say(f"jit warm-up rc={rc}: {out}")
    return rc == 0


def models():
    """The synthetic target and draft for GPU_MODEL_ARGS, in a folder of their own per shape, made
    (again) unless it holds models made with these args (recorded in made-with.txt), since a warm
    machine keeps earlier calls' models. Sets RUN's model shape."""
    args = os.environ.get("GPU_MODEL_ARGS", "").strip()
    tag = "models" + ("-" + re.sub(r"[^0-9a-z]+", "-", args).strip("-") if args else "")
    d = os.environ.get("GPU_MODELS") or (os.path.join("/dev/shm", tag) if shutil.disk_usage("/dev/shm").free > 40e9
                                         else os.path.join(ENV, tag))
    made_with = os.path.join(d, "made-with.txt")
    same = os.path.exists(made_with) and open(made_with).read() == args
    if not (same and os.path.exists(os.path.join(d, "draft", "model.safetensors"))):
        t = time.time()
        if os.path.exists(made_with):
            os.remove(made_with)
        shape = args.split()  # e.g. "--hidden 8192 --heads 64" for TP 8
        r = subprocess.run([sys.executable, os.path.join(HERE, "make_models.py"), "--out", d] + shape,
                           text=True, capture_output=True, env=dict(os.environ, PYTHONPATH=os.path.join(ENV, "site")))
        for line in (r.stdout + r.stderr).strip().splitlines()[-6:]:
            say("models: " + line)
        if r.returncode:
            raise SystemExit("model generation failed")
        with open(made_with, "w") as f:
            f.write(args)
        say(f"models made in {time.time() - t:.0f}s at {d}")
    RUN["model"] = runinfo.read_shape(d)
    say(f"target shape: {json.dumps(RUN['model'])}")
    return d


def setup(version, kinds):
    """Trees, JIT and models; the models are made on the GPU while the CPU work runs."""
    missing = missing_tarballs()
    if missing:
        raise SystemExit(not_stored(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"))
    made = {}
    mt = threading.Thread(target=lambda: made.update(m=models()))
    mt.start()
    envs = {k: tree_env(version, k) for k in kinds}
    ok = import_check(envs[kinds[0]], version) and jit_warmup(envs[kinds[0]])
    mt.join()
    if not ok or "m" not in made:
        raise SystemExit("setup failed")
    return envs, made["m"]


def gpu_free_gib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         text=True, capture_output=True).stdout.split()
    return float(out[0]) / 1024 if out else 0.0


# --------------------------------------------------------------------------- servers


# SERVER_CORES=N: each server launched in a call runs on N cores of its own (its processes inherit the
# affinity; whole physical cores, N rounded up to them), taken from the top of this process's cores,
# so that a host-bound step measures the server's code and not which cores it shared; the load and
# py-spy keep the rest, and this process (whose threads are the load) moves off the pinned cores while
# a server holds them. Unset: no pinning. SERVER_CORES_SHARED=1: every server runs on the first one's
# cores (the profile phase decodes on one server at a time, so an A/B pair measures its code on the
# same cores, not two cores' different speeds).
_PINNED = []
_OWN_CORES = set()  # this process's cores before it pinned a server


def _unpinned_cores():
    return _OWN_CORES - {c for cores in _PINNED for c in cores}


def _cores_for_next_server():
    per = int(os.environ.get("SERVER_CORES") or 0)
    if per <= 0:
        return None
    if not _PINNED:
        _OWN_CORES.clear()
        _OWN_CORES.update(os.sched_getaffinity(0))
        say("cores by physical core: " + " ".join(",".join(map(str, g)) for g in _physical_cores(_OWN_CORES)))
    if _PINNED and os.environ.get("SERVER_CORES_SHARED") == "1":
        _PINNED.append(list(_PINNED[0]))  # one entry a server: a stopped one gives back only its own
        return _PINNED[-1]
    # whole physical cores, the highest first: a server never shares one with the load through SMT
    free = _unpinned_cores()
    cores = []
    for group in reversed(_physical_cores(free)):
        if len(cores) >= per:
            break
        cores += group
    if len(cores) < per or not free - set(cores):  # one core at least stays with the load
        say(f"SERVER_CORES={per}: {len(free)} cores left, the next server is not pinned")
        return None
    cores = sorted(cores)
    _PINNED.append(cores)
    return cores


def _physical_cores(cores):
    """`cores` grouped by the physical core each belongs to, in order."""
    return sorted({tuple(sorted(_thread_siblings(c) & set(cores))) for c in cores})


def _thread_siblings(cpu):
    """The logical cores that share `cpu`'s physical core (the kernel's thread_siblings_list)."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    cores = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores or {cpu}


def _load_keeps_unpinned_cores():
    """This process's thread (and the load's threads it starts after) on the cores no server holds."""
    if _OWN_CORES:
        os.sched_setaffinity(0, _unpinned_cores())


class Server:
    def __init__(self, name, port, env=None, args=None, pid=None):
        self.name, self.port, self.env, self.args, self.pid = name, port, env, args or [], pid
        self.url = f"http://127.0.0.1:{port}"
        self.log = os.path.join(RES, name + ".log")
        self.proc = None
        self.cores = None

    def launch(self, extra_env=None):
        """Start in its own session. Servers share the GPU and start together: each profiles its KV
        budget as (free after its weights) - (free before) x (1 - fraction), so a high fraction keeps
        that positive however the starts interleave, and --max-total-tokens caps what each takes."""
        argv = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(self.port)
                ] + self.args
        self.cores = _cores_for_next_server()
        pinned = f" (pinned to cores {','.join(map(str, self.cores))})" if self.cores else ""
        say(f"{self.name}: start {' '.join(self.args[2:])}{pinned}")
        env = dict(self.env, **(extra_env or {}))
        cores = self.cores
        self.proc = subprocess.Popen(argv, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        self.pid = self.proc.pid
        if cores:
            _load_keeps_unpinned_cores()
        self.started = time.time()

    def alive(self):
        if self.proc is not None:
            return self.proc.poll() is None
        try:
            os.kill(self.pid, 0)
            return True
        except (OSError, TypeError):
            return False

    def wait_log(self, pattern, timeout):
        t = time.time()
        while time.time() - t < timeout:
            if self.grep(pattern):
                return True
            if not self.alive():
                return False
            time.sleep(0.5)
        return False

    def wait_ready(self, timeout=420):
        t = time.time()
        while time.time() - t < timeout:
            if not self.alive():
                say(f"{self.name}: EXITED during start; log tail:\n" + self.tail(30))
                return False
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        client.generate(self.url, [5, 6, 7, 8], 4)
                        say(f"{self.name}: ready {time.time() - self.started:.0f}s after start")
                        if self.cores:  # read back: sglang may bind its scheduler to a NUMA node itself
                            got = sorted(os.sched_getaffinity(scheduler_pid(self)))
                            say(f"{self.name}: scheduler runs on cores {got}"
                                + ("" if set(got) <= set(self.cores) else f", not only {self.cores}"))
                        return True
            except Exception:  # noqa: BLE001
                pass
            time.sleep(1)
        say(f"{self.name}: not ready after {timeout}s; log tail:\n" + self.tail(30))
        return False

    def tail(self, n):
        try:
            return "".join(open(self.log, errors="replace").readlines()[-n:])
        except OSError:
            return ""

    def grep(self, pat):
        try:
            return [l.rstrip() for l in open(self.log, errors="replace") if re.search(pat, l)]
        except OSError:
            return []

    def stop(self):
        """SIGTERM to the session this script created for it, SIGKILL after 30 s."""
        if self.pid and self.alive():
            try:
                os.killpg(self.pid, signal.SIGTERM)
                for _ in range(60):
                    if not self.alive():
                        break
                    time.sleep(0.5)
                else:
                    os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self.proc is not None:
                self.proc.wait(30)
        if self.cores in _PINNED:
            _PINNED.remove(self.cores)
            _load_keeps_unpinned_cores()
        bad = self.grep(r"Traceback|NaN|nan detected|leak|Error:")
        say(f"{self.name}: stopped; error-looking lines {len(bad)}" + ("\n  " + "\n  ".join(bad[:8]) if bad else ""))


def common_args(m, spec, extra=()):
    a = ["--model-path", os.path.join(m, "target"), "--skip-tokenizer-init", "--dtype", "bfloat16",
         "--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-radix-cache",
         "--max-running-requests", "256", "--max-total-tokens", "72000", "--mem-fraction-static", "0.82",
         "--enable-metrics",
         "--log-level", "info"]
    if spec:
        a += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", os.path.join(m, "draft"),
              "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4"]
    return a + os.environ.get("GPU_SERVER_ARGS", "").split() + list(extra)


def launch_all(plan):
    """Start the servers together (Server.launch says why that is safe), then wait for each; the
    ones that became ready, by name. With SERVER_CORES, SERVER_SLOT_SHIFT=k launches them k places
    further on in the plan's order, so that each server takes the cores another one took in a call
    without it (the slots go by launch order); then core_probe times every pinned core."""
    shift = int(os.environ.get("SERVER_SLOT_SHIFT") or 0) % max(1, len(plan))
    order = plan[shift:] + plan[:shift]
    if shift:
        say(f"SERVER_SLOT_SHIFT={shift}: launch order " + ", ".join(s.name for s in order))
    for s in order:
        s.launch()
    ready = {s.name: s for s in plan if s.wait_ready()}
    if _PINNED:
        core_probe(ready.values())
    return ready


# A fixed piece of pure-Python work, timed inside the process that runs it on one core.
_PROBE = ("import time\nt = time.perf_counter()\nx = 0\nfor i in range({n}):\n    x += i & 7\n"
          "print(time.perf_counter() - t)")


def core_probe(servers, loops=None):
    """The same Python loop on each core of each pinned server and of the load, one core at a time and
    then on all of them at once, in ms: whether a server's slot is slower than another's before its
    step is blamed on its code. The servers are idle meanwhile (ready, no request). Said, and written
    to $RES/core-probe.json; returns {slot: {"cores", "alone_ms", "together_ms"}}."""
    loops = loops or int(os.environ.get("CORE_PROBE_LOOPS") or 2_000_000)
    slots, seen = [], set()
    for s in servers:
        if s.cores and tuple(s.cores) not in seen:
            seen.add(tuple(s.cores))
            slots.append((s.name, list(s.cores)))
    if _OWN_CORES and _unpinned_cores():
        slots.append(("load", sorted(_unpinned_cores())))
    code = _PROBE.format(n=loops)

    def start(core):
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, {core}))

    def ms(proc):
        out, _ = proc.communicate()
        return round(1e3 * float(out), 1)

    alone = {core: ms(start(core)) for _, cores in slots for core in cores}
    running = {core: start(core) for _, cores in slots for core in cores}
    together = {core: ms(proc) for core, proc in running.items()}
    probe = {name: {"cores": cores, "alone_ms": [alone[c] for c in cores],
                    "together_ms": [together[c] for c in cores]} for name, cores in slots}
    with open(os.path.join(RES, "core-probe.json"), "w") as f:
        json.dump({"loops": loops, "slots": probe}, f, indent=1)
    say(f"core probe ({loops:,} Python loops a core, ms alone / all cores at once): " + "; ".join(
        f"{name} " + " ".join(f"{c}:{a}/{t}" for c, a, t in zip(p["cores"], p["alone_ms"], p["together_ms"]))
        for name, p in probe.items()))
    return probe


def log_text(line):
    """A server log line without its timestamp."""
    return re.sub(r"^\[[^\]]*\]\s*", "", line)


def graph_lines(s):
    keep = r"Capture (cuda graph|draft cuda graph|draft extend cuda graph) end|plain decode CUDA graphs"
    return [log_text(l) for l in s.grep(keep)]


def decode_lines(s, n=3):
    return [log_text(l) for l in s.grep(r"Decode batch")[-n:]]


def sweep(s, label, levels=LEVELS):
    if left() < 70:
        say(f"sweep {label}: skipped, {left():.0f}s of the phase budget left")
        return None
    rows = []
    client.generate(s.url, [5, 6, 7, 8], 8)
    for c in [int(x) for x in levels.split(",")]:
        if left() < 15:
            say(f"sweep {label}: stopped before c{c}, budget")
            break
        rows.append(client.sweep_level(s.url, c, PROMPTS, 128, **SWEEP))
    rows = runinfo.stamp(rows, RUN)
    json.dump(rows, open(os.path.join(RES, f"sweep-{label}.json"), "w"), indent=1)
    say(f"sweep {label}: " + ", ".join(f"c{r['concurrency']}={r['tok_s']:.0f}±{r['spread_pct']:.0f}%"
                                       f"({r['step_ms']:.1f}ms,spec{r['spec_share']})" for r in rows))
    return rows


def set_threshold(s, n):
    client.set_threshold(s.url, n)
    got = client.threshold_of(s.url)
    say(f"{s.name}: threshold {n} -> internal_states {got}")
    return got


# --------------------------------------------------------------------------- dynctl on this machine


def dynctl_env(version):
    """dynctl installed from its carried wheels into $GPU_ENV/dynsite; returns the env to run it with."""
    site = os.path.join(ENV, "dynsite")
    if not os.path.isdir(site):
        wheels = sorted(glob.glob(os.path.join(CARRY, "wheels", "*.whl")))
        if not wheels:  # moved to <carry>a by prepare.sh and stored by a `store` call
            wheels = sorted(glob.glob(os.path.join(STORED, "wheels", "*.whl")))
            for w in wheels:
                check_sum("wheels/" + os.path.basename(w), w)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                            "--no-compile", "--target", site] + wheels, text=True, capture_output=True)
        say(f"dynctl wheels installed rc={r.returncode} {r.stderr.strip()[-300:]}")
    env = dict(os.environ, PYTHONPATH=site, DYNCTL_CONFIG=os.path.join(ENV, "dynctl.toml"))
    env.pop("SGLANG_ENABLE_SPEC_V2", None)
    return env


def write_dynctl_config(version, models_dir, hosts):
    """One [hosts.X] per server: the device's python with the carried tree on PYTHONPATH."""
    lines = ['default_host = "%s"' % next(iter(hosts))]
    for name, (port, tree_env_, args) in hosts.items():
        lines.append(f"\n[hosts.{name}]")
        lines.append(f'python = "{sys.executable}"')
        lines.append(f'workdir = "{ENV}/dynwork-{name}"')
        lines.append(f"port = {port}")
        # the patch is what this phase measures: "auto" would take the native route where the
        # variant is not yet marked as measured (0.5.18 on)
        lines.append('strategy = "patch"')
        env = {"PYTHONPATH": tree_env_["PYTHONPATH"], "PYTHONUNBUFFERED": "1"}
        for k in ("SGLANG_ENABLE_SPEC_V2", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY", "SGLANG_SPEC_THRESHOLD_DRAFT"):
            if k in tree_env_:
                env[k] = tree_env_[k]
        lines.append("env = { " + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + " }")
        args = [x for x in args if x != "--enable-metrics"]  # dynctl adds it itself
        lines.append("args = [" + ", ".join(json.dumps(a) for a in args) + "]")
    open(os.path.join(ENV, "dynctl.toml"), "w").write("\n".join(lines) + "\n")


def dynctl(env, *argv, timeout=600):
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "dynctl", *argv], env=env, text=True, capture_output=True,
                       timeout=timeout)
    out = (r.stdout + r.stderr).strip()
    say(f"dynctl {' '.join(argv)} -> rc {r.returncode} in {time.time() - t:.1f}s: "
        + " | ".join(out.splitlines()[-6:])[:900])
    return r.returncode, out


def recommend_threshold(env, nospec, eagle3):
    """The threshold `dynctl bench --compare` would recommend from these two sweeps (its own code)."""
    code = (
        "import json, sys; from types import SimpleNamespace as N\n"
        "from dynctl.bench.recommend import recommend\n"
        "off, on = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))\n"
        "lv = lambda rows: [{'max_concurrency': r['concurrency'], 'output_throughput': r['tok_s']} for r in rows]\n"
        "rec = recommend([N(mode=N(threshold=0), levels=lv(off)), N(mode=N(threshold=-1), levels=lv(on))])\n"
        "print(json.dumps({'threshold': rec['threshold'], 'notes': rec.get('notes')}))\n")
    r = subprocess.run([sys.executable, "-c", code, nospec, eagle3], env=env, text=True, capture_output=True)
    if r.returncode:
        say("recommend failed: " + r.stderr.strip()[-600:])
        return None
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    say(f"dynctl's recommendation from the no-spec and EAGLE-3 sweeps: {rec}")
    return rec["threshold"]


# --------------------------------------------------------------------------- phases


PROMPTS = None


def prompts_file():
    global PROMPTS
    p = os.path.join(RES, "prompts.json")
    if not os.path.exists(p):
        client.cmd_prompts(client.Args(out=p))
    PROMPTS = json.load(open(p))
    return p


def prompts_files():
    """The prompts file, and one with its first 8 prompts (for the concurrency-1 runs)."""
    p = prompts_file()
    p8 = os.path.join(RES, "prompts8.json")
    json.dump(PROMPTS[:8], open(p8, "w"))
    return p, p8


def nan_detection(version):
    """`--enable-nan-detection` where the release has it (0.5.14 on it is gone from the server args)."""
    return [] if is_native(version) else ["--enable-nan-detection"]


class StrictDeploy:
    """`dynctl deploy --threshold N --host strict`, run in the background by pid; `finish()` leaves nothing
    of it running: a deploy still under way is interrupted (SIGINT, as Ctrl-C), which stops dynctl's
    command but not the operation on the host; that is followed to its end (`dynctl ops follow`) and
    the server it started is then stopped with `dynctl stop`. A server left running would hold GPU
    memory and a spinning scheduler core into the next call on the same machine."""

    def __init__(self, denv, n, host="strict"):
        self.denv, self.host, self.t, self.out, self.ended = denv, host, time.time(), "", False
        self.seen = threading.Condition()
        self.proc = subprocess.Popen([sys.executable, "-m", "dynctl", "deploy", "--threshold", str(n), "--yes",
                                      "--host", host], env=dict(denv, PYTHONUNBUFFERED="1"), text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.seen:
                self.out += line
                self.seen.notify_all()
        self.proc.wait()
        with self.seen:
            self.ended = True
            self.seen.notify_all()
        say(f"dynctl deploy --host {self.host} -> rc {self.proc.returncode} in {time.time() - self.t:.1f}s: "
            + " | ".join(self.out.strip().splitlines()[-6:])[:900])

    def printed(self, text, timeout):
        """Whether dynctl's output showed `text` within `timeout` seconds (False once it ended without)."""
        with self.seen:
            self.seen.wait_for(lambda: text in self.out or self.ended, timeout=timeout)
            return text in self.out

    def join(self, timeout):
        """The deploy's exit code once it ended within `timeout` seconds, else None."""
        self.reader.join(timeout=timeout)
        return None if self.reader.is_alive() else self.proc.returncode

    def finish(self):
        if self.proc.poll() is None:
            say("dynctl deploy of the strict server still running at the phase's end: interrupting it (SIGINT)")
            self.proc.send_signal(signal.SIGINT)
            if self.join(60) is None:
                self.proc.kill()  # dynctl itself, by its pid; what it started is stopped below
                self.reader.join(timeout=10)
            # the host runs one operation at a time: the latest is the one this deploy started
            dynctl(self.denv, "ops", "follow", "latest", "--host", self.host, timeout=300)
        dynctl(self.denv, "stop", "--host", self.host, "--yes", timeout=120)


def deploy_strict(version, m, n, hosts=None):
    """`dynctl deploy --threshold N` (a StrictDeploy) of a server on a private copy of the pristine tree
    with strict memory checks and NaN detection (host "strict", port 30004; `hosts` adds more to the
    config). Returns dynctl's environment and the deploy."""
    denv = dynctl_env(version)
    strict_env = tree_env(version, "pristine", copy_as=f"sglang-{version}-dynctl")
    strict_env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
    write_dynctl_config(version, m, dict(
        {"strict": (30004, strict_env, common_args(m, True, nan_detection(version)))}, **(hosts or {})))
    return denv, StrictDeploy(denv, n)


def strict_server():
    """The server deploy_strict() had dynctl start: its log is dynctl's server.log."""
    s = Server("strict", 30004)
    s.log = os.path.join(ENV, "dynwork-strict", "server.log")
    return s


def phase_speed(a):
    """Everything the fast path is judged on, in one call: five servers start together (no-spec and
    EAGLE-3 on the pristine tree, the patched tree with the draft kept warm and skipped, and one that
    `dynctl deploy` patches and starts with strict memory checks and NaN detection); then the sweeps,
    greedy outputs scored on the no-spec server, and 1,000 threshold flips under load."""
    envs, m = setup(a.version, ["pristine", "patched"])
    p, p8 = prompts_files()
    n = a.threshold
    thr = ["--speculative-disable-batch-threshold", "-1"]
    plan = [Server("nospec", 30000, envs["pristine"], common_args(m, False)),
            Server("eagle3", 30001, envs["pristine"], common_args(m, True)),
            Server("warm", 30002, envs["patched"], common_args(m, True, thr)),
            Server("skip", 30003, dict(envs["patched"], SGLANG_SPEC_THRESHOLD_DRAFT="skip"),
                   common_args(m, True, thr))]
    denv, deploy = deploy_strict(a.version, m, n, {
        "warm": (30002, envs["patched"], []), "skip": (30003, envs["patched"], [])})
    try:
        _speed(launch_all(plan), denv, deploy, p, p8, n)
    finally:
        deploy.finish()


def _speed(servers, denv, deploy, p, p8, n):
    deploy.join(120)  # its graph capture would disturb the first sweep
    for s in servers.values():
        for l in graph_lines(s):
            say(f"{s.name}: {l}")

    def measure(name, threshold, label):
        s = servers.get(name)
        if s is None:
            say(f"sweep {label}: no server")
            return
        if threshold is not None:
            set_threshold(s, threshold)
        sweep(s, label)
        for l in decode_lines(s, 1):
            say(f"{label} decode: {l}")

    measure("warm", 0, "warm-t0")
    measure("nospec", None, "nospec")
    measure("eagle3", None, "eagle3")
    files = [os.path.join(RES, f"sweep-{x}.json") for x in ("nospec", "eagle3")]
    if all(os.path.exists(f) for f in files):
        n = recommend_threshold(denv, *files) or n
        json.dump({"threshold": n}, open(os.path.join(RES, "recommended.json"), "w"))
    correctness(servers, p, p8, n)
    measure("skip", 0, "skip-t0")
    measure("warm", -1, "warm-tm1")
    if "warm" in servers:
        dynctl(denv, "threshold", str(n), "--yes", "--host", "warm")
        measure("warm", None, f"warm-t{n}")
    rc = deploy.join(max(1, left() - 100))
    say(f"dynctl deploy of the strict server: rc {rc}")
    if rc == 0 and left() > 45:
        strict = strict_server()
        dynctl(denv, "status", "--host", "strict")
        soak(strict, denv, n, flips=int(os.environ.get("FLIPS", "1000")))
    if "skip" in servers:
        dynctl(denv, "threshold", str(n), "--yes", "--host", "skip")
        measure("skip", None, f"skip-t{n}")


def correctness(servers, p, p8, n):
    """Greedy outputs at 0, N, -1 and flipping 0 <-> -1 every 0.3 s, scored on the no-spec server."""
    outs = []
    for name in ("warm", "skip"):
        s = servers.get(name)
        if s is None:
            continue
        for v in (0, n, -1):
            set_threshold(s, v)
            outs.append((p, gen(s, f"{name}-t{v}-c8", p, concurrency=8)))
        outs.append((p8, gen(s, f"{name}-flip-c1", p8, concurrency=1, flip_threshold="0,-1", flip_every=0.3)))
        outs.append((p, gen(s, f"{name}-flip-c8", p, concurrency=8, flip_threshold="0,-1", flip_every=0.3)))
        say(f"{name}: transition lines {len(s.grep(r'Speculation (disabled|enabled)'))}")
    ns = servers.get("nospec")
    if ns is None or not outs:
        return
    outs.insert(0, (p, gen(ns, "nospec-c8", p, concurrency=8)))
    score_outputs(ns, outs, (p, p8))


def score_outputs(ns, outs, prompt_files, tag="score"):
    """Teacher-forced scoring of greedy outputs [(prompts file, outputs file)] on the no-spec server."""
    rows = []
    for pf in prompt_files:
        files = [f for (q, f) in outs if q == pf]
        if files:
            rows += client.cmd_score(client.Args(url=ns.url, prompts=pf, files=files,
                                                 out=os.path.join(RES, f"{tag}-{len(rows)}.json")))
    json.dump(rows, open(os.path.join(RES, "score.json"), "w"), indent=1)
    for r in rows:
        say("score: " + json.dumps(r))
    return rows


def gen(s, label, prompts, **kw):
    out = os.path.join(RES, f"gen-{label}.json")
    client.cmd_gen(client.Args(url=s.url, prompts=prompts, out=out, **kw))
    return out


def soak(s, denv, n, flips):
    stop = threading.Event()
    load = {}

    def run_load():
        load["row"] = client.sweep_level(s.url, 48, PROMPTS, 128, warmup=0.5, window=1.0,
                                         windows=int(os.environ.get("SOAK_SECONDS", "75")),
                                         logprob_every=5)

    th = threading.Thread(target=run_load)
    th.start()
    done, errs, t = 0, 0, time.time()
    while done < flips and th.is_alive() and left() > 25:
        try:
            client.set_threshold(s.url, 0 if done % 2 == 0 else -1)
        except Exception:  # noqa: BLE001
            errs += 1
        done += 1
        time.sleep(float(os.environ.get("FLIP_EVERY", "0.02")))
    th.join()
    stop.set()
    rc, _ = dynctl(denv, "threshold", str(n), "--yes", "--host", "strict")
    health = client.generate(s.url, [5, 6, 7, 8], 4)
    row = load.get("row", {})
    say(f"soak: {done} flips in {time.time() - t:.0f}s ({errs} failed); load c48 with logprobs every 5th: "
        f"{row.get('tok_s')} tok/s, {row.get('errors')} request errors; health generate "
        f"{health.get('output_ids')}; transition lines {len(s.grep(r'Speculation (disabled|enabled)'))}; "
        f"error-looking lines {len(s.grep(r'Traceback|NaN|nan detected|leak|memory leak'))}")
    json.dump({"flips": done, "flip_errors": errs, "load": row}, open(os.path.join(RES, "soak.json"), "w"))


# What the check needs to reach its flips on a fresh machine: models and JIT ~85 s, two servers ~130 s
# with the deploy beside them (~140 s), then the teacher-forced runs and the deploy's 200 s of flips.
CHECK_BUDGET_S = 450


def phase_check(a):
    """Correctness on a release (e.g. 0.5.11, the 0.5.8 compat family): the patched tree with the
    draft kept warm (`extend`, the release-specific draft-extend code) and a server that `dynctl
    deploy --threshold N` patches and starts with strict memory checks and NaN detection (draft mode
    `auto`); greedy outputs at 2, 0, -1, N and with 0 <-> -1 flips every 0.3 s, scored on the no-spec
    server; then 1,000 flips under load on the deployed server and `dynctl bench --compare` on it.
    CHECK_TREE=NAME: the warm server runs the experiment tree NAME (see PROFILE_TREES) instead, with
    strict memory checks on; the deployed server stays dynctl's own patch. CHECK_STRICT=1: strict memory
    checks on the warm server whatever its tree."""
    if BUDGET < CHECK_BUDGET_S:
        say(f"PHASE_BUDGET_S={BUDGET:.0f} is below the {CHECK_BUDGET_S} s the check takes on a fresh machine: "
            f"the deploy, its flips and its bench will be cut")
    tree = os.environ.get("CHECK_TREE") or "patched"
    envs, m = setup(a.version, ["pristine", "patched"] + ([tree] if tree != "patched" else []))
    p, p8 = prompts_files()
    n = a.threshold
    denv, deploy = deploy_strict(a.version, m, n)
    try:
        _check(a, envs, m, denv, deploy, p, p8, n, tree)
    finally:
        deploy.finish()


def _check(a, envs, m, denv, deploy, p, p8, n, tree):
    warm_env = dict(envs[tree], SGLANG_SPEC_THRESHOLD_DRAFT=os.environ.get("CHECK_DRAFT", "extend"))
    strict_warm = tree != "patched" or os.environ.get("CHECK_STRICT") == "1"
    if strict_warm:
        warm_env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
    say(f"warm server: the {tree} tree" + (" with strict memory checks" if strict_warm else ""))
    plan = [Server(f"{a.version}-nospec", 30010, envs["pristine"], common_args(m, False)),
            Server(f"{a.version}-warm", 30011, warm_env,
                   common_args(m, True, ["--speculative-disable-batch-threshold", "2"]))]
    servers = launch_all(plan)
    s, ns = servers.get(f"{a.version}-warm"), servers.get(f"{a.version}-nospec")
    outs = []
    if s:
        for l in graph_lines(s):
            say(f"{s.name}: {l}")
        first_disabled_step(s)
        outs.append((p, gen(s, "check-t2-c8", p, concurrency=8)))
        for v in (0, -1):
            set_threshold(s, v)
            outs.append((p, gen(s, f"check-t{v}-c8", p, concurrency=8)))
        outs.append((p8, gen(s, "check-flip-c1", p8, concurrency=1, flip_threshold="0,-1", flip_every=0.3)))
        outs.append((p, gen(s, "check-flip-c8", p, concurrency=8, flip_threshold="0,-1", flip_every=0.3)))
        say(f"transition lines {len(s.grep(r'Speculation (disabled|enabled)'))}; decode: "
            + " | ".join(decode_lines(s, 3)))
    rc = deploy.join(max(1, left() - 200))
    say(f"dynctl deploy of the strict server: rc {rc}")
    strict = None
    if rc == 0:
        strict = strict_server()
        for l in graph_lines(strict):
            say(f"strict: {l}")
        dynctl(denv, "status", "--host", "strict")
        outs.append((p, gen(strict, f"strict-t{n}-c8", p, concurrency=8)))
        outs.append((p, gen(strict, "strict-flip-c8", p, concurrency=8, flip_threshold="0,-1", flip_every=0.3)))
        dynctl(denv, "threshold", str(n), "--yes", "--host", "strict")
    if ns and outs:
        score_outputs(ns, outs, (p, p8), "score-check")
    for x in servers.values():
        x.stop()
    if strict is not None and left() > 60:
        soak(strict, denv, n, flips=int(os.environ.get("FLIPS", "1000")))
    if strict is not None and left() > 60:
        bench = os.path.join(RES, "dynctl-bench-compare.json")
        dynctl(denv, "bench", "--host", "strict", "--compare", "--threshold", str(n),
               "--concurrency", os.environ.get("BENCH_LEVELS", "1,4,16,64"), "--input-len", "64",
               "--output-len", "128", "--duration", os.environ.get("BENCH_SECONDS", "4"), "--json", bench,
               timeout=max(30, int(left() - 20)))


def first_disabled_step(s):
    """The first disabled step of a fresh server: one 1-request generate at threshold -1, then at 0.
    Anything compiled on first use by the plain-decode step would show as a stall here."""
    timings = []
    for v in (-1, 0):
        client.set_threshold(s.url, v)
        t = time.time()
        client.generate(s.url, [5, 6, 7, 8], 16)
        timings.append(time.time() - t)
    client.set_threshold(s.url, 2)
    say(f"{s.name}: 16 new tokens at threshold -1 in {timings[0]:.3f}s, then the first disabled steps "
        f"(threshold 0) in {timings[1]:.3f}s")


def phase_repeat(a):
    """The speed table again, interleaved and with longer windows: at every level each mode is
    measured in turn (no-spec, EAGLE-3, and one patched server set to -1, 0 and N), the order rotating
    from level to level, so that the modes compared share the same minutes of the machine."""
    envs, m = setup(a.version, ["pristine", "patched"])
    prompts_file()
    n = a.threshold
    thr = ["--speculative-disable-batch-threshold", "-1"]
    plan = [Server("nospec", 30000, envs["pristine"], common_args(m, False)),
            Server("eagle3", 30001, envs["pristine"], common_args(m, True)),
            Server("patched", 30002, envs["patched"], common_args(m, True, thr))]
    servers = launch_all(plan)
    for s in servers.values():
        for l in graph_lines(s):
            say(f"{s.name}: {l}")
        client.generate(s.url, [5, 6, 7, 8], 8)
    modes = [("nospec", "nospec", None), ("eagle3", "eagle3", None), ("warm-tm1", "patched", -1),
             ("skip-t0", "patched", 0), (f"skip-t{n}", "patched", n)]
    interleaved(servers, modes)
    for s in servers.values():
        s.stop()


def phase_native(a):
    """sglang >= 0.5.14: its own adaptive speculation with the config dynctl generates for N (carried
    as adaptive-t<N>.json/.argv.json), the same with SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1, and the
    tree patched by dynctl (the plain-decode fast path), next to no-spec and EAGLE-3; greedy outputs of
    the patched server scored on the no-spec one, then every mode interleaved per level."""
    envs, m = setup(a.version, ["pristine", "patched"])
    p, p8 = prompts_files()
    n = a.threshold
    cfg = os.path.join(CARRY, f"adaptive-t{n}.json")
    adaptive = [x.replace("{config}", cfg) for x in json.load(open(os.path.join(CARRY, f"adaptive-t{n}.argv.json")))]
    say(f"dynctl adaptive config, threshold {n}: {json.dumps(json.load(open(cfg)), sort_keys=True)}; "
        f"flags {' '.join(adaptive)}")
    thr = ["--speculative-disable-batch-threshold", "-1"]
    plan = [Server("nospec", 30000, envs["pristine"], common_args(m, False)),
            Server("eagle3", 30001, envs["pristine"], common_args(m, True)),
            Server("adaptive", 30002, envs["pristine"], common_args(m, True, adaptive)),
            Server("adaptive-skipdx", 30003, dict(envs["pristine"], SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND="1"),
                   common_args(m, True, adaptive)),
            Server("patched", 30004, envs["patched"], common_args(m, True, thr))]
    servers = launch_all(plan)
    for s in servers.values():
        for l in graph_lines(s) + s.grep(r"Built adaptive runtime state|AdaptiveSpeculativeParams initialized")[:3]:
            say(f"{s.name}: " + log_text(l)[:400])
        client.generate(s.url, [5, 6, 7, 8], 8)
    ps, ns = servers.get("patched"), servers.get("nospec")
    if ps:
        first_disabled_step(ps)
        outs = []
        for v in (0, n, -1):
            set_threshold(ps, v)
            outs.append((p, gen(ps, f"patched-t{v}-c8", p, concurrency=8)))
        outs.append((p8, gen(ps, "patched-flip-c1", p8, concurrency=1, flip_threshold="0,-1", flip_every=0.3)))
        outs.append((p, gen(ps, "patched-flip-c8", p, concurrency=8, flip_threshold="0,-1", flip_every=0.3)))
        say(f"patched: transition lines {len(ps.grep(r'Speculation (disabled|enabled)'))}")
        if ns:
            outs.insert(0, (p, gen(ns, "nospec-c8", p, concurrency=8)))
            score_outputs(ns, outs, (p, p8))
    modes = [("nospec", "nospec", None), ("eagle3", "eagle3", None), (f"adaptive-t{n}", "adaptive", None),
             (f"adaptive-skipdx-t{n}", "adaptive-skipdx", None), ("patched-tm1", "patched", -1),
             ("patched-t0", "patched", 0), (f"patched-t{n}", "patched", n)]
    interleaved(servers, modes)
    for s in servers.values():
        s.stop()


def py_spy():
    """py-spy's argv when its carried wheel (<carry>/whl/py_spy-*.whl) unpacks and runs, else None."""
    wheels = glob.glob(os.path.join(CARRY, "whl", "py_spy-*.whl"))
    if not wheels:
        return None
    dest = os.path.join(ENV, "pyspy")
    if not os.path.isdir(dest):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", dest,
                        wheels[0]], capture_output=True)
    exe = glob.glob(os.path.join(dest, "bin", "py-spy")) + glob.glob(os.path.join(dest, "*", "bin", "py-spy"))
    if exe and subprocess.run([exe[0], "--version"], capture_output=True).returncode == 0:
        # PYSPY_IDLE=1: idle samples too (where the scheduler blocks, not only where it computes)
        return [exe[0], "record"] + (["--idle"] if os.environ.get("PYSPY_IDLE") == "1" else [])
    say("py-spy: not usable")
    return None


def scheduler_pid(s):
    """The pid of the server's scheduler process (its TP-0 child, titled sglang::scheduler)."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = open(f"/proc/{p}/stat").read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            title = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ppid == s.pid and "scheduler" in title:
            return int(p)
    return s.pid


def phase_profile(a):
    """Step cost at fixed batch sizes: the no-spec server against the patched one at threshold 0 (and,
    with PROFILE_MODES, other threshold values or an EAGLE-3 server), each level measured on all
    servers in turn with every request decoding (no prefill in the window), and at PROFILE_LEVELS a
    torch-profiler trace of PROFILE_STEPS steps summarised per step (trace_summary.py): wall, GPU busy
    and idle, kernels, CUDA runtime calls, top-level aten operators."""
    import trace_summary

    trees = ["pristine", "patched"] + [t for t in os.environ.get("PROFILE_TREES", "").split(",") if t]
    envs, m = setup(a.version, trees)
    kv_tokens = int(os.environ.get("PROFILE_KV_TOKENS", "180000"))
    big = ["--max-total-tokens", str(kv_tokens)]
    thr = ["--speculative-disable-batch-threshold", "0"]
    plan = [Server("nospec", 30000, envs["pristine"], common_args(m, False, big)),
            Server("patched", 30002, envs["patched"], common_args(m, True, thr + big))]
    # other patched trees (e.g. the patch of an earlier commit), each a server of its own
    for i, t in enumerate(trees[2:]):
        plan.append(Server(t, 30010 + i, envs[t], common_args(m, True, thr + big)))
    pyspy = py_spy()
    if os.environ.get("PROFILE_EAGLE3"):
        plan.append(Server("eagle3", 30001, envs["pristine"], common_args(m, True, big)))
    # PROFILE_SERVERS: more servers, a JSON list of {"name", "tree" (pristine/patched/...), "spec": bool,
    # "args": [server flags], "env": {variables of its own}, "threshold": set before each level (omit: as
    # started)}
    extra_servers = json.loads(os.environ.get("PROFILE_SERVERS") or "[]")
    for i, x in enumerate(extra_servers):
        spec = bool(x.get("spec"))
        plan.append(Server(x["name"], 30020 + i, dict(envs[x.get("tree", "patched")], **x.get("env", {})),
                           common_args(m, spec, (thr if spec and x.get("tree", "patched") != "pristine" else [])
                                       + big + list(x.get("args", [])))))
    servers = launch_all(plan)
    for s in servers.values():
        for line in graph_lines(s):
            say(f"{s.name}: {line}")
        client.generate(s.url, [5, 6, 7, 8], 8)
    if "patched" in servers:
        first_disabled_step(servers["patched"])
        if "nospec" in servers and os.environ.get("LOGPROB_CHECK", "1") == "1":
            # logprob requests on disabled steps: served by the plain step, equal to a no-spec server's
            rng = __import__("random").Random(3)
            lp_prompts = [[rng.randrange(3, 32000) for _ in range(24)] for _ in range(16)]
            base = client.logprob_outputs(servers["nospec"].url, lp_prompts, 48)
            for name in [n for n in servers if n != "nospec"]:
                ps = servers[name]
                client.set_threshold(ps.url, 0)
                d0 = client.read_metrics(ps.url)["disabled_steps"]
                got = client.logprob_outputs(ps.url, lp_prompts, 48)
                d1 = client.read_metrics(ps.url)["disabled_steps"]
                say(f"{name}: logprob requests at threshold 0: {int(d1 - d0)} disabled steps; against no-spec "
                    + json.dumps(client.compare_logprobs(base, got)))
    # label, server, threshold set before the level (None: as started)
    modes = [("nospec", "nospec", None), ("t0", "patched", 0)] + [(f"{t}-t0", t, 0) for t in trees[2:]]
    modes += [(x["name"], x["name"], x.get("threshold")) for x in extra_servers]
    for extra in filter(None, os.environ.get("PROFILE_MODES", "").split(",")):
        modes.append((f"t{extra}", "patched", int(extra)) if extra.lstrip("-").isdigit() else (extra, extra, None))
    modes = [x for x in modes if x[1] in servers]
    prof_levels = {int(x) for x in os.environ.get("PROFILE_LEVELS", "1,16,64,256").split(",") if x}
    steps_k = int(os.environ.get("PROFILE_STEPS", "20"))
    window = float(os.environ.get("STEADY_WINDOW", "0.9"))
    spy_levels = {int(x) for x in os.environ.get("PYSPY_LEVELS", "").split(",") if x}
    if spy_levels and not pyspy:
        say(f"PYSPY_LEVELS={','.join(map(str, sorted(spy_levels)))}: no samples, no usable py-spy (its wheel, "
            f"py_spy-*.whl, goes in {os.path.join(CARRY, 'whl')} before the call)")
    spy_s = float(os.environ.get("PYSPY_SECONDS", "1.0"))
    logprob_every = int(os.environ.get("STEADY_LOGPROB_EVERY", "0"))
    trace_dir = os.path.join(RES, "traces")
    os.makedirs(trace_dir, exist_ok=True)
    rows = {label: [] for label, _, _ in modes}
    est_ms = 1.0
    for i, c in enumerate(int(x) for x in LEVELS.split(",")):
        if left() < 12 * len(modes):
            say(f"profile: stopped before c{c}, budget")
            break
        # enough tokens for the ramp, the window and the traced steps, within each server's KV budget
        need = int((window + 0.5 + (spy_s if c in spy_levels else 0)) * 1000 / est_ms) + steps_k + 80
        max_new = max(64, min(need, kv_tokens // c - 32))
        for label, name, threshold in modes[i % len(modes):] + modes[:i % len(modes)]:
            s = servers[name]
            if threshold is not None:
                client.set_threshold(s.url, threshold)
            prof = ({"dir": trace_dir, "steps": steps_k, "prefix": f"{label}-c{c}"} if c in prof_levels else None)
            sample = None
            if pyspy and c in spy_levels:
                sample = {"argv": pyspy, "pid": scheduler_pid(s), "seconds": spy_s, "rate": 1000,
                          "out": os.path.join(RES, f"pyspy-{label}-c{c}.txt")}
            r = client.steady_level(s.url, c, max_new, window, profile=prof, sample=sample,
                                    logprob_every=logprob_every)
            r["label"], r["max_new_tokens"] = label, max_new
            if r.get("trace"):
                r["profile"] = trace_summary.summarize(r["trace"], steps_k)
            rows[label].append(r)
        base = rows[modes[0][0]][-1]
        est_ms = max(r[-1]["step_ms"] or est_ms for r in rows.values())
        say(f"c{c} (max_new {max_new}): " + ", ".join(
            f"{label}={rows[label][-1]['step_ms']}ms±{rows[label][-1]['spread_pct']}%"
            f"(x{(rows[label][-1]['step_ms'] or 0) / (base['step_ms'] or 1):.3f},"
            f"tps{rows[label][-1]['tokens_per_step']},spec{rows[label][-1]['spec_share']},"
            f"graph{rows[label][-1]['graph_share']},run{rows[label][-1]['running']})"
            for label, _, _ in modes))
        if c in prof_levels:
            for label, _, _ in modes:
                pr = rows[label][-1].get("profile") or {}
                if "wall_us" in pr:
                    say(f"  profile {label} c{c}: wall {pr['wall_us']}us, gpu busy {pr['gpu_busy_us']}us, "
                        f"idle {pr['gpu_idle_us']}us, gpu activities {pr['gpu_activities_per_step']}, "
                        f"cpu ops {pr['cpu_ops_per_step']} ({pr['cpu_op_us']}us)")
                else:
                    say(f"  profile {label} c{c}: {pr.get('error', 'no trace')}")
    for label, rs in rows.items():
        json.dump(runinfo.stamp(rs, RUN), open(os.path.join(RES, f"steady-{label}.json"), "w"), indent=1)
    closed_loop(servers, modes, pyspy, spy_s)
    report_traces({f"{r['label']}-c{r['concurrency']}": r["profile"] for rs in rows.values() for r in rs
                   if "wall_us" in (r.get("profile") or {})}, modes[0][0], "profile-summary.json")
    shutil.rmtree(trace_dir, ignore_errors=True)  # summarised; too large to return
    for s in servers.values():
        s.stop()


def closed_loop(servers, modes, pyspy, spy_s):
    """At CLOSED_LEVELS, the speed phase's closed loop (128 new tokens per request, prefills mixed in)
    on every mode in turn, with the servers' whole /metrics text at the window's start and end and,
    where py-spy travelled, the scheduler sampled during the window: where a closed loop's time goes
    beyond the decode steps that the steady levels time. At CLOSED_TRACE_LEVELS, after the windows,
    sglang's torch profiler records CLOSED_TRACE_STEPS steps of the loop (prefills included)."""
    import trace_summary

    levels = [int(x) for x in os.environ.get("CLOSED_LEVELS", "").split(",") if x]
    if levels and PROMPTS is None:
        prompts_file()
    rows = {label: [] for label, _, _ in modes}
    trace_levels = {int(x) for x in os.environ.get("CLOSED_TRACE_LEVELS", "").split(",") if x}
    trace_steps = int(os.environ.get("CLOSED_TRACE_STEPS", "60"))
    trace_dir = os.path.join(RES, "closed-traces")
    os.makedirs(trace_dir, exist_ok=True)
    traces = {}
    # CLOSED_ROUNDS: each level measured that many times on every mode, the order rotating per round, so
    # that a mode's rows span the same minutes as the others'; py-spy, traces and /metrics in round 0 only
    rounds = int(os.environ.get("CLOSED_ROUNDS", "1"))
    windows = int(os.environ.get("CLOSED_WINDOWS", "2"))
    spy_seconds = max(1, round(spy_s))  # py-spy's --duration takes whole seconds
    for c in levels:
        if left() < 15 * len(modes) * rounds:
            say(f"closed loop: stopped before c{c}, budget")
            break
        for label, name, threshold, rnd in [m + (k,) for k in range(rounds)
                                            for m in modes[k % len(modes):] + modes[:k % len(modes)]]:
            s = servers[name]
            if threshold is not None:
                client.set_threshold(s.url, threshold)
            tag = f"closed-{label}-c{c}"
            spy_out = os.path.join(RES, f"pyspy-{tag}.txt")
            spy = []

            def on_measure(start, s=s, tag=tag, spy=spy, spy_out=spy_out, c=c, label=label, rnd=rnd):
                if rnd:
                    return
                with open(os.path.join(RES, f"{tag}-metrics-{'start' if start else 'end'}.txt"), "w") as f:
                    f.write(client.get(s.url, "/metrics", timeout=30))
                if not start and c in trace_levels:
                    # after the measured windows, with the loop still running: K steps of the mix traced
                    traced = client.trace_steps(s.url, trace_dir, trace_steps, tag)
                    traces[f"{label}-c{c}"] = (trace_summary.summarize(traced, trace_steps) if traced
                                               else {"error": "no trace"})
                if start and pyspy:
                    spy.append(subprocess.Popen(
                        pyspy + ["--duration", str(spy_seconds), "--rate", "1000", "--format", "raw",
                                 "--nonblocking", "--output", spy_out,
                                 "--pid", str(scheduler_pid(s))],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

            r = client.sweep_level(s.url, c, PROMPTS, 128, warmup=float(os.environ.get("CLOSED_WARMUP", "1.5")),
                                   window=max(spy_s, 1.0), windows=windows, on_measure=on_measure)
            for proc in spy:
                proc.wait(timeout=60)
            if spy:
                # py-spy ran from the windows' start for this many seconds (pyspy_summary.py scales the
                # first window's decode steps to it)
                r["sampled"] = {"out": spy_out, "seconds": spy_seconds}
            r["label"], r["round"] = label, rnd
            rows[label].append(r)

        def line(label, c=c):
            got = sorted(r["tok_s"] for r in rows[label] if r["concurrency"] == c)
            mid = got[len(got) // 2]
            last = rows[label][-1]
            return (f"{label}={mid:.0f}tok/s±{last['spread_pct']:.0f}%({last['step_ms']}ms/decode step)"
                    + (f"[rounds {got[0]:.0f}-{got[-1]:.0f}]" if len(got) > 1 else ""))
        say(f"closed c{c}: " + ", ".join(line(label) for label, _, _ in modes if rows[label]))
    for label, rs in rows.items():
        if rs:
            json.dump(runinfo.stamp(rs, RUN), open(os.path.join(RES, f"closed-{label}.json"), "w"), indent=1)
    if traces:
        for key, v in traces.items():
            if "wall_us" in v:
                say(f"  closed trace {key}: wall {v['wall_us']}us/step, gpu busy {v['gpu_busy_us']}us, idle "
                    f"{v['gpu_idle_us']}us, cpu ops {v['cpu_ops_per_step']} ({v['cpu_op_us']}us)")
        report_traces(traces, modes[0][0], "closed-profile-summary.json")
    shutil.rmtree(trace_dir, ignore_errors=True)


def report_traces(traces, base, out):
    """Trace summaries {"<label>-c<N>": summary}: each against `base`'s at the same level (trace_summary.diff),
    both written to RES/out, and the largest differences said."""
    import trace_summary

    diffs = {}
    for key, v in traces.items():
        label, _, c = key.rpartition("-c")
        ref = traces.get(f"{base}-c{c}") or {}
        if label != base and "wall_us" in v and "wall_us" in ref:
            diffs[key] = trace_summary.diff(ref, v)
    json.dump({"profiles": traces, "diff_vs_" + base: diffs}, open(os.path.join(RES, out), "w"), indent=1)
    for key, d in diffs.items():
        say(f"  {key} - {base}: " + json.dumps({k: d[k] for k in ("wall_us", "gpu_busy_us", "gpu_idle_us",
                                                                  "cpu_op_us", "cpu_ops_per_step")}))
        for table in ("kernels", "runtime", "cpu_ops"):
            say(f"    {table}: " + json.dumps(dict(list(d[table].items())[:8])))


def interleaved(servers, modes):
    """Every mode at every level, the order rotating from level to level, so that the modes compared
    share the same minutes of the machine; one sweep-<label>.json per mode."""
    modes = [x for x in modes if x[1] in servers]
    rows = {label: [] for label, _, _ in modes}
    for i, c in enumerate(int(x) for x in LEVELS.split(",")):
        if left() < 10 * len(modes):
            say(f"interleaved sweeps: stopped before c{c}, budget")
            break
        for label, name, threshold in modes[i % len(modes):] + modes[:i % len(modes)]:
            s = servers[name]
            if threshold is not None:
                client.set_threshold(s.url, threshold)
            rows[label].append(client.sweep_level(s.url, c, PROMPTS, 128, **SWEEP))
        say(f"c{c}: " + ", ".join(f"{label}={rows[label][-1]['tok_s']:.0f}±{rows[label][-1]['spread_pct']:.0f}%"
                                  f"({rows[label][-1]['step_ms']}ms)" for label, _, _ in modes))
    for label, rs in rows.items():
        json.dump(runinfo.stamp(rs, RUN), open(os.path.join(RES, f"sweep-{label}.json"), "w"), indent=1)


def phase_tp(a):
    """Tensor parallel --tp N on N GPUs (1 included): the patched server, with strict memory checks
    and NaN detection, under a 16-stream load (every fifth request asks for logprobs) while the
    threshold flips 0 <-> -1 every FLIP_EVERY s; no hang, transition lines and gauges from TP rank 0
    only."""
    envs, m = setup(a.version, ["patched"])
    prompts_file()
    env = dict(envs["patched"], NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY="1")
    s = Server(f"tp{a.tp}", 30020, env,
               common_args(m, True, ["--tp", str(a.tp), "--speculative-disable-batch-threshold", "2"]
                           + nan_detection(a.version)))
    s.launch()
    if not s.wait_ready(timeout=max(30, left() - 40)):
        return
    for l in graph_lines(s):
        say(f"{s.name}: {l}")
    first_disabled_step(s)
    stop = threading.Event()
    flips = [0, 0]

    def flipper():
        while not stop.wait(float(os.environ.get("FLIP_EVERY", "0.1"))):
            try:
                client.set_threshold(s.url, 0 if flips[0] % 2 == 0 else -1)
            except Exception:  # noqa: BLE001
                flips[1] += 1
            flips[0] += 1

    th = threading.Thread(target=flipper)
    th.start()
    row = client.sweep_level(s.url, 16, PROMPTS, 128, warmup=0.5, window=1.0,
                             windows=max(3, min(int(os.environ.get("SOAK_SECONDS", "20")), int(left() - 25))),
                             logprob_every=5)
    stop.set()
    th.join()
    health = client.generate(s.url, [5, 6, 7, 8], 4)
    trans = s.grep(r"Speculation (disabled|enabled)")
    ranks = sorted(set(re.findall(r"TP(\d+)\]", " ".join(trans))))
    gauges = [l for l in client.get(s.url, "/metrics").splitlines() if l.startswith("sglang:spec_enabled")]
    say(f"{s.name}: {flips[0]} flips ({flips[1]} failed) under c16 load: {row['tok_s']} tok/s, {row['errors']} request "
        f"errors; health generate {health.get('output_ids')}; transition lines {len(trans)} from TP ranks "
        f"{ranks}; spec_enabled series {gauges}; error-looking lines "
        f"{len(s.grep(r'Traceback|NCCL|Watchdog|timeout'))}")
    s.stop()


def phase_store(a):
    """Keep this carry folder's files on this machine for the calls that follow (prepare.sh moves what
    does not fit one call into <carry>a, <carry>b ..., each carried in a call of its own): no server,
    no GPU."""
    os.makedirs(STORED, exist_ok=True)
    for name in sorted(os.listdir(CARRY)):
        if name in ("bin", "SHA256SUMS", "MANIFEST"):
            continue
        src, dst = os.path.join(CARRY, name), os.path.join(STORED, name)
        if name.endswith(".part-a") and os.path.exists(dst[:-len(".part-a")]):
            os.remove(dst[:-len(".part-a")])  # joined from an earlier part-a
        if os.path.isdir(src):
            shutil.rmtree(dst + ".part", ignore_errors=True)
            shutil.copytree(src, dst + ".part")
            shutil.rmtree(dst, ignore_errors=True)
            os.rename(dst + ".part", dst)
            files = [os.path.join(name, f) for f in sorted(os.listdir(dst))]
        else:
            shutil.copyfile(src, dst + ".part")
            os.replace(dst + ".part", dst)
            files = [name]
        for f in files:
            if not f.endswith(".part-a"):
                check_sum(f, os.path.join(STORED, f))
        say(f"stored {name}: {sum(os.path.getsize(os.path.join(STORED, f)) for f in files)} bytes in {STORED}")


def phase_imports(a):
    """A call's setup without a GPU (also on a CPU machine, to find a missing module before a GPU
    call): the trees laid out as for a phase, the import check, and the phases' launch flags parsed by
    the release's own prepare_server_args (no-spec, EAGLE-3, dynctl's adaptive config for N, and the
    patched tree's threshold flag). GPU_MODEL_ARGS="... --device cpu" makes the models on a CPU."""
    kinds = [k for k in ("pristine", "patched") if has(f"sglang-{a.version}-{k}.tar.xz")]
    envs = {k: tree_env(a.version, k) for k in kinds}
    m = models()
    ok = all([import_check(envs[k], a.version) for k in kinds])
    flags = [("pristine", "nospec", common_args(m, False)), ("pristine", "eagle3", common_args(m, True)),
             ("patched", f"threshold {a.threshold}",
              common_args(m, True, ["--speculative-disable-batch-threshold", str(a.threshold)]))]
    if os.path.exists(os.path.join(CARRY, f"adaptive-t{a.threshold}.argv.json")):
        cfg = os.path.join(CARRY, f"adaptive-t{a.threshold}.json")
        argv = json.load(open(os.path.join(CARRY, f"adaptive-t{a.threshold}.argv.json")))
        flags.append(("pristine", f"adaptive t{a.threshold}",
                      common_args(m, True, [x.replace("{config}", cfg) for x in argv])))
    show = ("speculative_algorithm", "speculative_num_steps", "speculative_num_draft_tokens", "attention_backend",
            "speculative_disable_batch_threshold", "speculative_adaptive")
    for kind, label, argv in flags:
        if kind not in envs:
            continue
        env = dict(envs[kind], PHASE_ARGV=json.dumps(["--host", "127.0.0.1", "--port", "30000"] + argv),
                   PHASE_SHOW=",".join(show))
        rc, out = run_py(env, "import json, os; from sglang.srt.server_args import prepare_server_args;"
                              "a = prepare_server_args(json.loads(os.environ['PHASE_ARGV']));"
                              "print(json.dumps({k: getattr(a, k) for k in os.environ['PHASE_SHOW'].split(',')"
                              " if hasattr(a, k)}, default=str))")
        say(f"server args, {kind} tree, {label}: rc={rc}: {out[-1500:]}")
        ok = ok and rc == 0
    say(f"imports {a.version}: {'ok' if ok else 'FAILED'}")
    if not ok:
        raise SystemExit(1)


def out_tag(phase, version):
    """How this phase's files in $OUT are named: phase, release and PHASE_TAG where given."""
    extra = os.environ.get("PHASE_TAG", "")
    if not re.fullmatch(r"[A-Za-z0-9._]*", extra):
        raise SystemExit(f"PHASE_TAG={extra!r}: letters, digits, '.' and '_' only (it names files in $OUT)")
    return f"{phase}-{version}" + (f"-{extra}" if extra else "")


def finish(phase, version):
    out = os.environ.get("OUT")
    if not out:
        return
    tag = out_tag(phase, version)
    sweeps = {os.path.basename(f)[6:-5]: json.load(open(f)) for f in glob.glob(os.path.join(RES, "sweep-*.json"))}
    json.dump(sweeps, open(os.path.join(out, f"sweeps-{tag}.json"), "w"))
    json.dump(RUN, open(os.path.join(RES, "run.json"), "w"))
    json.dump(RUN, open(os.path.join(out, f"run-{tag}.json"), "w"))
    with tarfile.open(os.path.join(out, f"results-{tag}.tar.gz"), "w:gz") as t:
        for p in glob.glob(os.path.join(RES, "*")) + glob.glob(os.path.join(ENV, "dynwork-*", "server.log")):
            t.add(p, arcname=os.path.relpath(p, ENV))


def fresh_results():
    """This call starts from an empty results folder: what a previous call on this (warm) machine left
    there, and the logs of the servers dynctl started, move to $GPU_ENV/previous/before-<run id>, which
    finish() does not bundle."""
    old = ([RES] if os.path.isdir(RES) and os.listdir(RES) else []) + sorted(
        glob.glob(os.path.join(ENV, "dynwork-*", "server.log")))
    if old:
        dest = os.path.join(ENV, "previous", "before-" + RUN["run_id"])
        os.makedirs(dest)
        for p in old:
            name = "results" if p == RES else os.path.basename(os.path.dirname(p)) + "-server.log"
            os.rename(p, os.path.join(dest, name))
        say(f"previous results moved to {dest}: {', '.join(os.path.basename(p) for p in os.listdir(dest))}")
    os.makedirs(RES, exist_ok=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["speed", "check", "repeat", "native", "tp", "profile", "store", "imports"])
    ap.add_argument("--tp", type=int, default=2, help="tp: tensor parallel size (GPUs)")
    ap.add_argument("--version", default="0.5.12.post1")
    ap.add_argument("--threshold", type=int, default=8,
                    help="speed: the threshold dynctl deploys before the sweeps give its own recommendation")
    a = ap.parse_args()
    RUN.update(phase=a.phase, sglang=a.version)
    global SUMMARY_FILE
    if os.environ.get("OUT"):
        SUMMARY_FILE = os.path.join(os.environ["OUT"], f"summary-{out_tag(a.phase, a.version)}.txt")
    say(f"run {RUN['run_id']}: phase {a.phase}, sglang {a.version}")
    fresh_results()
    json.dump(RUN, open(os.path.join(RES, "run.json"), "w"))
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(f"signal {signum}")))
    gpu = (subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total,driver_version",
                           "--format=csv,noheader"], text=True, capture_output=True).stdout.strip()
           if shutil.which("nvidia-smi") else "none (no nvidia-smi)")
    say("gpu: " + gpu)
    used = re.match(r"[^,]*, (\d+) MiB", gpu)
    if used and int(used.group(1)) > 1024 and a.phase != "store":
        # e.g. the server of a deploy an earlier call on this machine interrupted: its memory and its
        # idle scheduler's spinning core slow every server measured here
        say(f"WARNING: {used.group(1)} MiB of GPU memory in use before this phase started: another process "
            f"holds the GPU; timings in this call are not comparable with a clean machine's")
        RUN["gpu_in_use_mib"] = int(used.group(1))
    try:
        {"speed": phase_speed, "check": phase_check, "repeat": phase_repeat, "native": phase_native, "tp": phase_tp,
         "profile": phase_profile, "store": phase_store, "imports": phase_imports}[a.phase](a)
    finally:
        say(f"phase {a.phase} {a.version} done in {time.time() - T0:.0f}s")
        finish(a.phase, a.version)


if __name__ == "__main__":
    main()
