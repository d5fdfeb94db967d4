#!/usr/bin/env bash
# benchmarks/gpu_peers.py on a lent GPU machine, in one call (docs/benchmarks.md, "GPU peers"). Run from the
# checkout's root, with the wheels the machine's image lacks in .whl/ (carried with the call); its arguments go
# to gpu_peers.py. What it does: installs .whl/*.whl and this checkout (zerotrain) into /tmp/site without
# dependencies or an index (the image has torch, transformers, accelerate, tokenizers, safetensors, numpy,
# pyarrow, pandas, tensorboard), says the GPU and the versions, checks that the driver starts, and runs the
# benchmark with its files in $OUT (else runs/gpu_peers).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"; }
pip_install .whl/*.whl
pip_install --no-build-isolation .  # zerotrain from this tree (its setup.cfg maps launcher/ -> zerotrain.launcher)
rm -rf build zerotrain.egg-info
# nothing outside the machine can be reached: the hub libraries are told so rather than left to time out
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi -L
# from /tmp, not the checkout: under python -m its zerotrain/ folder would shadow the installed one (gpu.py driver_command)
(cd /tmp && python3 - <<'PY'
import importlib.metadata as md, sys
import torch
import datasets, deepspeed, pydantic  # noqa: F401  (carried: an import that fails here fails every driver row)
names = ("transformers", "accelerate", "deepspeed", "datasets", "pydantic", "pyarrow", "fsspec", "huggingface_hub")
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      + ", ".join(f"{n} {md.version(n)}" for n in names))
try:
    import liger_kernel.transformers  # noqa: F401
    print(f"liger_kernel {md.version('liger_kernel')}: imports")
except Exception as e:  # Dl's row will say why
    print(f"liger_kernel does not import: {type(e).__name__}: {e}")
PY
python3 -m zerotrain train --help >/dev/null && echo "zerotrain train: starts")
# GPU_TIER="EXPR": the GPU tier's tests matching EXPR first (tests/test_gpu_cuda.py, pytest -k), in the same call,
# e.g. GPU_TIER="never_waits or waiting_for_the_host" (the step without host syncs, the profile's idle and gap lines)
if [ -n "${GPU_TIER:-}" ]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_cuda.py -k "$GPU_TIER" \
        || echo "GPU tier: not passed (above); the benchmark runs all the same"
fi
exec python3 benchmarks/gpu_peers.py --out "${OUT:-runs/gpu_peers}" "$@"
