#!/usr/bin/env bash
# Build the carry folder for the GPU machine (run on a CPU machine that reaches the package index).
#
#   benchmarks/gpu/prepare.sh [VERSION ...]    default: 0.5.12.post1 (run from the repository root)
#
# One carry folder per sglang line: 0.5.12.post1 (patch) and 0.5.14 (patch and native) each fill about
# 44-46 MB, so the two together exceed the 64 MiB a call can carry (DEST=.gpu14 for the second).
#
# Environment:
#   DEST        carry folder to fill, relative to the current directory (default .gpu); add it to
#               .git/info/exclude and name it in `run`'s carry list
#   PY312       a Python 3.12 interpreter (the device runs cp312; default: python3.12 on PATH)
#   DYNCTL_SRC  dynctl checkout used to patch (default: . if it holds dynctl/, else ../main)
#   THRESHOLD   batch-size threshold of the adaptive config for sglang >= 0.5.14 (default 2)
#   BUILD       scratch folder (default: a new temp dir)
#   CARRY_MIB   what one device call carries, the checkout's own files included (default 64)
#
# Output in DEST (every file xz-compressed):
#   site.tar.xz                        common pure/compiled deps (deps-0.5.12.txt), cp312
#   site-<V>.tar.xz                    where deps-<V>.txt (else its base release's, 0.5.15.post1 -> 0.5.15)
#                                      exists: the packages sglang <V> pins differently, put ahead of site/
#                                      on the device (static archives *.a left out)
#   extra-<D>.tar.xz, sglang-<V>.extra where deps-<D>-large.txt exists (D = V or its base release): large
#                                      packages <V> imports (0.5.15: nvidia-cutlass-dsl), after the overlay
#   kernels-<sgl-kernel>-flashinfer<flashinfer>.tar.xz
#                                      sgl_kernel trimmed to sm90/common_ops + python, and
#                                      flashinfer-python whole (its data/ holds the JIT sources: sgl_kernel's
#                                      rmsnorm calls flashinfer.norm, compiled by nvcc on first use);
#                                      per sglang version
#   sglang-<V>-pristine.tar.xz         sglang package as released
#   sglang-<V>-patched.tar.xz          the same after `dynctl patch apply` (releases with a patch
#                                      variant in patches/variants.toml: 0.5.6-0.5.12 and 0.5.14-0.5.23,
#                                      those not yet measured on a GPU included: the build host asks for
#                                      strategy = "patch", and MANIFEST carries dynctl's "not measured" line)
#   adaptive-t<N>.json, .argv.json     sglang >= 0.5.14: the adaptive config and launch flags that
#                                      dynctl generates for threshold N (native_config.py)
#   wheels/                            dynctl's own wheel (built from this checkout) and the dependencies
#                                      the GPU machine's image lacks, for `dynctl` on that machine
#   bin/                               the device-side scripts (copied from benchmarks/gpu/device)
#   SHA256SUMS                         every file's sha256, checked by phase.py where it did not travel here
#   <DEST>a/                           only if DEST with the checkout's own files is over the CARRY_MIB (64)
#                                      MiB one call carries: what does not fit (split_carry.sh), for a
#                                      `phase.py store` call to the warm machine just before the phase's
#   MANIFEST                           versions, sha256 of the patched files, the patch diff
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="${DEST:-.gpu}"
PY312="${PY312:-python3.12}"
if [ -z "${DYNCTL_SRC:-}" ]; then
  if [ -d dynctl ]; then DYNCTL_SRC=.; else DYNCTL_SRC=../main; fi
fi
BUILD="${BUILD:-$(mktemp -d)}"
VERSIONS=("$@"); [ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.5.12.post1)
PIPDL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
       --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
       --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64
       --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
       --platform manylinux1_x86_64)
XZ="xz -T2 -6"
"$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || { echo "PY312 must be a Python 3.12 interpreter"; exit 2; }
mkdir -p "$DEST/bin" "$BUILD"
DEST="$(cd "$DEST" && pwd)"
bash "$HERE/split_carry.sh" --join "$DEST"  # a previous run's store folders back: only missing files are rebuilt
echo "build in $BUILD, carry folder $DEST"
: > "$DEST/MANIFEST"

# -- dynctl, to apply the patch exactly as a user would
if [ ! -x "$BUILD/dynv/bin/dynctl" ]; then
  python3 -m venv "$BUILD/dynv"
  "$BUILD/dynv/bin/pip" install -q -e "$DYNCTL_SRC"
fi

# -- dynctl's wheel and what the GPU machine lacks of its dependencies (the image has rich, typer, httpx,
#    psutil, pillow, prometheus-client and their own dependencies)
rm -rf "$DEST/wheels" "$BUILD/dynwhl"; mkdir -p "$DEST/wheels" "$BUILD/dynwhl"
"$BUILD/dynv/bin/pip" wheel -q --no-deps -w "$DEST/wheels" "$DYNCTL_SRC"
"${PIPDL[@]}" -d "$BUILD/dynwhl" paramiko cryptography bcrypt pynacl cffi pycparser invoke textual \
  linkify-it-py mdit-py-plugins uc-micro-py platformdirs "plotext>=5.2.8,<6" "rich>=13" markdown-it-py mdurl \
  tomlkit pyyaml
