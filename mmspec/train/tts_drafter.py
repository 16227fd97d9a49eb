"""``mmspec train tts-drafter``: the trained drafters of a codec LM, by self-distillation on the
frozen target: Medusa heads (``--kind medusa``: methods ``medusa`` and ``vadusa`` of the
text-to-speech pipeline) or an EAGLE head (``--kind eagle``: method ``eagle``).

On the speech shards' teacher-forced steps, the target gives its last hidden states f_t and its
distributions p_{t+1} of every next step.

- Medusa head i (0-based) reads f_t and learns the target's own distribution of step t + 2 + i,
  KL(p_{t+2+i} || Heads(f_t + SiLU(W_i f_t + b_i))) per code, the K output heads shared with the
  target (Medusa-2's self-distillation: the heads learn what the target would say, which is what
  their acceptance depends on).
- The EAGLE head reads (E_t, f_{t-1}), E_t the LM's input of step t, and predicts f^_t, trained as
  EAGLE is: SmoothL1(f^_t, f_t) + w KL(p_{t+1} || Heads(f^_t)) per code (the KL in place of
  EAGLE's cross-entropy with the data's tokens: self-distillation, as above; w = ``--kl-weight``,
  EAGLE's 0.1 by default), causally over a whole utterance's steps (positions = step indices, as
  the drafter runs it); ``--ffn`` narrows the head layer's MLP.
- ``--ttt N`` (EAGLE-3's training-time test, Li et al., 2025): the EAGLE head unrolled N times as
  it drafts a chain (:func:`unrolled_eagle`): draft k >= 1 reads the head's own draft k - 1 in
  place of f, so the head learns the inputs its second and later drafts get; loss
  sum_k 0.8^k (SmoothL1 + w KL) of each draft against the target's feature and distribution there.

Data: ``speech-data`` shards (speech teacher-forced through the target), or ``tts-self-data``
shards (the target's own sampled codes: what a drafter reads at decoding). The defaults train for
the pipeline's default voice (``--target valle``, ``models/tts-valle``) on ``runs/tts-self``, the
shards ``mmspec train tts-self-data`` writes with its defaults, into ``models/tts-valle-KIND``.

Resumable: rerun the same command. The target's tts.json gains ``"medusa"`` / ``"eagle"`` so the
pipeline finds the drafter.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import torch

from ..modeling.codec_lm import CodecLM
from ..modeling.heads import DraftHeads, EagleHead
from ..modeling.lean import attention_inputs, layer_output
from ..modeling.mel_codec import MelRVQCodec
from ..pipelines.text_to_speech.components import DEFAULT_VOICE, EMBEDDED_VOICES, voice_directory
from .checkpoint import TrainingRun, add_run_arguments, set_lr, to_device, train_device, warmup_cosine
from .codec import speech_shards
from .tts import collate, encoded_utterances
from .tts_self_data import is_self_data, self_items


#: drafts whose acceptance ``--eval`` reports
EVAL_DRAFTS = 6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_VOICE,
                        help=f"the voice whose codec LM the drafter serves: an embedded one ({', '.join(EMBEDDED_VOICES)}) "
                             "or a TTS model directory")
    parser.add_argument("--data", default="runs/tts-self",
                        help="shards of mmspec train tts-self-data (its defaults write these for the default voice) or "
                             "of mmspec train speech-data")
    parser.add_argument("--codec", default=None, help="codec directory (default: the target's, from its tts.json)")
    parser.add_argument("--kind", choices=("medusa", "eagle"), default="medusa")
    parser.add_argument("--out", default=None,
                        help="default: the target's directory with -KIND appended (models/tts-valle-medusa for the "
                             "default voice and --kind medusa)")
    parser.add_argument("--heads", type=int, default=None,
                        help="Medusa: heads (steps drafted beyond the target's own; default 3)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--kl-weight", type=float, default=None,
                        help="EAGLE: weight of the KL term against the feature regression (default EAGLE's 0.1; more "
                             "weight fits the head's distributions, which acceptance at temperature 1 depends on)")
    parser.add_argument("--ffn", type=int, default=None,
                        help="EAGLE: the head layer's MLP width (default: the target's); narrower reads fewer bytes a draft")
    parser.add_argument("--ttt", type=int, default=None,
                        help="EAGLE: drafts unrolled in training (EAGLE-3's training-time test; default 1: teacher forcing only)")
    parser.add_argument("--init", default=None, help="EAGLE: start from this head directory's weights (a new run)")
    parser.add_argument("--eval", default=None,
                        help="EAGLE: held-out tts-self-data shards (--split validation): the head's acceptance per draft "
                             "is printed before and after training")
    add_run_arguments(parser, threads=2, save_every=100)


@torch.no_grad()
def teacher_forced(target: CodecLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The frozen target on a collated batch: logits [B, S, K, C + 1] (row t: step t + 1), last
    hidden states [B, S, D] (row t: f_t) and the logits' log-probabilities in fp32."""
    inputs = {name: batch[name] for name in ("phonemes", "text_mask", "steps", "step_mask", "alignment") if name in batch}
    logits, hidden = target.step_logits(**inputs, return_hidden=True)
    return logits, hidden, logits.float().log_softmax(-1)


