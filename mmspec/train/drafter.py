"""``mmspec train drafter --method eagle|eagle3|medusa|hydra|kangaroo --target smollm2|captioner|PATH_OR_HUB_ID``:
train a drafter on the target's own outputs and hidden states (self-distillation), resumable.

Any target other than the two embedded recipes (a checkpoint directory or hub id of a causal LM or
a supported VLM) takes ``--data DATA`` (a JSONL of {image?, prompt, response?}, an image folder, a
saved ``datasets`` dataset or parquet files) and ``--out DIR``: :func:`run_any_target`, with the data made by
:mod:`mmspec.train.any_target`, data-parallel under ``accelerate launch``, a held-out tau at the
end; EAGLE-3 there stores the three target layers it fuses with the data and trains with
:func:`mmspec.train.eagle3.eagle3_loss` (the training-time test) in the same loop. The rest of this
docstring describes the embedded recipes; the losses are shared.

1. Data (cached in ``--data``, chunk by chunk, so an interrupted run resumes): for ``smollm2``,
   SmolLM2's own greedy answers to ``--sequences`` written instructions; for ``captioner``, its own
   answers to the caption train split's images and prompts, greedy or (``--sample-temperature T``)
   sampled at temperature T, which is what a drafter used under sampling has to predict. Either
   way the target's last hidden states are stored (bf16), see :mod:`mmspec.train.selfdistill`.
2. Training: the EAGLE head (:class:`mmspec.modeling.heads.EagleHead`) reads pairs
   (f_t, x_{t+1}) and predicts f_{t+1}; loss = SmoothL1(f^_{t+1}, f_{t+1}) + 0.1 CE(LMHead(f^_{t+1}),
   x_{t+2}) on the answer positions, AdamW on fp32 weights (bf16 autocast where bf16 is fast). ``--init`` starts
   from another head (e.g. the SmolLM2 head for the captioner, whose decoder is SmolLM2).
   ``--kl-weight w`` adds w KL(p || q) on the draft vocabulary: p = softmax(LMHead(f_{t+1})), the
   target's own next-token distribution (from the stored feature), q the head's. Under sampling a
   draft is accepted with sum min(p, q) = 1 - TV(p, q), so matching the whole distribution, not
   only its argmax, is what raises acceptance at temperature 1.
   Medusa / Hydra heads (:mod:`mmspec.drafters.medusa`): head i reads f_t (Hydra: and the
   embeddings of x_{t+1} .. x_{t+1+i}, teacher-forced) and is trained with CE against x_{t+2+i},
   weighted 0.8^i, on the same cached features.
   ``--vision-tokens K`` (EAGLE or EAGLE-3, a VLM target) trains the vision-aware head
   (:class:`mmspec.modeling.heads.VisionEagleHead` / :class:`mmspec.modeling.eagle3.VisionEagle3Head`,
   ViSpec's recipe): the target's features at the image tokens of each sequence (already in the
   cache: the prompt's features are stored; EAGLE-3's fused by its fc) are compressed into K prefix
   positions of the head's layer and a global feature added to its input; ``--init`` may name a
   plain head (its weights are kept, the adaptor starts new, its global projection at zero).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch

from ..cli.args import add_trust_remote_code_arg
from ..modeling.heads import DraftHeads, EagleHead, KangarooAdapter, VisionContext, VisionEagleHead
from ..drafters.vocab import DRAFT_VOCAB_FILE, coverage, frequent_tokens, load_draft_vocabulary, save_draft_vocabulary
from ..hub import resolve_dtype
from ..hub import models_dir
from .eagle3 import eagle3_loss, target_states
from .checkpoint import STATE_FILE, TrainingRun, add_device_argument, autocast, check_fresh_out, to_device, train_device, warmup_cosine
from ..core import words

TARGETS = ("smollm2", "captioner")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", "--kind", default="eagle", choices=["eagle", "eagle2", "eagle3", "medusa", "hydra", "kangaroo"],
                        type=lambda name: "eagle" if name == "eagle2" else name,
                        metavar="{eagle,eagle2,eagle3,medusa,hydra,kangaroo}",
                        help="drafter to train (eagle2 is eagle: EAGLE-2 drafts its trees with the EAGLE head; "
                             "eagle3: mmspec.train.eagle3)")
    parser.add_argument("--ttt-steps", type=int, default=3, help="EAGLE-3: unrolled steps of the training-time test")
    parser.add_argument("--num-heads", type=int, default=4, help="Medusa / Hydra heads")
    parser.add_argument("--target", default="smollm2",
                        help="smollm2 | captioner (the embedded recipes; captioner with --method eagle3, or with --data a "
                             "JSONL / image folder / dataset, runs the any-target loop on the embedded captioner), or any "
                             "supported target: a checkpoint directory or hub id (then --data DATA and --out are required)")
    add_trust_remote_code_arg(parser, "a target's (given by its path or hub id)")
    parser.add_argument("--out", default=None, help="output dir (required for a target given by its path or hub id; "
                        "smollm2 / captioner: default models/<smollm2|smolcap>-<method>)")
    parser.add_argument("--data", default=None,
                        help="any target: a JSONL of {image?, prompt, response?}, an image folder, a saved datasets "
                             "dataset, or parquet files (a file, folder or quoted glob; columns prompt, image?, response?); "
                             "smollm2 / captioner: the self-distillation cache (default runs/<target>-selfdistill)")
    parser.add_argument("--cache", default=None, help="any target: the self-distillation shards (default OUT/data)")
    parser.add_argument("--prompt", default=None, help="any target: the prompt of an image folder's images (default: 'Describe the image.')")
    parser.add_argument("--held-out", type=float, default=None,
                        help="any target: share of DATA held out for the loss and tau evaluation (default 0.1)")
    parser.add_argument("--hold-out-groups", default=None,
                        help="any target: comma list of the data's `group` labels (e.g. image families) held out of training "
                             "instead of a random --held-out share: the loss and tau evaluation run on groups the head never saw")
    parser.add_argument("--eval-examples", type=int, default=16, help="any target: held-out prompts decoded with the trained drafter at the end (0: none)")
    parser.add_argument("--gen-batch", type=int, default=8, help="any target: rows generated together for self-distillation")
    parser.add_argument("--shard-size", type=int, default=64, help="any target: examples per data shard")
    parser.add_argument("--dtype", default="auto", help="any target: auto | float32 | bfloat16 (float32 for exact greedy checks)")
    parser.add_argument("--seed", type=int, default=0, help="head initialisation, batches and sampled answers")
    parser.add_argument("--resume", action="store_true", help="any target: continue from OUT's checkpoint")
    parser.add_argument("--log-every", type=int, default=10, help="any target: steps between loss-log entries (OUT/loss.csv)")
    parser.add_argument("--save-every", type=int, default=100, help="any target: steps between checkpoints")
    parser.add_argument("--extra-data", action="append", default=[], help="smollm2 / captioner: further self-distillation caches to train on (repeatable)")
    parser.add_argument("--prompt-set", default="templates", choices=["templates", "tasks"], help="smollm2: the instructions of its text data")
    parser.add_argument("--sequences", type=int, default=1600, help="smollm2 / captioner: training sequences to generate / extract "
                        "(any other target uses every usable row of --data)")
    parser.add_argument("--skip", type=int, default=0,
                        help="smollm2 / captioner: start after this many sequences of the prompt / sample stream (to build a "
                             "second, disjoint --data cache)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="self-distillation: the longest answer the target writes")
    parser.add_argument("--families", default=None,
                        help="captioner data: comma-separated caption data families to draw from (default: all six, "
                             "interleaved), e.g. to hold families out of a head's training")
    parser.add_argument("--split", default="train", choices=["train", "validation", "test"],
                        help="captioner data: the caption data split the images and prompts come from")
    parser.add_argument("--sample-temperature", type=float, default=0.0,
                        help="self-distillation: sample the target's answers at this temperature, for a drafter used "
                             "under sampling (0 = greedy answers; smollm2's are always greedy)")
    parser.add_argument("--vision-tokens", type=int, default=0,
                        help="EAGLE / EAGLE-3 on a VLM: the vision-aware head (ViSpec): the image tokens' target features "
                             "compressed into this many prefix positions plus a global image feature (0 = off)")
    parser.add_argument("--vision-lr-scale", type=float, default=1.0,
                        help="--vision-tokens: the adaptor's learning rate over --lr (a new adaptor beside a trained --init head)")
    parser.add_argument("--kl-weight", type=float, default=0.0,
                        help="EAGLE / EAGLE-3: weight of KL(target || head) on the draft vocabulary (for drafting under "
                             "sampling; EAGLE-3 then stores the target's last layer with its data)")
    parser.add_argument("--init", default=None, help="start from this head directory")
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="draft from the N most frequent tokens of the data (FR-Spec; 0 = the whole vocabulary)")
    parser.add_argument("--steps", type=int, default=2000, help="training steps (0: make the data cache only)")
    parser.set_defaults(zero_allowed=("steps",))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ce-positions", type=int, default=512, help="positions per batch that get the CE term")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=None, help="minutes; stop after a checkpoint")
    add_device_argument(parser)  # the self-distillation data is made on the CPU, the head trains on the device
    parser.set_defaults(route_defaults={name: parser.get_default(name) for name in RECIPE_DATA_OPTIONS + ANY_TARGET_OPTIONS})


#: options of the embedded recipes' own data (``--target smollm2 | captioner``: the prompts or caption
#: samples they draw, their cache); any other target reads its rows from --data and refuses them
RECIPE_DATA_OPTIONS = ("extra_data", "prompt_set", "sequences", "skip", "families", "split")
#: options of the any-target route (``--target PATH_OR_HUB_ID``, or the captioner with --data rows:
#: its data cache, held-out share and evaluation, dtype, loss log); the embedded recipes refuse them
#: (their cache is --data, their dtype and held-out share their own; --resume is no option of this
#: list: they resume by themselves)
ANY_TARGET_OPTIONS = ("cache", "prompt", "held_out", "hold_out_groups", "eval_examples", "gen_batch", "shard_size", "dtype",
                      "log_every", "trust_remote_code")


def given_options(args, names: tuple[str, ...]) -> list[str]:
    """The options of ``names`` given a value other than their default, as ``--name`` flags."""
    defaults = getattr(args, "route_defaults", {})
    return [f"--{name.replace('_', '-')}" for name in names if name in defaults and getattr(args, name) != defaults[name]]


def check_recipe_options(args) -> None:
    """The any-target route (``--target PATH_OR_HUB_ID``, or the captioner with a --data of rows):
    an option of :data:`RECIPE_DATA_OPTIONS` given (a value other than its default) is refused in
    one line rather than ignored (``--sequences 100`` did not cut the data to 100 rows)."""
    if given := given_options(args, RECIPE_DATA_OPTIONS):
        raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the embedded recipes' own data (--target "
                         f"smollm2 | captioner, --data their cache); with --data {args.data} every usable row of it is "
                         "used: put the rows to train on in --data (a JSONL, an image folder, a dataset or parquet files)")


def check_any_target_options(args) -> None:
    """The embedded recipes (``--target smollm2 | captioner`` over their self-distillation cache): an
    option of :data:`ANY_TARGET_OPTIONS` given is refused in one line rather than ignored
    (``--dtype float32`` trained in the recipe's dtype without a word)."""
    if given := given_options(args, ANY_TARGET_OPTIONS):
        raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to a target given by its path or "
                         f"hub id, or the captioner with --data rows (a JSONL, an image folder, a dataset); the --target "
                         f"{args.target} recipe over its cache ({args.data or f'runs/{args.target}-selfdistill'}) takes "
                         "none of them: drop them")