cp "$BUILD"/dynwhl/*.whl "$DEST/wheels/"
echo "wheels: $(ls "$DEST/wheels" | tr '\n' ' ')" >> "$DEST/MANIFEST"

# -- common deps
if [ ! -f "$DEST/site.tar.xz" ]; then
  mkdir -p "$BUILD/whl" "$BUILD/site"
  "${PIPDL[@]}" -d "$BUILD/whl" -r "$HERE/deps-0.5.12.txt"
  "$PY312" -m pip install -q --no-deps --no-compile --no-index --target "$BUILD/site" "$BUILD"/whl/*.whl
  rm -rf "$BUILD/site/bin"
  tar -C "$BUILD/site" -cf - . | $XZ > "$DEST/site.tar.xz"
fi
echo "site: $(ls "$BUILD"/whl 2>/dev/null | wc -l) wheels" >> "$DEST/MANIFEST"

deps_file() {  # VERSION SUFFIX -> benchmarks/gpu/deps-<VERSION><SUFFIX>.txt, else its base release's, else ""
  local D
  for D in "$1" "${1%%.post*}"; do
    if [ -f "$HERE/deps-$D$2.txt" ]; then echo "$HERE/deps-$D$2.txt"; return; fi
  done
}

kernel_pins() {  # sglang wheel -> "sglang-kernel==X flashinfer_python==Y" (extras such as [cu13] dropped)
  unzip -p "$1" '*.dist-info/METADATA' \
    | sed -n 's/^Requires-Dist: \(sglang-kernel\|flashinfer_python\)\(\[[^]]*\]\)\{0,1\}\(==[^ ;]*\).*/\1\3/p' | tr '\n' ' '
}

