#!/usr/bin/env bash
# A CUDA 13.0 build toolkit from PyPI wheels, for building the `cuda` feature on a machine
# without a CUDA installation (and without a GPU): nvcc, the runtime headers and libraries,
# cuBLAS, cuRAND and NVRTC to link against, and a link-time stub of the driver library
# (libcuda.so), generated from the symbols cudarc declares. The binary built against it runs
# wherever a real driver and the CUDA 13 libraries are present (bench/gpu/device-check.sh).
#
#   deploy/cuda-toolkit.sh [PREFIX]          # default /opt/cuda13
#   . <(deploy/cuda-toolkit.sh --env [PREFIX])
#   cargo build --release -p hindsight-bench --features cuda --example cuda_check
#
# CUDA_COMPUTE_CAP selects the GPU generation candle's kernels are built for (90 = Hopper).
set -euo pipefail
if [ "${1:-}" = "--env" ]; then
  p=${2:-/opt/cuda13}
  echo "export PATH=$p/bin:\$PATH CUDA_HOME=$p CUDA_PATH=$p LIBRARY_PATH=$p/lib CUDARC_CUDA_VERSION=13000 CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}"
  exit 0
fi
prefix=${1:-/opt/cuda13}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/whl" \
  "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" \
  "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cublas==13.0.*" \
  "nvidia-cuda-nvrtc==13.0.*" "nvidia-curand>=10.4,<10.5"
for w in "$work"/whl/*.whl; do python3 -m zipfile -e "$w" "$work/x"; done
rm -rf "$prefix"
mkdir -p "$(dirname "$prefix")"
cp -r "$work/x/nvidia/cu13" "$prefix"
chmod +x "$prefix"/bin/* "$prefix"/nvvm/bin/*
cd "$prefix/lib"
for l in cudart cublas cublasLt curand nvrtc; do
  ln -sf "$(ls lib$l.so.* | head -1)" "lib$l.so"
done
ln -sfn lib "$prefix/lib64"
# Link-time stub of the driver API (the real libcuda.so.1 comes with the GPU driver).
ver=$(grep -A1 '^name = "cudarc"' "$root/Cargo.lock" | sed -n 's/^version = "\(.*\)"/\1/p')
(cd "$root" && cargo fetch -q)
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-"$ver" | head -1)
grep -oE "pub unsafe fn cu[A-Za-z0-9_]+" "$src/src/driver/sys/mod.rs" | awk '{print $4}' | sort -u |
  awk '{print "void "$1"(void){}"}' > "$work/stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 "$work/stub.c" -o "$prefix/lib/libcuda.so"
"$prefix/bin/nvcc" --version | tail -1
echo "CUDA build toolkit in $prefix; environment: . <($0 --env $prefix)"
