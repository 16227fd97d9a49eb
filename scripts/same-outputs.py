"""The three pipelines' outputs on fixed seeds, as a JSON of texts and hashes: run it on two commits and
compare the files to check that a change left behaviour alone (what issue 43's refactor was checked with).

    git stash / checkout A:  python scripts/same-outputs.py a.json
    checkout B:              python scripts/same-outputs.py b.json && cmp a.json b.json

Captions (greedy on two samples, one sampled) under plain decoding and four drafters, embedded text-to-image
under six methods and MAR under two, the embedded voice under six methods; fp32, one thread. Each entry is
[caption text or sha256 of the pixels / samples, target forwards].
"""
import hashlib
import json
import sys

import numpy as np
import torch

import mmspec

torch.set_num_threads(1)
out = {}
def h(a):
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()[:16]

for drafter in [None, "prompt-lookup", "eagle", "eagle2", "medusa"]:
    c = mmspec.pipeline("image-captioning", model=None, drafter=drafter, dtype="float32")
    for img in ["samples/photo.png", "samples/charts.png"]:
        r = c(img, max_new_tokens=48)
        out[f"cap/{drafter}/{img}"] = [r.text, r.stats.target_forwards]
    r = c("samples/scenes.png", max_new_tokens=32, do_sample=True, seed=3)
    out[f"cap/{drafter}/sampled"] = [r.text, r.stats.target_forwards]
print("caption done", flush=True)
for method in ["ar", "sjd", "spec", "lantern", "eagle2", "sjd-coupled"]:
    t = mmspec.pipeline("text-to-image", method=method)
    r = t("a red circle above a blue square", seed=0)
    out[f"t2i/{method}"] = [h(r.images[0]), r.stats.target_forwards]
for method in ["ar", "cspd"]:
    t = mmspec.pipeline("text-to-image", model="mar", method=method)
    r = t("a red circle above a blue square", seed=0)
    out[f"mar/{method}"] = [h(r.images[0]), r.stats.target_forwards]
print("t2i done", flush=True)
for method in ["ar", "sjd", "eagle", "vadusa", "sjd-topk", "spec"]:
    t = mmspec.pipeline("text-to-speech", method=method, dtype="float32")
    r = t("It is half past four and it is raining.", seed=0)
    out[f"tts/{method}"] = [h(r.audio), r.stats.target_forwards]
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"), indent=1)
