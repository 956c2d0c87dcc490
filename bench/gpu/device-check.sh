#!/usr/bin/env bash
# The GPU check of the model core, run on a CUDA machine from a prebuilt bundle (.gpu/ here:
# the stripped `cuda_check` example and libcudart.so.13; see model/README.md, "GPU"), and PyTorch's
# training step on the same GPU for the ratio. Writes its log and JSON under ${OUT:-.}.
#   [HINDSIGHT_MODEL=model.gguf] bash bench/gpu/device-check.sh [BUNDLE_DIR]
# With HINDSIGHT_MODEL the check also runs on the real weights: the sanity answer in f32 and
# bf16, and `hindsight serve --device cuda:0` through its OpenAI API.
set -uo pipefail
bundle=${1:-.gpu}
out=${OUT:-.}
mkdir -p "$out"
# CUDA libraries: the bundle's runtime, then the Python wheels' (cuBLAS, cuRAND, NVRTC), then
# the system's driver library.
py=$(command -v python3)
site=$("$py" -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
libs=$bundle/lib
for d in "$site"/nvidia/cu13/lib "$site"/nvidia/*/lib /usr/local/cuda/lib64 /usr/local/nvidia/lib64; do
  [ -d "$d" ] && libs=$libs:$d
done
export LD_LIBRARY_PATH=$libs:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
[ -f "$bundle/cuda_check.gz" ] && gunzip -f "$bundle/cuda_check.gz"
chmod +x "$bundle/cuda_check"
ldd "$bundle/cuda_check" | grep -E "cuda|cublas|curand|nvrtc|not found"
echo "== candle: cuda_check"
"$bundle/cuda_check" "$out/cuda_check.json" 2>&1 | tee "$out/cuda_check.log"
rc=${PIPESTATUS[0]}
echo "== pytorch: the same LoRA training step on the GPU"
for args in "--dtype float32" "--dtype bfloat16" "--dtype bfloat16 --batch 16 --seq 512"; do
  python3 bench/python/torch_train_step.py --device cuda --steps 10 $args 2>&1 | tail -2 | tee -a "$out/torch.log"
done
exit $rc
