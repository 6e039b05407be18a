#!/usr/bin/env bash
# Build llama.cpp's native llama-server, llama-bench and llama-quantize: the anchor that
# tools/bench_cpu_peers.py measures dartcore against.
#
# The source is the llama.cpp that the pinned llama-cpp-python sdist vendors (the version in
# pyproject.toml's `peers` extra), so the C++ and the Python binding rows of a benchmark are the
# same llama.cpp. Instruction sets are named on the cmake line from /proc/cpuinfo rather than left
# to -march=native, so the JSON report can say which kernels ran; AMX is always off (on the Intel
# VMs we measured, llama.cpp's AMX path crashed).
#
# Binaries land in ${DARTCORE_CACHE:-~/.cache/dartcore}/llama.cpp/<version>-<isa-tag>/bin, whose
# path is the last line printed. A finished build is marked by a stamp file (written by rename,
# last) and a rerun returns at once; the directory itself appears by one rename of a complete
# staging tree, so a failed or interrupted build leaves nothing half installed.
#
# Usage: bash tools/build_llama_cpp.sh [--print-dir]
#   --print-dir   print the install directory for this machine and exit (no build)
# Environment: DARTCORE_CACHE (cache root), LLAMA_CPP_JOBS (default: nproc),
#              LLAMA_CPP_PYTHON_VERSION (default: the pyproject pin).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

version="${LLAMA_CPP_PYTHON_VERSION:-}"
if [[ -z "$version" ]]; then
    version="$(grep -o 'llama-cpp-python==[0-9][0-9.]*' "$here/pyproject.toml" | head -1 | cut -d= -f3)"
fi
if [[ -z "$version" ]]; then
    echo "build_llama_cpp: no llama-cpp-python pin in $here/pyproject.toml; set LLAMA_CPP_PYTHON_VERSION" >&2
    exit 2
fi

# --- instruction sets -------------------------------------------------------------------------
# One cmake option per x86 feature the CPU reports; the tag names them in the install path so two
# machines sharing a cache never share a binary built for the other.
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { [[ "$cpu_flags" == *" $1 "* ]]; }
cmake_isa=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
tag=()
add() {  # add <cpuinfo flag> <cmake option> <tag>
    if has "$1"; then cmake_isa+=("-D$2=ON"); tag+=("$3"); else cmake_isa+=("-D$2=OFF"); fi
}
add avx GGML_AVX avx
add avx2 GGML_AVX2 avx2
add bmi2 GGML_BMI2 bmi2
add fma GGML_FMA fma
add f16c GGML_F16C f16c
add avx_vnni GGML_AVX_VNNI avxvnni
add avx512f GGML_AVX512 avx512
add avx512vbmi GGML_AVX512_VBMI vbmi
add avx512_vnni GGML_AVX512_VNNI vnni
add avx512_bf16 GGML_AVX512_BF16 bf16
isa_tag="$(IFS=-; echo "${tag[*]:-generic}")"

root="${DARTCORE_CACHE:-$HOME/.cache/dartcore}/llama.cpp"
dest="$root/$version-$isa_tag"
stamp="$dest/BUILD_INFO.json"

if [[ "${1:-}" == "--print-dir" ]]; then
    echo "$dest/bin"
    exit 0
fi
if [[ -f "$stamp" ]]; then
    echo "build_llama_cpp: already built ($stamp)" >&2
    echo "$dest/bin"
    exit 0
fi

mkdir -p "$root"
# The work directory carries this shell's pid; one left by a build that was killed outright
# (SIGKILL, power loss) is removed by the next run once its pid is gone.
for old in "$root"/.build-*.pid*; do
    [[ -d "$old" ]] || continue
    pid="${old##*.pid}"
    kill -0 "$pid" 2>/dev/null || rm -rf "$old"
done
work="$root/.build-$version-$isa_tag.pid$$"
rm -rf "$work"
mkdir -p "$work"
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

jobs="${LLAMA_CPP_JOBS:-$(nproc)}"

# --- build tools, in a venv of their own --------------------------------------------------------
# pip download of an sdist prepares its metadata, which needs the package's build backend; with
# --no-build-isolation it uses the backend installed here instead of building cmake from source
# in an isolated environment (which takes longer than llama.cpp).
# Pinned, so that a rebuild uses the same cmake; the venv is remade when the pins change.
build_tools=(cmake==4.4.5 scikit-build-core==1.1.2)
tools="$root/.tools-venv"
if [[ "$(cat "$tools/.ready" 2>/dev/null)" != "${build_tools[*]}" ]]; then
    echo "build_llama_cpp: installing ${build_tools[*]} into $tools" >&2
    rm -rf "$tools"
    python3 -m venv "$tools"
    "$tools/bin/python" -m pip install --quiet "${build_tools[@]}"
    echo "${build_tools[*]}" > "$tools/.ready"
fi
cmake_cmd=("$tools/bin/cmake")

echo "build_llama_cpp: fetching the llama-cpp-python $version sdist" >&2
"$tools/bin/python" -m pip download --quiet --no-deps --no-build-isolation --no-binary :all: \
    --dest "$work/sdist" "llama-cpp-python==$version"
tar -xzf "$work"/sdist/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[[ -f "$src/CMakeLists.txt" ]] || { echo "build_llama_cpp: no vendored llama.cpp in the sdist ($src)" >&2; exit 1; }

# No network at build or run time: no HTTPS client (this llama.cpp dropped libcurl; LLAMA_CURL is
# a deprecated no-op), no web UI download. Static libraries, so the three binaries can be copied.
cmake_flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_UI=OFF
    -DGGML_OPENMP=ON
    "${cmake_isa[@]}"
)
echo "build_llama_cpp: cmake ${cmake_flags[*]}" >&2
"${cmake_cmd[@]}" -S "$src" -B "$work/build" "${cmake_flags[@]}" >&2
"${cmake_cmd[@]}" --build "$work/build" --config Release -j "$jobs" \
    --target llama-server llama-bench llama-quantize >&2

stage="$work/stage"
mkdir -p "$stage/bin"
for exe in llama-server llama-bench llama-quantize; do
    cp "$work/build/bin/$exe" "$stage/bin/$exe"
done
system_info="$("$stage/bin/llama-bench" --help >/dev/null 2>&1; "$stage/bin/llama-server" --version 2>&1 | tr -d '\r' | tail -n 2 | tr '\n' ' ' || true)"

# The stamp records what was built and how; bench_cpu_peers.py copies it into its report.
python3 - "$stage/BUILD_INFO.json.tmp" "$version" "$isa_tag" "$system_info" "${cmake_flags[@]}" <<'EOF'
import json, platform, sys
out, version, isa_tag, server_version, *flags = sys.argv[1:]
info = {"llama_cpp_python_sdist": version, "isa_tag": isa_tag, "cmake_flags": flags,
        "server_version": server_version.strip(), "machine": platform.machine()}
with open(out, "w") as f:
    json.dump(info, f, indent=2)
    f.write("\n")
EOF
mv "$stage/BUILD_INFO.json.tmp" "$stage/BUILD_INFO.json"

# A leftover directory without a stamp is a build someone else abandoned mid-rename: replace it.
rm -rf "$dest"
mv "$stage" "$dest"
echo "build_llama_cpp: installed $dest/bin" >&2
echo "$dest/bin"