for V in "${VERSIONS[@]}"; do
  W="$BUILD/sglang-$V"; mkdir -p "$W"
  ls "$W"/sglang-*.whl >/dev/null 2>&1 || "${PIPDL[@]}" -d "$W" "sglang==$V"
  WHL=$(ls "$W"/sglang-*.whl | head -1)
  PINS=$(kernel_pins "$WHL")
  # the kernels tarball is named by both pins: 0.5.16 and 0.5.17 share sglang-kernel 0.4.5, not flashinfer
  KV=$(echo "$PINS" | sed -n 's/.*sglang-kernel==\([^ ]*\).*/\1/p')-flashinfer$(echo "$PINS" \
    | sed -n 's/.*flashinfer_python==\([^ ]*\).*/\1/p')
  echo "sglang $V: $PINS" | tee -a "$DEST/MANIFEST"
  # overlay: the packages this version pins differently from the common set (deps-<V>.txt, else the
  # base release's: 0.5.15.post1 -> deps-0.5.15.txt; deps-0.5.12.txt is the common set itself)
  DEPS=$(deps_file "$V" ""); [ "$DEPS" != "$HERE/deps-0.5.12.txt" ] || DEPS=""
  if [ -n "$DEPS" ] && [ ! -f "$DEST/site-$V.tar.xz" ]; then
    O="$BUILD/overlay-$V"; rm -rf "$O/site"; mkdir -p "$O/whl" "$O/site"
    "${PIPDL[@]}" -d "$O/whl" -r "$DEPS"
    "$PY312" -m pip install -q --no-deps --no-compile --no-index --target "$O/site" "$O"/whl/*.whl
    # static archives are for C++ linking, never loaded by Python (xgrammar's libxgrammar.a: 65 MB)
    rm -rf "$O/site/bin"; find "$O/site" -name '*.a' -print -delete | sed 's/^/  left out: /'
    tar -C "$O/site" -cf - . | $XZ > "$DEST/site-$V.tar.xz.part"
    mv "$DEST/site-$V.tar.xz.part" "$DEST/site-$V.tar.xz"
  fi
  if [ -f "$DEST/site-$V.tar.xz" ]; then
    echo "overlay site-$V.tar.xz: $(grep -v '^#' "$DEPS" | tr '\n' ' ')" >> "$DEST/MANIFEST"
  fi
  # large packages (deps-<V>-large.txt): unpacked in the order listed, as pip lays them out (a later
  # wheel's files replace an earlier one's), into extra-<D>.tar.xz; phase.py puts it after the overlay
  LARGE=$(deps_file "$V" -large)
  if [ -n "$LARGE" ]; then
    XN="extra-$(basename "$LARGE" -large.txt | sed 's/^deps-//')"
    if [ ! -f "$DEST/$XN.tar.xz" ]; then
      X="$BUILD/$XN"; rm -rf "$X"; mkdir -p "$X/site"; i=0
      for P in $(grep -v '^#' "$LARGE"); do
        i=$((i + 1)); mkdir -p "$X/whl/$i"; "${PIPDL[@]}" -d "$X/whl/$i" "$P"
        (cd "$X/site" && unzip -q -o "$X"/whl/$i/*.whl)
      done
      # the same bytes from every build of the same wheels, whatever the unpacking left in mtimes and owners
      tar -C "$X/site" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . | $XZ \
        > "$DEST/$XN.tar.xz.part"
      mv "$DEST/$XN.tar.xz.part" "$DEST/$XN.tar.xz"
    fi
    echo "$XN" > "$DEST/sglang-$V.extra"
    echo "extra $XN.tar.xz: $(grep -v '^#' "$LARGE" | tr '\n' ' ')" >> "$DEST/MANIFEST"
  fi
  # kernels: sgl_kernel without FA3/FlashMLA/sm100/mscclpp; flashinfer-python as released
  if [ ! -f "$DEST/kernels-$KV.tar.xz" ]; then
    K="$BUILD/kernels-$KV"; mkdir -p "$K/whl" "$K/site"
    for P in $PINS; do "${PIPDL[@]}" -d "$K/whl" "$P"; done
    (cd "$K/site" && unzip -q -o "$K"/whl/sglang_kernel-*.whl -x 'sgl_kernel/flash_ops*' \
       'sgl_kernel/flashmla_ops*' 'sgl_kernel/sm100/*' 'lib/*' 'lib64/*' 'include/*' '_mscclpp*' \
     && unzip -q -o "$K"/whl/flashinfer_python-*.whl)
    tar -C "$K/site" -cf - . | $XZ > "$DEST/kernels-$KV.tar.xz.part"
    mv "$DEST/kernels-$KV.tar.xz.part" "$DEST/kernels-$KV.tar.xz"
  fi
  # sglang trees: pristine, then patched by dynctl
  VENV="$BUILD/venv-$V"   # always fresh: the pristine tarball must come from an unpatched tree
  rm -rf "$VENV" "$BUILD/dynwork-$V"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-deps --no-index "$WHL"
  SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  tar -C "$SP" -cf - --exclude=__pycache__ sglang "sglang-$V.dist-info" | $XZ > "$DEST/sglang-$V-pristine.tar.xz"
  echo "$KV" > "$DEST/sglang-$V.kernels"
  # the strategies dynctl can use for this release (its own rules: dynctl.patching.strategy_for)
  CAN=$("$BUILD/dynv/bin/python" -c 'import sys
from dynctl.base.errors import DynctlError
from dynctl.patching import strategy_for
for strategy in ("native", "patch"):
    try:
        print(strategy_for(sys.argv[1], strategy))
    except DynctlError:
        pass' "$V" | tr '\n' ' ')
  if [[ " $CAN " == *" native "* ]]; then
    # native: dynctl's adaptive config for THRESHOLD, checked with this release's code
    if ! "$BUILD/dynv/bin/python" "$HERE/native_config.py" --threshold "${THRESHOLD:-2}" --sglang-tree "$SP" \
        --out "$DEST" 2>&1 | tee -a "$DEST/MANIFEST"; then
      echo "native_config.py failed for sglang $V"; exit 1
    fi
  fi
  # patch: where dynctl has a variant for this release
  [[ " $CAN " == *" patch "* ]] || continue
  cat > "$BUILD/dynctl-$V.toml" <<TOML
default_host = "build"
[hosts.build]
python = "$VENV/bin/python"
workdir = "$BUILD/dynwork-$V"
strategy = "patch"
TOML
  export DYNCTL_CONFIG="$BUILD/dynctl-$V.toml"
  set +e
  "$BUILD/dynv/bin/dynctl" patch diff --host build > "$BUILD/patch-$V.diff" 2>&1
  "$BUILD/dynv/bin/dynctl" patch apply --host build --yes 2>&1 | tee "$BUILD/apply-$V.log"
  RC=${PIPESTATUS[0]}
  set -e
  if [ "$RC" = 0 ]; then
    tar -C "$SP" -cf - --exclude=__pycache__ sglang "sglang-$V.dist-info" | $XZ > "$DEST/sglang-$V-patched.tar.xz"
    { echo "--- dynctl patch apply ($V)"; cat "$BUILD/apply-$V.log";
      "$BUILD/dynv/bin/dynctl" patch status --host build; echo "--- diff ($V)"; cat "$BUILD/patch-$V.diff"; } >> "$DEST/MANIFEST"
  else
    echo "dynctl patch apply refused sglang $V (rc $RC): no patched tree" | tee -a "$DEST/MANIFEST"
  fi
  unset DYNCTL_CONFIG
done

cp "$HERE"/device/*.py "$DEST/bin/"

# -- what does not fit one call (with the checkout's own files) moves to "${DEST}a", for a store call
bash "$HERE/split_carry.sh" "$DEST" | tee -a "$DEST/MANIFEST"
du -sh "$DEST" $(for x in a b c; do [ -d "$DEST$x" ] && echo "$DEST$x"; done); ls -la "$DEST"  # store folders where the split made them