def load_target(name: str):
    """-> (model, tokenizer or processor) in bf16 where bf16 is fast, else fp32."""
    dtype = resolve_dtype("auto")
    if name == "smollm2":
        from ..hub import load_causal_lm

        return load_causal_lm("smollm2", dtype=dtype)
    from ..modeling.captioner import load_default_captioner

    return load_default_captioner(dtype=dtype)


def caption_families(names: str | None) -> tuple[str, ...]:
    """``--families`` (comma-separated, None: all) -> the caption data families, checked."""
    from .data import FAMILIES
    from .data.core import parse_names

    return parse_names(names, FAMILIES, "--families")


#: the settings a self-distillation cache's records depend on (its manifest, data.json); --sequences may grow it
DATA_SETTINGS = ("target", "prompt_set", "skip", "max_new_tokens", "families", "split", "sample_temperature")


def data_settings(args) -> dict:
    """The run's :data:`DATA_SETTINGS` (the cache's manifest, data.json)."""
    return {name: getattr(args, name, None) for name in DATA_SETTINGS}


def check_data_settings(args, data_dir: Path) -> None:
    """A cache made with other settings (another prompt set, token budget, ...) refused in one line,
    before the target loads: the smollm2 recipes' caches share one default folder, and a second
    recipe silently trained on the first's data. A cache without a manifest (made before it)
    is taken as it is; the manifest is written with the first chunk."""
    from ..cli.dataset import changed_settings

    manifest = data_dir / "data.json"
    if manifest.is_file():
        shown = changed_settings(json.loads(manifest.read_text()), data_settings(args))
        if shown:
            raise ValueError(f"--data {data_dir} holds self-distilled data made with other settings ({shown}); give another "
                             "--data folder for these, or the settings it was made with")


