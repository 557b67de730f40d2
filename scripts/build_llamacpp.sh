#!/usr/bin/env bash
# Build llama-server, llama-bench and llama-batched-bench from the pinned llama-cpp-python sdist
# (which vendors llama.cpp) into a cache folder outside results/.
#
#   scripts/build_llamacpp.sh            # or: make llamacpp
#
# Destination: ${SERVINGPLAN_CACHE:-$HOME/.cache/servingplan}/llamacpp-<version>/
#   bin/llama-server, bin/llama-bench, bin/llama-batched-bench, src/ (unpacked sdist), build/, .built (stamp)
# The stamp is written only after all three binaries exist and run; a second call does nothing.
# On 2 cores the build takes about 30 minutes (see README). Run it at low priority if the machine is
# shared:  nice -n 19 scripts/build_llamacpp.sh > /tmp/llama_build.log 2>&1 &
#
# Environment:
#   LLAMACPP_VERSION   llama-cpp-python sdist version (default 0.3.36; vendors llama.cpp 0c1e570)
#   LLAMACPP_JOBS      parallel compile jobs (default: nproc)
#   LLAMACPP_FAST_TOOLS=1 (default) compiles tools/ and common/ (server HTTP code, multimodal library)
#                      at -O1 and keeps ggml and libllama at -O3: the kernels that set the step times are
#                      unchanged, the build is shorter. 0 builds everything at -O3.
#   PYTHON             python used for pip (default: python3)
set -euo pipefail

VERSION="${LLAMACPP_VERSION:-0.3.36}"
CACHE="${SERVINGPLAN_CACHE:-$HOME/.cache/servingplan}"
DEST="$CACHE/llamacpp-$VERSION"
STAMP="$DEST/.built"
JOBS="${LLAMACPP_JOBS:-$(nproc)}"
FAST_TOOLS="${LLAMACPP_FAST_TOOLS:-1}"
PY="${PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REQS="$HERE/../requirements-llamacpp-build.txt"
TARGETS=(llama-server llama-bench llama-batched-bench)

if [[ -f "$STAMP" ]]; then
    echo "llama.cpp $VERSION already built in $DEST"
    exit 0
fi

mkdir -p "$DEST"
# One build at a time per cache folder.
exec 9>"$DEST/.lock"
if ! flock -n 9; then
    echo "another build of llama.cpp $VERSION is running (lock $DEST/.lock); waiting" >&2
    flock 9
fi
if [[ -f "$STAMP" ]]; then
    echo "llama.cpp $VERSION already built in $DEST"
    exit 0
fi
start=$(date +%s)

# 1. The sdist (a tarball already in dl/ is reused).
mkdir -p "$DEST/dl"
SDIST=$(ls "$DEST"/dl/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
if [[ -z "$SDIST" ]]; then
    echo "== downloading llama-cpp-python==$VERSION sdist"
    "$PY" -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: \
        -d "$DEST/dl"
    SDIST="$DEST/dl/llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$DEST/src/llama_cpp_python-$VERSION"
if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    echo "== unpacking $SDIST"
    rm -rf "$DEST/src"; mkdir -p "$DEST/src"
    tar -xzf "$SDIST" -C "$DEST/src"
fi
LLAMA="$SRC/vendor/llama.cpp"

# 2. cmake and ninja: the machine's own when present and new enough, else the pinned ones from PyPI.
need_tools=0
if ! command -v ninja >/dev/null 2>&1; then need_tools=1; fi
if command -v cmake >/dev/null 2>&1; then
    cmv=$(cmake --version | awk 'NR==1{print $3}')
    if [[ "$(printf '%s\n3.18\n' "$cmv" | sort -V | head -1)" != "3.18" ]]; then need_tools=1; fi
else
    need_tools=1
fi
if [[ $need_tools == 1 ]]; then
    echo "== installing pinned cmake/ninja from $REQS"
    "$PY" -m venv "$DEST/tools"
    "$DEST/tools/bin/pip" install --quiet -r "$REQS"
    export PATH="$DEST/tools/bin:$PATH"
fi
echo "== cmake $(cmake --version | head -1), ninja $(ninja --version)"

# 3. Configure and build (flags from the feasibility run, issue 22).
launcher=()
if [[ "$FAST_TOOLS" == 1 ]]; then
    # A compiler launcher that lowers -O3 to -O1 for sources under tools/ and common/ only.
    cat > "$DEST/cc-launcher.sh" <<LAUNCH
#!/usr/bin/env bash
args=("\$@")
case " \$* " in
  *" $LLAMA/tools/"*|*" $LLAMA/common/"*)
    for i in "\${!args[@]}"; do [[ "\${args[\$i]}" == -O3 ]] && args[\$i]=-O1; done ;;
esac
exec "\${args[@]}"
LAUNCH
    chmod +x "$DEST/cc-launcher.sh"
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER="$DEST/cc-launcher.sh" -DCMAKE_CXX_COMPILER_LAUNCHER="$DEST/cc-launcher.sh")
fi
echo "== configuring"
cmake -S "$LLAMA" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${launcher[@]}"
echo "== building ${TARGETS[*]} with $JOBS jobs"
cmake --build "$DEST/build" --target "${TARGETS[@]}" -j "$JOBS"

# 4. Install the binaries (and the shared libraries they link) into bin/, check they run, stamp.
mkdir -p "$DEST/bin"
for t in "${TARGETS[@]}"; do cp -f "$DEST/build/bin/$t" "$DEST/bin/"; done
find "$DEST/build/bin" -maxdepth 1 -name '*.so*' -exec cp -fP {} "$DEST/bin/" \;
for t in "${TARGETS[@]}"; do
    LD_LIBRARY_PATH="$DEST/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$DEST/bin/$t" --help >/dev/null 2>&1 \
        || { echo "$t does not run" >&2; exit 1; }
done
end=$(date +%s)
printf 'version=%s\nllama_cpp_commit=%s\nbuilt_utc=%s\nseconds=%s\njobs=%s\nfast_tools=%s\n' \
    "$VERSION" "$(cat "$LLAMA/.git-commit" 2>/dev/null || echo 0c1e570)" "$(date -u +%FT%TZ)" \
    "$((end - start))" "$JOBS" "$FAST_TOOLS" > "$STAMP"
echo "== built llama.cpp $VERSION in $((end - start)) s: $DEST/bin"
