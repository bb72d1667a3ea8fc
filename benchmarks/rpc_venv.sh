#!/usr/bin/env bash
# Build the llama.cpp-RPC comparison venv for benchmarks/bench_split.py.
#
# Creates a venv separate from the dev one (default: .bench-venv-rpc/ in the
# repo root) and compiles llama-cpp-python 0.3.36 from source with
# -DGGML_RPC=ON, which adds libggml-rpc.so (ggml_backend_rpc_start_server,
# ggml_backend_rpc_add_server) next to libllama.so. Everything else is
# llama-cpp-python's default build, as in the dev venv, so both sides run the
# same CPU kernels. Takes 5-8 minutes on 2 idle cores (30 on a busy machine).
#
#   benchmarks/rpc_venv.sh [--force] [VENV_DIR]
#
# Does nothing when VENV_DIR already has an RPC build of 0.3.36, unless --force.
# The full build output goes to VENV_DIR/build.log.
#
# Environment:
#   PYTHON                      interpreter for the venv (default: python3)
#   LLAMA_CPP_PYTHON_SRC        a local llama-cpp-python sdist or source tree to
#                               build instead of downloading llama-cpp-python==0.3.36
#   CMAKE_BUILD_PARALLEL_LEVEL  compile jobs (default: nproc)
set -euo pipefail

version="0.3.36"
force=0
if [[ "${1:-}" == "--force" ]]; then
    force=1
    shift
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.bench-venv-rpc}"
python="${PYTHON:-python3}"
source_spec="${LLAMA_CPP_PYTHON_SRC:-llama-cpp-python==$version}"

# Prints the lib dir when the venv has llama-cpp-python $version with libggml-rpc.so.
rpc_lib_dir() {
    [[ -x "$venv/bin/python" ]] || return 1
    "$venv/bin/python" - "$version" <<'PY' 2>/dev/null
import pathlib, sys
import llama_cpp
lib = pathlib.Path(llama_cpp.__file__).parent / "lib"
if llama_cpp.__version__ != sys.argv[1] or not (lib / "libggml-rpc.so").exists():
    sys.exit(1)
print(lib)
PY
}

if [[ $force -eq 0 ]] && lib_dir="$(rpc_lib_dir)"; then
    echo "RPC venv already built: $venv ($lib_dir/libggml-rpc.so); --force rebuilds it"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip

# --no-cache-dir: pip would otherwise reuse a llama-cpp-python wheel it built
# earlier *without* RPC (same name and version, so the same cache entry).
# --no-binary/--force-reinstall: always compile, even over an existing install.
export CMAKE_ARGS="-DGGML_RPC=ON ${CMAKE_ARGS:-}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
log="$venv/build.log"
echo "building $source_spec with CMAKE_ARGS='$CMAKE_ARGS' (log: $log) ..."
if ! "$venv/bin/python" -m pip install --no-cache-dir --force-reinstall --no-binary llama-cpp-python \
        --verbose "$source_spec" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "rpc_venv.sh: pip install failed; full log in $log" >&2
    exit 1
fi
grep -E -e "-- Including (CPU|RPC) backend" -e "^Successfully installed" "$log" || true

if ! lib_dir="$(rpc_lib_dir)"; then
    echo "rpc_venv.sh: no libggml-rpc.so in $venv: llama-cpp-python was not built with GGML_RPC" >&2
    exit 1
fi
echo "RPC venv ready: $venv ($lib_dir/libggml-rpc.so)"
