"""``mmspec train eval-captioner``: validation metrics of the embedded captioner, per family.

Short answers: exact match after normalisation (case, punctuation, articles). Captions and detailed
descriptions: BLEU-4 and CIDEr-D (pycocoevalcap's scorers on lower-cased word tokens; its Java
PTB tokenizer is not used). Plus ordinary text questions without an image, to show the real
decoder's knowledge is kept. Greedy decoding through ``mmspec.generate``.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import torch

from ..api import generate
from ..modeling.captioner import WEIGHTS_FILE, build_captioner, default_captioner_dir
from .data import FAMILIES, make_sample

TEXT_QUESTIONS = [
    ("What is the capital of France?", "paris"),
    ("How many days are there in a week?", "seven|7"),
    ("What color is the sky on a clear day?", "blue"),
    ("Who wrote Romeo and Juliet?", "shakespeare"),
    ("What is 2 + 3?", "5|five"),
]


def normalise(text: str) -> str:
    text = text.lower().strip()
    text = re.sub(r"[^\w\s:.]", " ", text)
    text = re.sub(r"(?<!\d)\.|\.(?!\d)", " ", text)  # drop full stops, keep decimal points
    words = [w for w in text.split() if w not in ("a", "an", "the")]
    return " ".join(words)


def caption_scores(references: dict[int, list[str]], candidates: dict[int, list[str]]) -> dict[str, float]:
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    refs = {k: [" ".join(re.findall(r"\w+", r.lower())) for r in v] for k, v in references.items()}
    cands = {k: [" ".join(re.findall(r"\w+", c.lower())) or "empty" for c in v] for k, v in candidates.items()}
    bleu, _ = Bleu(4).compute_score(refs, cands, verbose=0)
    cider, _ = Cider().compute_score(refs, cands)
    return {"bleu4": bleu[3], "cider": cider}


def caption(model, processor, image, prompt: str, max_new_tokens: int = 48, temperature: float = 0.0, seed: int = 0) -> str:
    """The captioner's answer: greedy, or sampled at ``temperature`` > 0 with ``seed``."""
    content = [{"type": "text", "text": prompt}] if image is None else [{"type": "image"}, {"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=[text], images=None if image is None else [[image]], return_tensors="pt")
    sampling = {"do_sample": True, "temperature": temperature, "seed": seed} if temperature > 0 else {}
    out = generate(model, max_new_tokens=max_new_tokens, **sampling, **inputs)
    return processor.tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def evaluate(model, processor, split: str = "validation", per_family: int = 30) -> dict:
    report = {"split": split, "per_family": per_family, "families": {}}
    for family in FAMILIES:
        exact, refs, cands, examples = [], {}, {}, []
        for index in range(per_family):
            sample = make_sample(family, split, index)
            answer = caption(model, processor, sample.image, sample.prompt)
            if sample.kind == "short":
                exact.append(normalise(answer) == normalise(sample.answer))
            else:
                refs[index], cands[index] = [sample.answer], [answer]
            if len(examples) < 3:
                examples.append({"prompt": sample.prompt, "reference": sample.answer, "output": answer})
        scores = caption_scores(refs, cands) if refs else {}
        report["families"][family] = {
            "short_answers": len(exact),
            "exact_match": statistics.mean(exact) if exact else None,
            "captions": len(refs),
            **scores,
            "examples": examples,
        }
        print(family, {k: v for k, v in report["families"][family].items() if k != "examples"}, flush=True)
    text_answers = []
    for question, expected in TEXT_QUESTIONS:
        answer = caption(model, processor, None, question)
        text_answers.append({"question": question, "answer": answer, "correct": bool(re.search(expected, answer.lower()))})
    report["text_questions"] = text_answers
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--weights", default=str(default_captioner_dir() / WEIGHTS_FILE))
    parser.add_argument("--split", default="validation", choices=["validation", "test"])
    parser.add_argument("--per-family", type=int, default=30)
    parser.add_argument("--out", default=None, help="the report (default: eval.json beside --weights; the shipped "
                        "captioner's models/smolcap/eval.json only for its own weights)")
    parser.add_argument("--threads", type=int, default=2)


def run(args) -> int:
    from ..cli.output import write_text
    from ..hub import require_modules

    require_modules(("pycocoevalcap",), "the captioner's BLEU-4 and CIDEr-D", "pip install --no-deps pycocoevalcap "
                    "(bash scripts/install.sh does)")
    if not Path(args.weights).exists():
        raise FileNotFoundError(f"no captioner weights at {args.weights}; train them with `mmspec train captioner`")
    model, processor = build_captioner(dtype=torch.bfloat16, weights=args.weights)
    started = time.time()
    report = evaluate(model, processor, args.split, args.per_family)
    report["minutes"] = round((time.time() - started) / 60, 1)
    report["command"] = f"mmspec train eval-captioner --split {args.split} --per-family {args.per_family}"
    # (through the commands' one writer: the folders of --out made, as every command's, not a
    # FileNotFoundError after the whole evaluation)
    write_text(args.out or Path(args.weights).with_name("eval.json"), json.dumps(report, indent=1))
    print(json.dumps({f: {k: v for k, v in r.items() if k != "examples"} for f, r in report["families"].items()}, indent=1))
    print(json.dumps(report["text_questions"], indent=1))
    return 0