def heads_loss(heads: DraftHeads, target: CodecLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over heads and predicted codes of KL(target's step t + 2 + i || head i at t)."""
    logits, hidden, reference = teacher_forced(target, batch)
    valid = batch["targets"] != -100  # [B, S, K]
    shape = logits.shape
    losses = []
    for i in range(heads.num_heads):
        shift = i + 1
        if shape[1] <= shift:
            break
        guess = target.heads(heads.head_state(i, hidden[:, :-shift])).view(shape[0], shape[1] - shift, *shape[2:])
        teacher = reference[:, shift:]
        kl = (teacher.exp() * (teacher - guess.float().log_softmax(-1))).sum(-1)
        mask = valid[:, shift:]
        losses.append((kl * mask).sum() / mask.sum().clamp_min(1))
    return torch.stack(losses).mean()


def unrolled_eagle(head: EagleHead, hidden: torch.Tensor, embeds: torch.Tensor, drafts: int) -> list[torch.Tensor]:
    """The EAGLE head unrolled ``drafts`` times over a sequence, as it drafts a chain.

    Args:
        head: the head (one Llama-family decoder layer and its norm, :class:`EagleHead`).
        hidden: the target's last hidden states f [B, S, H] (row t: f_t).
        embeds: the target's step inputs E [B, S, H] (row t: E_t).
        drafts: N >= 1.

    Returns:
        N outputs s_k [B, S - 1, H]. s_0[:, t] = Head(E_{t+1}, f_t) at position t + 1 (teacher
        forcing: the first draft after a committed step t); s_k[:, t] = Head(E_{t+k+1}, s_{k-1}[:, t])
        at position t + k + 1, attending to draft 0's keys at rows <= t and to drafts 1..k's at row t
        alone: what the head's k-th draft after step t sees in the drafter. s_k[:, t] predicts
        f_{t+k+1}; rows t > S - 2 - k have no step to read (zero inputs, never scored).
    """
    batch, steps, width = hidden.shape
    n = steps - 1
    decoder = head.decoder
    layer, attn = decoder.layers[0], decoder.layers[0].self_attn
    heads, kv_heads = decoder.config.num_attention_heads, decoder.config.num_key_value_heads
    head_dim = getattr(decoder.config, "head_dim", None) or width // heads
    causal = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
    features, keys, values, outputs = hidden[:, :n], [], [], []
    for k in range(drafts):
        step_inputs = embeds[:, k + 1 : k + 1 + n]
        if step_inputs.shape[1] < n:
            step_inputs = torch.cat([step_inputs, step_inputs.new_zeros(batch, n - step_inputs.shape[1], width)], dim=1)
        x = head.fc(torch.cat([step_inputs, features], dim=-1))
        positions = torch.arange(k + 1, k + 1 + n, device=hidden.device)[None]
        cos, sin = (t[:, None] for t in decoder.rotary_emb(x, positions))
        q, key, value = attention_inputs(layer, x, cos, sin, heads, kv_heads, head_dim)
        keys.append(key.repeat_interleave(heads // kv_heads, dim=1))
        values.append(value.repeat_interleave(heads // kv_heads, dim=1))
        scores = (q @ keys[0].transpose(-1, -2) * attn.scaling).masked_fill(~causal, float("-inf"))
        diagonal = [(q * kj).sum(-1, keepdim=True) * attn.scaling for kj in keys[1:]]  # [B, heads, n, 1] each
        weights = torch.cat([scores, *diagonal], dim=-1).softmax(-1)
        o = weights[..., :n] @ values[0]
        for j, vj in enumerate(values[1:]):
            o = o + weights[..., n + j : n + j + 1] * vj
        x = layer_output(layer, x, o.transpose(1, 2).reshape(batch, n, heads * head_dim))
        features = decoder.norm(x)
        outputs.append(features)
    return outputs


def scored_drafts(head: EagleHead, target: CodecLM, batch: dict[str, torch.Tensor], drafts: int):
    """The head's drafts over a collated batch, each beside what it is scored against.

    Yields, for draft k = 0 .. N - 1 (:func:`unrolled_eagle`; N = 1: the head's own forward, the
    lean path it drafts with), over its rows t = 0 .. S - 2 - k: (s_k [B, S-1-k, H], the target's
    f_{t+k+1} there, the head's log-probabilities log q [B, S-1-k, K, C+1] and the target's log p of
    the same step, real steps [B, S-1-k] and codes with a target [B, S-1-k, K] (bool masks)).
    """
    logits, hidden, reference = teacher_forced(target, batch)
    with torch.no_grad():
        embeds = target.step_embeddings(batch["steps"], batch.get("alignment"))  # E_t
    steps = hidden.shape[1]
    if drafts == 1:
        outputs = [head(hidden[:, :-1], embeds[:, 1:], None, torch.arange(1, steps, device=hidden.device)[None])]
    else:
        outputs = unrolled_eagle(head, hidden, embeds, min(drafts, steps - 1))
    for k, predicted in enumerate(outputs):
        predicted = predicted[:, : steps - 1 - k]  # rows whose f_{t+k+1} exists
        log_q = target.heads(predicted).view(*logits[:, k + 1 :].shape).float().log_softmax(-1)
        real = batch["step_mask"][:, k + 1 :].bool()
        valid = (batch["targets"][:, k + 1 :] != -100) & real[..., None]
        yield predicted, hidden[:, k + 1 :], log_q, reference[:, k + 1 :], real, valid


def eagle_loss(head: EagleHead, target: CodecLM, batch: dict[str, torch.Tensor], kl_weight: float = 0.1,
               drafts: int = 1) -> torch.Tensor:
    """sum_k 0.8^k [SmoothL1(s_k, f) + w KL(p || Heads(s_k))] over the drafts s_k of
    :func:`unrolled_eagle` (k = 0: f^_t = Head(E_t, f_{t-1}) against f_t and p_{t+1}, EAGLE's
    loss; draft k at row t against f_{t+k+1} and p_{t+k+2}); w = ``kl_weight`` (EAGLE's 0.1);
    padded steps and codes without a target excluded."""
    total = None
    for k, (predicted, feature, log_q, log_p, real, valid) in enumerate(scored_drafts(head, target, batch, drafts)):
        regression = torch.nn.functional.smooth_l1_loss(predicted[real], feature[real])
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        term = 0.8**k * (regression + kl_weight * (kl * valid).sum() / valid.sum().clamp_min(1))
        total = term if total is None else total + term
    return total


@torch.no_grad()
def eagle_acceptance(head: EagleHead, target: CodecLM, items: list[dict], drafts: int, batch_size: int = 16) -> list[float]:
    """The head's acceptance per draft at temperature 1 on ``items`` (held out): draft k's mean over
    steps of sum_x min(p(x), q_k(x)), p the target's distribution of the step drafted and q_k the
    head's (:func:`scored_drafts`, the target's own codes as the tokens read): the chance that
    speculative sampling keeps draft k given the drafts before it were kept. Returns [drafts] floats."""
    sums, counts = [0.0] * drafts, [0] * drafts
    for first in range(0, len(items), batch_size):
        batch = to_device(collate(items[first : first + batch_size], target.config), next(target.parameters()).device)
        for k, (_, _, log_q, log_p, _, valid) in enumerate(scored_drafts(head, target, batch, drafts)):
            overlap = torch.minimum(log_p.exp(), log_q.exp()).sum(-1)  # [B, S - 1 - k, K]
            sums[k] += float(overlap[valid].sum())
            counts[k] += int(valid.sum())
    return [s / c if c else 0.0 for s, c in zip(sums, counts)]


def drafter_paths(target: str | None, out: str | None, kind: str) -> tuple[Path, Path]:
    """``--target`` (an embedded voice's name or a directory; None: the default voice) and
    ``--out`` (None: the target's directory with ``-KIND`` appended) -> (target dir, out dir)."""
    target_dir = voice_directory(target)
    return target_dir, Path(out) if out else target_dir.with_name(f"{target_dir.name}-{kind}")


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    device = train_device(args)
    target_dir, out = drafter_paths(args.target, args.out, args.kind)
    # --heads, --ffn and --kl-weight: mmspec.cli.args's shared number rules
    if args.ttt is not None and args.ttt < 1:
        raise ValueError(f"--ttt must be at least 1 (drafts unrolled in training), got {args.ttt}")
    if args.kind != "eagle" and (args.ttt is not None or args.init is not None):
        raise ValueError("--ttt and --init train an EAGLE head: add --kind eagle")
    # the other kind's options, given (their defaults are None: given at the default value too):
    # refused rather than silently ignored
    eagle_only = [f"--{name.replace('_', '-')}" for name in ("kl_weight", "ffn") if getattr(args, name) is not None]
    if args.kind != "eagle" and eagle_only:
        raise ValueError(f"{', '.join(eagle_only)} {'sets' if len(eagle_only) == 1 else 'set'} an EAGLE head: add --kind "
                         "eagle, or leave it out for Medusa heads")
    if args.kind == "eagle" and args.heads is not None:
        raise ValueError("--heads sets the number of Medusa heads; an EAGLE head drafts with one head: drop --heads "
                         "or use --kind medusa")
    if args.kind == "eagle":  # (the defaults, resolved: training.json records the values trained with)
        args.kl_weight = 0.1 if args.kl_weight is None else args.kl_weight
        args.ttt = 1 if args.ttt is None else args.ttt
    else:
        args.heads = 3 if args.heads is None else args.heads
    if args.eval is not None and args.kind != "eagle":
        raise ValueError("--eval measures an EAGLE head's acceptance: add --kind eagle")
    if args.eval is not None and not is_self_data(args.eval):
        raise ValueError(f"--eval {args.eval}: no tts-self-data shards there; make them with mmspec train tts-self-data "
                         f"--split validation --out {args.eval}")
    if args.init is not None and args.ffn is not None:
        raise ValueError("--init takes the head's MLP width from the head it starts from: leave out --ffn")
    if args.init is not None and not (Path(args.init) / EagleHead.config_file).is_file():
        raise ValueError(f"--init {args.init}: no EAGLE head there ({EagleHead.config_file} missing)")
    if not is_self_data(args.data):
        try:
            speech_shards(args.data, "train")
        except ValueError:  # (its line names speech-data alone)
            raise ValueError(f"--data {args.data}: no shards there; make them with mmspec train tts-self-data --out "
                             f"{args.data} (the voice's own codes) or mmspec train speech-data --out {args.data} "
                             "(Piper's speech)") from None
    target = CodecLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    manifest_path = target_dir / "tts.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if is_self_data(args.data):
        items = self_items(args.data)
    else:
        codec_dir = Path(args.codec) if args.codec else target_dir / manifest.get("codec", "../tts-codec")
        items = encoded_utterances(args.data, codec_dir, MelRVQCodec.from_pretrained(codec_dir), "train")
    if args.kind == "eagle":
        heads = EagleHead.load(args.init, target.backbone).float() if args.init else EagleHead(target.backbone.config, args.ffn)
        loss_of = functools.partial(eagle_loss, kl_weight=args.kl_weight, drafts=args.ttt)
        what = "an EAGLE head" + (f" (from {args.init})" if args.init else "") + (f", {args.ttt} drafts unrolled" if args.ttt > 1 else "")
    else:
        heads, loss_of = DraftHeads(target.config.dim, args.heads, "medusa"), heads_loss
        what = f"{args.heads} Medusa heads"
    print(f"{what} on {target_dir} ({sum(p.numel() for p in heads.parameters()) / 1e6:.2f}M "
          f"parameters), {len(items)} utterances", flush=True)
    heads.to(device)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    run_state = TrainingRun(out, args, args.time_limit)
    run_state.resume_into(heads=heads, optimizer=optimizer)
    held_out = self_items(args.eval) if args.eval else None

    def evaluate(when: str) -> None:
        heads.eval()
        acceptance = eagle_acceptance(heads, target, held_out, EVAL_DRAFTS)
        heads.train()
        run_state.record(**{f"acceptance_{when}": [round(a, 4) for a in acceptance]})

    if held_out is not None:
        evaluate("before")
    generator = torch.Generator().manual_seed(run_state.step)
    while run_state.step < args.steps:
        lr = warmup_cosine(run_state.step, args.steps, args.lr, args.warmup, floor=0.1)
        set_lr(optimizer, lr)
        rows = torch.randint(len(items), (args.batch_size,), generator=generator).tolist()
        loss = loss_of(heads, target, to_device(collate([items[r] for r in rows], target.config), device))
        run_state.optimizer_step(loss, optimizer, heads.parameters())
        if run_state.step % 20 == 0 or run_state.step == args.steps:
            run_state.record(loss=loss.item(), lr=lr)
        if run_state.should_save(args.save_every, args.steps):
            heads.save(out, target=os.path.relpath(target_dir.resolve(), out.resolve()))
            run_state.save(heads=heads.state_dict(), optimizer=optimizer.state_dict())
        if run_state.stop_if_out_of_time():
            break
    if held_out is not None:  # (the heads were saved at the last step; the log gains the acceptance)
        evaluate("after")
        run_state.save(heads=heads.state_dict(), optimizer=optimizer.state_dict())
    if manifest_path.is_file():
        manifest[args.kind] = os.path.relpath(out.resolve(), target_dir.resolve())
        manifest_path.write_text(json.dumps(manifest, indent=1))
    return 0