def prepare_data(args, model, tokenizer_or_processor, data_dir: Path, chunk: int = 64) -> None:
    from . import selfdistill

    done = len(list(data_dir.glob("chunk-*.pt")))
    if not done or (data_dir / "data.json").is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "data.json").write_text(json.dumps(data_settings(args)))
    total = math.ceil(args.sequences / chunk)
    for index in range(done, total):
        started = time.time()
        first = args.skip + index * chunk
        count = min(chunk, args.skip + args.sequences - first)
        if args.target == "smollm2":
            prompts = selfdistill.text_prompts(args.skip + args.sequences, prompt_set=args.prompt_set)[first : first + count]
            sequences = selfdistill.generate_text_sequences(model, tokenizer_or_processor, prompts, args.max_new_tokens)
            records = selfdistill.extract_text_features(model, sequences)
        else:
            from .data import make_sample

            from .eval_captioner import caption

            families = caption_families(args.families)
            samples = [make_sample(families[i % len(families)], args.split, i // len(families)) for i in range(first, first + count)]
            # the captioner's own answers, which are what its drafter will have to predict
            answers = [caption(model, tokenizer_or_processor, s.image, s.prompt, max_new_tokens=args.max_new_tokens,
                               temperature=args.sample_temperature, seed=first + i) for i, s in enumerate(samples)]
            records = selfdistill.extract_caption_features(model, tokenizer_or_processor, [(s.image, s.prompt, a) for s, a in zip(samples, answers)])
        selfdistill.save_chunk(data_dir, index, records)
        print(f"data chunk {index + 1}/{total}: {words.count(count, 'sequence')} in {time.time() - started:.0f} s", flush=True)


def collate(records) -> dict[str, torch.Tensor]:
    length = max(len(r["ids"]) for r in records)
    hidden = records[0]["features"].shape[-1]
    ids = torch.zeros((len(records), length), dtype=torch.long)
    learn = torch.zeros((len(records), length), dtype=torch.bool)
    features = torch.zeros((len(records), length, hidden), dtype=torch.bfloat16)
    shallow = torch.zeros_like(features) if "shallow" in records[0] else None
    for row, r in enumerate(records):
        n = len(r["ids"])
        ids[row, :n], learn[row, :n], features[row, :n] = r["ids"], r["learn"], r["features"]
        if shallow is not None:
            shallow[row, :n] = r["shallow"]
    return {"ids": ids, "learn": learn, "features": features, "shallow": shallow}


def image_features(ids: torch.Tensor, features: torch.Tensor, image_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The features at each row's image tokens, left-aligned: ids [B, L], features [B, L, H] ->
    (image [B, m, H], valid [B, m]), m the most image tokens of a row.

    Raises:
        ValueError: a row without image tokens (a vision-aware head trains on image prompts only).
    """
    is_image = ids == image_token_id
    counts = is_image.sum(dim=1)
    if bool((counts == 0).any()):
        raise ValueError("--vision-tokens: a training sequence holds no image token; train the vision-aware head on "
                         "image prompts only (or without --vision-tokens)")
    order = torch.argsort((~is_image).to(torch.int8), dim=1, stable=True)[:, : int(counts.max())]  # image positions first
    image = features.gather(1, order[..., None].expand(-1, -1, features.shape[-1]))
    return image, torch.arange(order.shape[1], device=ids.device)[None] < counts[:, None]


def eagle_teacher_forced(head: EagleHead, embed: torch.Tensor, batch: dict[str, torch.Tensor], image_token_id: int | None = None):
    """The head over a batch's pairs t = 0..L-2, (f_t, x_{t+1}) -> f^_{t+1}, teacher-forced (a
    :class:`VisionEagleHead` also reads the features at the ``image_token_id`` tokens).

    Returns predicted [B, L-1, H] and, on the n positions whose token x_{t+2} is learnt, the rows
    (f^_{t+1} [n, H], the target's own f_{t+1} [n, H], x_{t+2} [n])."""
    ids, features = batch["ids"], batch["features"].float()
    if isinstance(head, VisionEagleHead):
        if image_token_id is None:
            raise ValueError("a vision-aware EAGLE head needs the target's image token id")
        vision: VisionContext = head.vision_context(*image_features(ids, features, image_token_id))
        predicted = head.teacher_forced(features[:, :-1], embed[ids[:, 1:]], vision)
    else:
        positions = torch.arange(ids.shape[1] - 1, device=ids.device)[None].expand(ids.shape[0], -1)
        predicted = head(features[:, :-1], embed[ids[:, 1:]], None, positions)
    classify = batch["learn"][:, 2:]
    return predicted, (predicted[:, :-1][classify], features[:, 1:-1][classify], ids[:, 2:][classify])


def eagle_loss(head: EagleHead, embed: torch.Tensor, lm_head: torch.Tensor, batch: dict[str, torch.Tensor],
               ce_positions: int | None = None, generator: torch.Generator | None = None,
               kl_weight: float = 0.0, draft_vocabulary: torch.Tensor | None = None,
               image_token_id: int | None = None) -> tuple[torch.Tensor, float]:
    """Pairs t = 0..L-2: (f_t, x_{t+1}) -> f^_{t+1}; regression on positions whose token x_{t+1} is
    learnt, CE of x_{t+2} where that token is learnt (on a random ``ce_positions`` of them: the
    49k-row LM head is most of a step's cost), and with ``kl_weight`` > 0 that weight times
    KL(p || q) over ``draft_vocabulary`` (the rows the drafter scores) on the same positions,
    p = softmax(LMHead(f_{t+1})) renormalised there, q = softmax(LMHead(f^_{t+1})).
    ``image_token_id``: where a vision-aware head finds the image tokens.
    Returns (loss, top-1 accuracy of x_{t+2})."""
    predicted, (chosen, teacher, targets) = eagle_teacher_forced(head, embed, batch, image_token_id)
    features, regress = batch["features"].float(), batch["learn"][:, 1:]
    feature_loss = torch.nn.functional.smooth_l1_loss(predicted[regress].float(), features[:, 1:][regress])
    if ce_positions is not None and len(targets) > ce_positions:
        keep = torch.randperm(len(targets), generator=generator)[:ce_positions].to(targets.device)
        chosen, targets, teacher = chosen[keep], targets[keep], teacher[keep]
    logits = chosen @ lm_head.T
    token_loss = torch.nn.functional.cross_entropy(logits.float(), targets)
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    loss = feature_loss + 0.1 * token_loss
    if kl_weight:
        rows = lm_head if draft_vocabulary is None else lm_head[draft_vocabulary]
        log_q = torch.log_softmax((chosen @ rows.T).float(), dim=-1)
        log_p = torch.log_softmax((teacher @ rows.T).float(), dim=-1)
        loss = loss + kl_weight * torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    return loss, accuracy


def heads_loss(heads: DraftHeads, embed: torch.Tensor, lm_head: torch.Tensor, batch: dict[str, torch.Tensor],
               ce_positions: int | None = None, generator: torch.Generator | None = None) -> tuple[torch.Tensor, float]:
    """Head i (0-based) on f_t predicts x_{t+2+i} where that token is learnt; Hydra heads also get
    e(x_{t+1}) .. e(x_{t+1+i}). Loss sum_i 0.8^i CE_i. Returns (loss, head 0's top-1 accuracy)."""
    ids, learn, features = batch["ids"], batch["learn"], batch["features"].float()
    length = ids.shape[1]
    total, first_accuracy = 0.0, 0.0
    for i in range(heads.num_heads):
        span = length - 2 - i
        if span <= 0:
            break
        valid = learn[:, 2 + i :]
        chosen = features[:, :span][valid]
        targets = ids[:, 2 + i :][valid]
        prefix = None
        if heads.kind == "hydra":
            prefix = torch.stack([ids[:, 1 + j : 1 + j + span] for j in range(i + 1)], dim=-1)[valid]  # [n, i+1]
        if ce_positions is not None and len(targets) > ce_positions:
            keep = torch.randperm(len(targets), generator=generator)[:ce_positions].to(targets.device)
            chosen, targets = chosen[keep], targets[keep]
            prefix = prefix[keep] if prefix is not None else None
        state = heads.head_state(i, chosen, embed[prefix] if prefix is not None else None)
        logits = state @ lm_head.T
        total = total + 0.8**i * torch.nn.functional.cross_entropy(logits.float(), targets)
        if i == 0:
            first_accuracy = (logits.argmax(-1) == targets).float().mean().item()
    return total, first_accuracy


def kangaroo_loss(adapter: KangarooAdapter, final_norm, lm_head: torch.Tensor, batch: dict[str, torch.Tensor],
                  ce_positions: int | None = None, generator: torch.Generator | None = None) -> tuple[torch.Tensor, float]:
    """Adapter over the normalised shallow states s_{<=t} predicts x_{t+1} where it is learnt (CE).
    Returns (loss, top-1 accuracy)."""
    ids, learn = batch["ids"], batch["learn"]
    shallow = final_norm(batch["shallow"].to(lm_head.dtype)).float()
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    states = adapter(shallow, None, positions)[:, :-1][learn[:, 1:]]
    targets = ids[:, 1:][learn[:, 1:]]
    if ce_positions is not None and len(targets) > ce_positions:
        keep = torch.randperm(len(targets), generator=generator)[:ce_positions].to(targets.device)
        states, targets = states[keep], targets[keep]
    logits = states @ lm_head.T
    return torch.nn.functional.cross_entropy(logits.float(), targets), (logits.argmax(-1) == targets).float().mean().item()


def write_draft_vocabulary(out: Path, size: int, train, held_out, token_ids: torch.Tensor | None = None) -> None:
    """Save the ``size`` most frequent answer tokens of ``train`` next to the head, or ``token_ids``
    where the head comes with its own (an EAGLE-3 ``--init``: :func:`init_vocabulary`), with their
    coverage of the held-out answers (:mod:`mmspec.drafters.vocab`)."""
    if token_ids is None and not size:
        (out / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
        return
    if token_ids is None:
        token_ids, _ = frequent_tokens(train, size)
    if not held_out:  # (--held-out 0: nothing to measure the coverage on, so none is claimed)
        save_draft_vocabulary(out, token_ids, held_out_coverage=None)
        print(f"draft vocabulary: {words.count(len(token_ids), 'token')} (no held-out answers to measure their coverage on)", flush=True)
        return
    share = coverage(token_ids, held_out)
    save_draft_vocabulary(out, token_ids, held_out_coverage=round(share, 4))
    print(f"draft vocabulary: {words.count(len(token_ids), 'token')} cover{'s' * (len(token_ids) == 1)} {share:.1%} of held-out answer tokens", flush=True)


def parameter_groups(head: torch.nn.Module, vision_lr_scale: float = 1.0) -> list[dict]:
    """The optimizer's groups, each with its ``lr_scale`` (of the schedule's rate): a vision-aware
    head's adaptor (new, next to a trained head) at ``vision_lr_scale``, the rest at 1."""
    vision = list(head.vision.parameters()) if getattr(head, "vision_tokens", 0) else []
    ids = {id(p) for p in vision}
    groups = [{"params": [p for p in head.parameters() if id(p) not in ids], "lr_scale": 1.0}]
    return groups + ([{"params": vision, "lr_scale": vision_lr_scale}] if vision else [])


def with_vision_option(head, vision_tokens: int):
    """``--vision-tokens``: 0 keeps ``head`` (an EAGLE or EAGLE-3 head) as it is (a vision-aware
    ``--init`` stays one); K > 0 gives its vision-aware kind with K tokens (from a plain head:
    :meth:`VisionEagleHead.extend` / :meth:`~mmspec.modeling.eagle3.VisionEagle3Head.extend`)."""
    from ..modeling.eagle3 import Eagle3Head, VisionEagle3Head

    if not vision_tokens:
        return head
    if getattr(head, "vision_tokens", 0):
        if head.vision_tokens != vision_tokens:
            raise ValueError(f"--init holds a vision-aware head with {head.vision_tokens} vision tokens, not {vision_tokens}; "
                             f"pass --vision-tokens {head.vision_tokens}")
        return head
    return (VisionEagle3Head if isinstance(head, Eagle3Head) else VisionEagleHead).extend(head, vision_tokens)


def make_head(method: str, model, embed: torch.Tensor, args, device: torch.device, out: Path, stored_states: bool = True):
    """(the head to train, its loss function (head, embed, lm_head, batch, ce_positions?, generator?)
    -> (loss, top-1 accuracy)) for ``method``. EAGLE-3 reads its three target layers from the
    batch's "features" (``stored_states``: any target's records) or recomputes them from the ids
    with a teacher-forced text forward of ``model`` (the embedded text recipe's records keep the last layer only)."""
    from ..adapters.hf import final_norm as decoder_norm, text_decoder

    if method == "eagle3":
        head = eagle3_head(model, args, out)
        layers = eagle3_state_layers(tuple(head.config.aux_layers), model, args.kl_weight)
        fused = len(head.config.aux_layers) * head.config.target_hidden_size
        image_token_id = vision_image_token(head, model)

        def loss_of(head, embed, lm_head, batch, *rest):  # (its own LM head over the draft vocabulary: no subsampling)
            states = batch["features"] if stored_states else \
                target_states(model, batch["ids"].to(model.device), layers).to(batch["ids"].device)
            vision = None if image_token_id is None else \
                head.vision_context(*image_features(batch["ids"], states[..., :fused], image_token_id))
            rows = lm_head[head.token_ids.to(lm_head.device)] if args.kl_weight else None
            return eagle3_loss(head, embed, batch, states, args.ttt_steps, vision, args.kl_weight, rows)
    elif method == "eagle":
        head = init_head(method, args.init, model) if args.init else EagleHead(text_decoder(model).config).float()
        head = with_vision_option(head, getattr(args, "vision_tokens", 0))
        image_token_id = vision_image_token(head, model)
        draft_vocabulary = load_draft_vocabulary(out) if args.kl_weight else None
        draft_vocabulary = None if draft_vocabulary is None else draft_vocabulary.to(device)

        def loss_of(head, embed, lm_head, batch, *rest):
            return eagle_loss(head, embed, lm_head, batch, *rest, kl_weight=args.kl_weight, draft_vocabulary=draft_vocabulary,
                              image_token_id=image_token_id)
    elif method == "kangaroo":
        head = init_head(method, args.init, model) if args.init else KangarooAdapter(text_decoder(model).config).float()
        final_norm = copy.deepcopy(decoder_norm(text_decoder(model))).to(device)

        def loss_of(adapter, embed, lm_head, batch, *rest):
            return kangaroo_loss(adapter, final_norm, lm_head, batch, *rest)
    else:
        head = init_head(method, args.init, model) if args.init else DraftHeads(embed.shape[1], args.num_heads, method).float()
        loss_of = heads_loss
    return head, loss_of


def init_vocabulary(args, model) -> torch.Tensor | None:
    """The draft vocabulary an ``--init`` head brings and keeps (EAGLE-3's LM head has a row per
    draft token: its own, not the new data's most frequent ones) [N], or None (the data's is written)."""
    if args.method != "eagle3" or not args.init:
        return None
    return init_head("eagle3", args.init, model).token_ids


def init_head(method: str, directory: str, model) -> torch.nn.Module:
    """``--init``'s head for ``method`` (fp32), checked against ``model``'s widths (and, for
    EAGLE-3, its vocabulary and layers).

    Raises:
        ValueError / FileNotFoundError: one line, when ``directory`` holds no head of ``method`` or one
            made for another target.
    """
    from ..modeling.eagle3 import Eagle3Head

    if method == "eagle3":
        return Eagle3Head.load(directory, model).float()
    if method in ("medusa", "hydra"):
        return DraftHeads.load(directory, model, method).float()
    return (KangarooAdapter if method == "kangaroo" else EagleHead).load(directory, model).float()


def check_init(args, model=None) -> None:
    """``--init`` checked before the data is made: without ``model`` (before the target loads)
    that the directory exists; with it, that it holds a head of ``--method`` for this target (the
    self-distillation it would follow can take hours), as many Medusa / Hydra heads as ``--num-heads``."""
    if not args.init:
        return
    if model is None:
        if not Path(args.init).is_dir():
            raise ValueError(f"--init {args.init}: no such directory; give the folder of a trained --method {args.method} head")
        return
    head = init_head(args.method, args.init, model)
    if args.method in ("medusa", "hydra") and head.num_heads != args.num_heads:  # (the saved count would win without a word)
        raise ValueError(f"--init {args.init} holds {head.num_heads} {args.method} heads, not {args.num_heads}; pass "
                         f"--num-heads {head.num_heads}")


def vision_image_token(head, model) -> int | None:
    """The target's image token id, which a vision-aware head (``vision_tokens`` > 0) reads; None
    for a plain head. Raises ValueError for a vision-aware head over a target without image tokens."""
    from ..adapters.hf import config_image_token_id

    if not getattr(head, "vision_tokens", 0):
        return None
    token = config_image_token_id(model.config)
    if token is None:
        raise ValueError(f"the vision-aware head reads a VLM's image tokens; {type(model).__name__} has none "
                         "(train without --vision-tokens)")
    return token


def eagle3_head(model, args, out: Path):
    """The EAGLE-3 head to train for ``model`` (fp32): ``--init``'s, or a new one over the draft
    vocabulary written in ``out`` (:func:`write_draft_vocabulary`: the ``--draft-vocab`` most
    frequent answer tokens of the training data, most frequent first; d2t / t2d built from it;
    none written: the whole vocabulary)."""
    from dataclasses import replace

    from ..modeling.eagle3 import Eagle3Config, Eagle3Head

    vision_tokens = getattr(args, "vision_tokens", 0)
    if args.init:
        return with_vision_option(init_head("eagle3", args.init, model), vision_tokens)
    vocab = model.get_output_embeddings().weight.shape[0]
    token_ids = load_draft_vocabulary(out)
    token_ids = torch.arange(vocab) if token_ids is None else token_ids
    config = Eagle3Config.for_target(model.config.get_text_config(decoder=True), draft_vocab_size=len(token_ids))
    head = Eagle3Head(replace(config, vocab_size=vocab))  # (the LM head's rows: a VLM's text config may count fewer)
    head.set_draft_vocabulary(token_ids)
    return with_vision_option(head.float(), vision_tokens)


def feature_layer(method: str, model, args) -> int | tuple[int, ...]:
    """The target states a method's records keep as "features": the last layer's (-1), or for
    EAGLE-3 the ``hidden_states`` entries its head fuses (``--init``'s, else (2, L // 2, L - 3)),
    and with ``--kl-weight`` the last entry after them (:func:`eagle3_state_layers`)."""
    if method != "eagle3":
        return -1
    from ..modeling.eagle3 import default_aux_layers

    if args.init:
        aux = tuple(init_head(method, args.init, model).config.aux_layers)
    else:
        aux = default_aux_layers(model.config.get_text_config(decoder=True).num_hidden_layers)
    return eagle3_state_layers(aux, model, args.kl_weight)


def eagle3_state_layers(aux_layers: tuple[int, ...], model, kl_weight: float) -> tuple[int, ...]:
    """The ``hidden_states`` entries an EAGLE-3 head's training reads: the fused ``aux_layers``,
    then with ``kl_weight`` > 0 the last one (L: after the final norm, what the LM head reads), from
    which :func:`mmspec.train.eagle3.eagle3_loss` takes the target's distribution."""
    if not kl_weight:
        return tuple(aux_layers)
    return tuple(aux_layers) + (model.config.get_text_config(decoder=True).num_hidden_layers,)


def input_embedding_table(model) -> torch.Tensor:
    """The target's token embeddings as its forward applies them [V, H] (fp32): the table, times
    ``embed_scale`` where the embedding scales (Gemma's sqrt(H)), which is what the drafters read
    at generation time through the embedding module."""
    module = model.get_input_embeddings()
    table = module.weight.detach().float()
    scale = getattr(module, "embed_scale", None)
    return table * (scale.float() if isinstance(scale, torch.Tensor) else scale) if scale is not None else table


#: --method -> the drafter spec that evaluates the trained head (``SPEC:OUT``)
EVAL_SPECS = {"eagle": "eagle2", "eagle3": "eagle3-tree", "medusa": "medusa", "hydra": "hydra", "kangaroo": "kangaroo"}
#: --method -> the chain spec used instead on a target that verifies no trees (hybrid recurrent decoders)
CHAIN_SPECS = {"eagle": "eagle", "eagle3": "eagle3"}


def check_vision_option(args) -> None:
    """``--vision-tokens``: a non-negative count, for ``--method eagle`` or ``eagle3``; so is ``--kl-weight``."""
    if args.vision_tokens < 0:
        raise ValueError(f"--vision-tokens must be 0 (off) or a positive count, got {args.vision_tokens}")
    if not (math.isfinite(args.vision_lr_scale) and args.vision_lr_scale > 0):
        raise ValueError(f"--vision-lr-scale must be a positive number, got {args.vision_lr_scale}")
    if args.vision_tokens and args.method not in ("eagle", "eagle3"):
        raise ValueError(f"--vision-tokens is an option of the EAGLE heads (--method eagle or eagle3), not --method {args.method}")
    if args.kl_weight and args.method not in ("eagle", "eagle3"):
        raise ValueError(f"--kl-weight is an option of the EAGLE heads (--method eagle or eagle3), not --method {args.method}: "
                         "drop it")


def check_target_for_method(args, model, target, shallow_layer: int | None) -> None:
    """What --method needs of the loaded target, refused before self-distillation: Kangaroo a
    shallow draft of ``shallow_layer`` layers that the target can run (two layers or more, an
    attention layer among them on a hybrid recurrent decoder); Medusa and Hydra token trees, which a
    hybrid recurrent target does not verify."""
    from ..adapters.hf import text_decoder, truncated_decoder
    from ..core.target import tree_refusal
    from .selfdistill import SHALLOW_LAYER

    if shallow_layer is not None:
        if shallow_layer < 1:
            raise ValueError(f"--method kangaroo needs a target of at least 2 decoder layers (its draft exits after layer "
                             f"min({SHALLOW_LAYER}, layers - 1)); {args.target} has {shallow_layer + 1}")
        truncated_decoder(text_decoder(model), shallow_layer, "--method kangaroo (its exit layer)")
    refusal = tree_refusal(target)
    if refusal and args.method in ("medusa", "hydra"):
        raise ValueError(f"--method {args.method} drafts token trees, and {refusal.split(' Use ')[0]} Train --method eagle "
                         "or eagle3 for this target (its chain is evaluated and decoded there)")


def head_settings(args) -> dict:
    """The settings that shape the head a checkpoint holds: its method, Medusa / Hydra's head count,
    the vision option's tokens, EAGLE-3's draft vocabulary (its LM head's rows)."""
    shaping = {"method": args.method, "vision_tokens": args.vision_tokens}
    if args.method in ("medusa", "hydra"):
        shaping["num_heads"] = args.num_heads
    if args.method == "eagle3":
        shaping["draft_vocab"] = args.draft_vocab
    return shaping


def check_resume_settings(args, out: Path) -> None:
    """``--resume`` with a setting of :func:`head_settings` changed since the checkpoint (its
    ``training.json``) is refused in one line before anything loads: the checkpoint's head has
    another shape, and was refused only after the data was made (another --method was told its
    data cache differed, to be deleted and made again before the same refusal)."""
    try:
        before = json.loads((out / "training.json").read_text())["args"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    changed = [(name, value) for name, value in head_settings(args).items() if name in before and before[name] != value]
    if changed:
        shown = " ".join(f"--{name.replace('_', '-')} {before[name]}" for name, _ in changed)
        now = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in changed)
        raise ValueError(f"--resume: the checkpoint in {out} trains a head of {shown} (its training.json), not {now}; resume "
                         "it with those, or train this head into another --out")


def run_any_target(args) -> int:
    """``--target PATH_OR_HUB_ID --data DATA``: self-distil (:mod:`mmspec.train.any_target`),
    train data-parallel over the processes of ``accelerate launch`` (each takes its share of the
    step's global batch of ``--batch-size`` sequences; gradients are averaged over the processes
    before clipping, so n processes take the one-process step), then decode the held-out prompts
    with the trained drafter and print its tau."""
    import csv

    from ..cli.dataset import ProcessState, Progress
    from ..adapters.hf import TransformersTarget, text_decoder
    from . import any_target
    from .selfdistill import SHALLOW_LAYER

    check_vision_option(args)
    if not args.data:
        raise ValueError("--target PATH_OR_HUB_ID needs --data DATA (a JSONL, an image folder, a saved dataset or parquet files)")
    if not args.out:
        raise ValueError("--target PATH_OR_HUB_ID needs --out DIR (where the trained drafter goes)")
    check_recipe_options(args)
    if args.held_out is not None and args.hold_out_groups:
        raise ValueError("--held-out and --hold-out-groups: give one (the groups are held out instead of a random share)")
    args.held_out = 0.1 if args.held_out is None else args.held_out
    if not 0 <= args.held_out < 1:
        raise ValueError(f"--held-out must be in [0, 1), got {args.held_out}")
    for name in ("batch_size", "shard_size", "gen_batch", "log_every", "save_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    out = Path(args.out)
    check_fresh_out(out, args)  # (before the draft vocabulary or anything else is written into it)
    overwrite = getattr(args, "overwrite", False)
    if overwrite and args.resume:
        raise ValueError("--overwrite trains anew and --resume continues the checkpoint: give one of them")
    if (out / STATE_FILE).exists() and not args.resume and not overwrite:
        raise ValueError(f"{out} holds a checkpoint; pass --resume to continue it, --overwrite to train anew there "
                         "(replacing it), or choose another --out")
    if args.resume and not (out / STATE_FILE).exists():
        cache = Path(args.cache) if args.cache else out / "data"
        made = (cache / any_target.MANIFEST).is_file()
        raise ValueError(f"--resume: {out} holds no checkpoint ({STATE_FILE}) to continue; rerun without --resume"
                         + (f" (it reuses the data made so far in {cache})" if made else ""))
    if args.resume:
        check_resume_settings(args, out)
    if args.target != "captioner":
        any_target.target_source(args.target)  # (a missing directory before the data is read)
    check_init(args)
    examples, skipped = any_target.read_examples(args.data, args.prompt or any_target.DEFAULT_PROMPT, args.prompt is not None)
    held_groups = set(filter(None, (g.strip() for g in (args.hold_out_groups or "").split(","))))
    if held_groups:
        present = {example.group for example in examples}
        if held_groups - present:
            named = ", ".join(sorted(g for g in present if g)) or 'none: give the rows a "group" field'
            raise ValueError(f"--hold-out-groups: no row of --data {args.data} has group {', '.join(sorted(held_groups - present))} "
                             f"(its groups: {named})")
        if not present - held_groups:
            raise ValueError("--hold-out-groups holds out every row of --data: leave some groups to train on")
    process = ProcessState()
    if args.batch_size % process.world:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the {process.world} processes")
    if overwrite:  # (after the checks above: a refused command replaces nothing)
        for name in (STATE_FILE, "training.json", "loss.csv", "eval.json"):  # the last run's checkpoint and records
            (out / name).unlink(missing_ok=True)
    device = torch.device(process.device_for(args.device)) if process.world > 1 else train_device(args)
    dtype = resolve_dtype(args.dtype, device)
    cache = Path(args.cache) if args.cache else out / "data"
    any_target.check_cache(cache, any_target.cache_settings(args, examples))  # (before the target loads)
    model, processor, is_vlm = any_target.load_target(args.target, dtype, device, args.trust_remote_code)
    if args.vision_tokens and not is_vlm:
        raise ValueError(f"--vision-tokens: {args.target} is a text model; the vision-aware head reads a VLM's image tokens")
    target = TransformersTarget(model)
    layers = text_decoder(model).config.num_hidden_layers
    shallow_layer = min(SHALLOW_LAYER, layers - 1) if args.method == "kangaroo" else None
    check_target_for_method(args, model, target, shallow_layer)
    check_init(args, model)  # (before self-distillation)
    records, encode_skipped = any_target.prepare_shards(target, model, processor, is_vlm, examples, cache, args,
                                                        shallow_layer, process, feature_layer(args.method, model, args))
    for reason, n in encode_skipped.items():
        skipped[reason] = skipped.get(reason, 0) + n
    if process.rank == 0:
        print(f"data: {words.count(len(records), 'sequence')} from {args.data}"
              + (f"; skipped {any_target.skipped_total(skipped)}: {any_target.format_skipped(skipped)}" if skipped else "; no row skipped"),
              flush=True)
    if not records:
        process.wait()  # (every process has read the shards)
        if process.rank == 0:
            any_target.discard_cache(cache)
        raise ValueError(f"--data {args.data}: no row could be used ({any_target.format_skipped(skipped)}; nothing was "
                         "cached)")
    groups = [examples_of(record, examples).group for record in records]
    train_ids, held_ids = any_target.split_held_out(len(records), args.held_out, args.seed, groups, held_groups)
    if held_groups and process.rank == 0:
        print(f"held out of training: groups {', '.join(sorted(held_groups))} ({words.count(len(held_ids), 'sequence')}); training on "
              f"{words.count(len(train_ids), 'sequence')} of groups {', '.join(sorted({g or '(none)' for g in groups} - held_groups))}", flush=True)
    train, held_out = [records[i] for i in train_ids], [records[i] for i in held_ids]
    if args.steps == 0:
        return data_only(cache, process.rank == 0)
    out.mkdir(parents=True, exist_ok=True)
    vocabulary = min(args.draft_vocab, model.get_output_embeddings().weight.shape[0])
    if process.rank == 0:
        write_draft_vocabulary(out, vocabulary, train, held_out, init_vocabulary(args, model))
    process.wait()
    embed = input_embedding_table(model).to(device)
    lm_head = model.get_output_embeddings().weight.detach().float().to(device)
    torch.manual_seed(args.seed)  # the same initial head in every process
    head, loss_of = make_head(args.method, model, embed, args, device, out)
    head.to(device).train()
    optimizer = torch.optim.AdamW(parameter_groups(head, getattr(args, "vision_lr_scale", 1.0)), lr=args.lr, weight_decay=0.0,
                                  betas=(0.9, 0.95))
    world = process.world

    def average_gradients() -> None:
        """DDP's all-reduce: every process ends with the mean of the processes' gradients."""
        import torch.distributed as dist

        for parameter in head.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)
                parameter.grad /= world

    def global_mean(value: float) -> float:
        if world == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64, device=device)  # nccl reduces device tensors
        dist.all_reduce(tensor)
        return float(tensor) / world

    def on_device(rows) -> dict[str, torch.Tensor]:
        return to_device(collate(rows), device)

    run = TrainingRun(out, args, args.time_limit, announce=process.rank == 0)
    run.resume_into(head=head, optimizer=optimizer)
    progress = Progress(args.steps, always=True, unit="step", show=process.rank == 0, initial=run.step)  # (its rate: this run's)
    card = {"target": args.target, "trained_with": "mmspec train drafter"}
    if args.method == "kangaroo":
        card["exit_layer"] = shallow_layer
    if args.method == "eagle3":
        card["ttt_steps"] = args.ttt_steps
    while run.step < args.steps:
        step = run.step
        order = torch.randint(len(train), (args.batch_size,), generator=torch.Generator().manual_seed(args.seed * 100003 + step))
        mine = order[process.rank :: world].tolist()  # this process's share of the global batch
        lr = warmup_cosine(step, args.steps, args.lr, warmup=min(50, max(1, args.steps // 10)), floor=0.05)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        with autocast(device):
            loss, _ = loss_of(head, embed, lm_head, on_device([train[i] for i in mine]), args.ce_positions,
                              torch.Generator().manual_seed(step))
        if world > 1:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            run.step += 1
        else:
            run.optimizer_step(loss, optimizer, head.parameters())
        progress.step()
        saving = run.should_save(args.save_every, args.steps)
        if run.step % args.log_every == 0 or saving:
            entry = {"loss": global_mean(loss.item()), "lr": lr}
            if held_out:
                head.eval()
                with torch.no_grad(), autocast(device):
                    scores = [loss_of(head, embed, lm_head, on_device(held_out[i : i + 16])) for i in range(0, len(held_out), 16)]
                head.train()
                entry.update(held_out_loss=sum(s[0].item() for s in scores) / len(scores),
                             held_out_top1=sum(s[1] for s in scores) / len(scores))
            if process.rank == 0:
                run.record(**entry)
                # every logged step (a resumed run rewrites it from its checkpoint's log on)
                with open(out / "loss.csv", "w", newline="") as file:
                    writer = csv.DictWriter(file, fieldnames=sorted({k for e in run.log for k in e},
                                                                    key=lambda k: (k != "step", k)))
                    writer.writeheader()
                    writer.writerows(run.log)
        if saving and process.rank == 0:
            run.save(head=head.state_dict(), optimizer=optimizer.state_dict())
            copy.deepcopy(head).to(model.dtype).save(out, **card, step=run.step)
        if run.stop_if_out_of_time():
            break
    progress.close()
    process.wait()
    if process.rank == 0 and args.eval_examples and held_ids and run.step >= args.steps:
        evaluate(args, target, model, processor, is_vlm, [examples_of(records[i], examples) for i in held_ids][: args.eval_examples],
                 [records[i] for i in held_ids][: args.eval_examples], out)
    return 0


def examples_of(record, examples):
    return examples[int(record["index"])]


def evaluate(args, target, model, processor, is_vlm: bool, held_examples, held_records, out: Path) -> dict:
    """Decode the held-out prompts with the trained drafter (``EVAL_SPECS[method]:OUT``), greedy;
    print and save (OUT/eval.json) its tau, and how many answers equal the target's own greedy
    answers stored in the data (self-distilled at temperature 0: they are its plain decoding)."""
    from ..api import generate
    from ..drafters import resolve_drafter
    from . import any_target

    from ..core.target import tree_refusal

    # a target that verifies no trees (hybrid recurrent decoders) evaluates an EAGLE head as a chain;
    # the line below names the spec used
    spec = CHAIN_SPECS[args.method] if args.method in CHAIN_SPECS and tree_refusal(target) else EVAL_SPECS[args.method]
    drafter = resolve_drafter(f"{spec}:{out}", target)
    taus, same, compared = [], 0, 0
    for example, record in zip(held_examples, held_records):
        inputs = any_target.prompt_inputs(model, processor, is_vlm, example)
        result = generate(target, drafter, max_new_tokens=args.max_new_tokens, **inputs)
        taus.append(result.stats.mean_accepted_length)
        if example.response is None and args.sample_temperature == 0:
            compared += 1
            same += bool(torch.equal(result.sequences[0].cpu(), record["ids"]))
    report = {"drafter": f"{spec}:{out}", "held_out_prompts": len(taus), "dtype": str(model.dtype),
              "tau": round(sum(taus) / len(taus), 3), "identical_to_target": f"{same}/{compared}" if compared else None}
    (out / "eval.json").write_text(json.dumps(report, indent=1))
    # in bf16 / fp16 a near-tie can round differently in a one-token and a many-token forward, so
    # the target's own answers and the verified ones may part there; fp32 is exact
    note = "" if model.dtype == torch.float32 else f" ({report['dtype']}: near-ties may round differently; exact in float32)"
    print(f"held-out tau of {report['drafter']}: {report['tau']:.2f} over {words.count(len(taus), 'prompt')}"
          + (f"; greedy output identical to the target's own answers on {same}/{compared}{note}" if compared else ""), flush=True)
    return report


def data_only(cache: Path, announce: bool = True) -> int:
    """``--steps 0``: the self-distillation data made (or found) in ``cache``, nothing trained."""
    if announce:
        print(f"--steps 0: the data is ready in {cache}; nothing trained (give --steps N to train on it)", flush=True)
    return 0


def reads_any_data(args) -> bool:
    """Whether ``--target captioner`` trains through the any-target loop: EAGLE-3 always (its three
    target layers need the image inputs, which the recipe's cached records do not keep), any
    method when ``--data`` is a JSONL / image folder / dataset rather than a self-distillation cache
    (a folder of ``chunk-*.pt``, or an absent or empty one the recipe fills)."""
    if args.target != "captioner":
        return False
    if args.method == "eagle3":
        if not args.data:
            raise ValueError("--target captioner --method eagle3 needs --data DATA: images and prompts, e.g. "
                             "`mmspec train caption-data --out runs/caption-data`, then --data runs/caption-data/data.jsonl")
        return True
    if not args.data:
        return False
    path = Path(args.data)
    if any(c in args.data for c in "*?["):  # a parquet glob
        return True
    # the recipe's own cache: a folder of chunk-*.pt, or one it will make (absent or empty)
    return path.exists() and not (path.is_dir() and (any(path.glob("chunk-*.pt")) or not any(path.iterdir())))


def run(args) -> int:
    if args.target not in TARGETS:
        return run_any_target(args)
    args.out = args.out or str(models_dir() / f"{'smolcap' if args.target == 'captioner' else args.target}-{args.method}")
    if reads_any_data(args):
        return run_any_target(args)
    from .selfdistill import SHALLOW_LAYER, load_chunks

    check_any_target_options(args)
    caption_families(args.families)  # (a typo fails before the target loads)
    check_vision_option(args)
    if args.target == "smollm2" and args.sample_temperature:
        raise ValueError("--sample-temperature: the smollm2 recipe's answers are greedy; sampled answers are made for "
                         "--target captioner, and for SmolLM2 by the any-target route: --target smollm2-135m-instruct --data PROMPTS.jsonl")
    if args.sequences < 8:
        raise ValueError(f"--sequences must be at least 8 (one in 8, at most 64, is held out for the loss), got {args.sequences}")
    for directory in args.extra_data:  # before the target loads
        load_chunks(Path(directory))
    if args.vision_tokens and args.target != "captioner":
        raise ValueError("--vision-tokens trains a head that reads image tokens: use a VLM target (--target captioner, or a VLM's "
                         "checkpoint with --data)")
    device = train_device(args)
    out = Path(args.out)
    check_fresh_out(out, args)  # (before the draft vocabulary or anything else is written into it)
    data_dir = Path(args.data or f"runs/{args.target}-selfdistill")
    if not data_dir.exists() and data_dir.suffix.lower() in (".jsonl", ".json", ".parquet", ".csv", ".txt"):
        raise FileNotFoundError(f"--data {data_dir} does not exist (for --target {args.target} --data is the "
                                "self-distillation cache folder, made if absent; a data file must exist)")
    if data_dir.exists() and not data_dir.is_dir():
        raise ValueError(f"--data {data_dir} is a file; for --target {args.target} --data is the self-distillation cache "
                         "folder (a JSONL, dataset or parquet file goes with --target PATH_OR_HUB_ID)")
    check_data_settings(args, data_dir)
    check_init(args)
    model, tokenizer_or_processor = load_target(args.target)
    check_init(args, model)  # (before the data is made)
    prepare_data(args, model, tokenizer_or_processor, data_dir)
    if args.steps == 0:
        return data_only(data_dir)
    records = load_chunks(data_dir)
    extra = [record for directory in args.extra_data for record in load_chunks(Path(directory))]
    held = min(64, len(records) // 8)
    held_out, train = records[:held], records[held:] + extra
    write_draft_vocabulary(out, args.draft_vocab, train, held_out, init_vocabulary(args, model))
    embed = model.get_input_embeddings().weight.detach().to(device)
    lm_head = model.get_output_embeddings().weight.detach().to(device)
    head, loss_of = make_head(args.method, model, embed, args, device, out, stored_states=False)
    head.to(device).train()
    optimizer = torch.optim.AdamW(parameter_groups(head, getattr(args, "vision_lr_scale", 1.0)), lr=args.lr, weight_decay=0.0,
                                  betas=(0.9, 0.95))

    def on_device(records) -> dict[str, torch.Tensor]:
        return to_device(collate(records), device)

    run = TrainingRun(out, args, args.time_limit)
    run.resume_into(head=head, optimizer=optimizer)
    while run.step < args.steps:
        step = run.step
        order = torch.randint(len(train), (args.batch_size,), generator=torch.Generator().manual_seed(step))
        lr = warmup_cosine(step, args.steps, args.lr, warmup=50, floor=0.05)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        with autocast(device):
            loss, _ = loss_of(head, embed, lm_head, on_device([train[i] for i in order.tolist()]),
                              args.ce_positions, torch.Generator().manual_seed(step))
        run.optimizer_step(loss, optimizer, head.parameters())
        if run.should_save(args.save_every, args.steps):
            head.eval()
            with torch.no_grad(), autocast(device):
                scores = [loss_of(head, embed, lm_head, on_device(held_out[i : i + 16])) for i in range(0, len(held_out), 16)]
            head.train()
            entry = run.record(loss=loss.item(), held_out_loss=sum(s[0].item() for s in scores) / len(scores),
                               held_out_top1=sum(s[1] for s in scores) / len(scores))
            run.save(head=head.state_dict(), optimizer=optimizer.state_dict())
            card = {"target": args.target, "step": run.step, "held_out_top1": entry["held_out_top1"]}
            if args.method == "kangaroo":
                card["exit_layer"] = SHALLOW_LAYER
            if args.method == "eagle3":
                card["ttt_steps"] = args.ttt_steps
            copy.deepcopy(head).to(torch.bfloat16).save(out, **card)
        if run.stop_if_out_of_time():
            break
    return 0
