"""One-step acceptance of EAGLE heads for the embedded captioner under sampling.

For the first 64 sequences (the held-out ones of ``mmspec train drafter``) of a self-distillation
cache, every answer position is teacher-forced: the head predicts f^_{t+1} from (f_t, x_{t+1}), and
the acceptance of a draft drawn from its q (temperature 1, over its draft vocabulary) is
sum_x min(p(x), q(x)), p = softmax(LMHead(f_{t+1})) the captioner's own distribution; also the
top-1 agreement and the mass of p outside the head's draft vocabulary (which it can never draft).

    .venv/bin/python scripts/eagle_acceptance.py DATA_DIR HEAD_DIR [HEAD_DIR ...]
"""

import sys
from pathlib import Path

import torch

from mmspec.modeling.heads import EagleHead
from mmspec.drafters.vocab import load_draft_vocabulary
from mmspec.train.drafter import collate, eagle_teacher_forced, load_target
from mmspec.train.selfdistill import load_chunks


def main(data: str, heads: list[str]) -> None:
    torch.set_num_threads(2)
    model, _ = load_target("captioner")
    held_out = load_chunks(Path(data))[:64]
    embed = model.get_input_embeddings().weight.detach().float()
    lm_head = model.get_output_embeddings().weight.detach().float()
    for path in heads:
        head = EagleHead.load(path, model).float().eval()
        vocabulary = load_draft_vocabulary(path)
        rows = lm_head if vocabulary is None else lm_head[vocabulary]
        accepted, agree, outside, positions = 0.0, 0.0, 0.0, 0
        with torch.no_grad():
            for start in range(0, len(held_out), 8):
                _, (predicted, teacher, _) = eagle_teacher_forced(head, embed, collate(held_out[start : start + 8]))
                p = torch.softmax(teacher @ lm_head.T, -1)
                q = torch.zeros_like(p)
                q[:, slice(None) if vocabulary is None else vocabulary] = torch.softmax(predicted @ rows.T, -1)
                accepted += torch.minimum(p, q).sum().item()
                agree += (q.argmax(-1) == p.argmax(-1)).sum().item()
                if vocabulary is not None:  # mass the head can never draft (q = 0 there)
                    outside += (1 - p[:, vocabulary].sum(-1)).sum().item()
                positions += len(teacher)
        print(f"{path}: acceptance at temperature 1 {accepted / positions:.3f}, top-1 agreement {agree / positions:.3f}, "
              f"target mass outside the draft vocabulary {outside / positions:.3f} ({positions} positions)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
