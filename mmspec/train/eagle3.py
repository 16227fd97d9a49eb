"""``mmspec train drafter --method eagle3``: the EAGLE-3 head (:class:`mmspec.modeling.eagle3.Eagle3Head`)
trained with the training-time test (Li et al., 2025).

The loop is :mod:`mmspec.train.drafter`'s, shared with the other heads (``make_head``); this module
holds the loss. Data: the self-distillation records (the target's own answers). For any target
(:func:`mmspec.train.drafter.run_any_target`) the three target states the head fuses are stored
with the records, made by the target's prefill (images included); for the embedded ``smollm2``
recipe, whose cached records keep the last layer only, they are recomputed per batch by a
teacher-forced text forward (:func:`target_states`). The draft vocabulary is the N most frequent
answer tokens of the training records (``drafter.write_draft_vocabulary``).

Training-time test (:func:`eagle3_loss`): the head is unrolled ``ttt_steps`` times over a batch as
it will draft. Step 0 at position t reads (g_t = fc(target states at t), x_{t+1}) and predicts
x_{t+2}; step k reads (its own step-(k-1) output at t, x_{t+k+1}) at position t + k and predicts
x_{t+k+2}, attending to step 0's keys at positions <= t and to its own earlier steps' keys at t
(the diagonal): exactly what a chain drafted after the committed position t sees. Loss
sum_k 0.8^k CE over the draft vocabulary (positions whose token is learnt and inside it).

For drafting under sampling (``--kl-weight w``, the data's answers sampled) the loss adds
w sum_k 0.8^k KL(p_k || q_k) on every learnt position: p_k the target's own distribution of
x_{t+k+2} over the draft vocabulary, softmax(LMHead(h_{t+k+1})) renormalised there, from the
target's last ``hidden_states`` entry h (after its final norm), stored as a fourth block of the
states; q_k the head's step-k distribution. Speculative sampling accepts a draft with probability
sum min(p, q) = 1 - TV(p, q), so the whole distribution, not one sampled token, is the target.

A vision-aware head (:class:`~mmspec.modeling.eagle3.VisionEagle3Head`, ``--vision-tokens K``)
reads the stored states at each row's image tokens through its adaptor: every step's queries also
see the k prefix keys (positions 0..k-1, the pairs at k + t) and every feature gets the global
image feature, as in drafting.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..modeling.eagle3 import Eagle3Head
from ..modeling.heads import VisionContext


def draft_vocabulary(records, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent learnt tokens of ``records`` (most frequent first), padded with
    the lowest unseen ids when the data has fewer distinct tokens -> LongTensor [size]."""
    from ..drafters.vocab import frequent_tokens

    size = min(size or vocab_size, vocab_size)
    ids, _ = frequent_tokens(records, size)
    if len(ids) < size:
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[ids] = True
        ids = torch.cat([ids, torch.nonzero(~seen).flatten()[: size - len(ids)]])
    return ids


def collate_ids(records) -> dict[str, torch.Tensor]:
    """Records {"ids" [L_i], "learn" [L_i]} -> ids [B, L] (0-padded) and learn [B, L] (False on padding)."""
    length = max(len(r["ids"]) for r in records)
    ids = torch.zeros((len(records), length), dtype=torch.long)
    learn = torch.zeros((len(records), length), dtype=torch.bool)
    for row, r in enumerate(records):
        ids[row, : len(r["ids"])], learn[row, : len(r["ids"])] = r["ids"], r["learn"]
    return {"ids": ids, "learn": learn}


@torch.no_grad()
def target_states(model, ids: torch.Tensor, aux_layers: tuple[int, ...]) -> torch.Tensor:
    """Teacher-forced states of a text target: ids [B, L] -> the ``hidden_states`` entries
    ``aux_layers`` concatenated [B, L, 3 H] (fp32)."""
    from ..core.target import select_hidden_states

    out = model(input_ids=ids, output_hidden_states=True)
    return select_hidden_states(out.hidden_states, tuple(aux_layers)).float()


def unroll(head: Eagle3Head, embed: torch.Tensor, ids: torch.Tensor, states: torch.Tensor, steps: int,
           vision: VisionContext | None = None) -> list[torch.Tensor]:
    """The head unrolled ``steps`` times over a batch as it drafts (the training-time test).

    Args:
        head: the head.
        embed: the target's input embedding table [V, H].
        ids: [B, L] token ids; states: the target's fused-layer states [B, L, 3 H].
        steps: K (at most L - 2).
        vision: a :class:`VisionEagle3Head`'s image context (B rows), or None: its k prefix keys
            are visible to every query and its bias is added to every feature.

    Returns:
        K outputs s_k [B, L - 2, H]: s_k[:, t] reads (s_{k-1}[:, t] or fc(states[:, t]) for k = 0,
        x_{t+k+1}) at position t + k, sees step 0's keys at positions <= t and steps 1..k's at t,
        and predicts x_{t+k+2} (through :meth:`Eagle3Head.logits`; valid for t < L - 2 - k).
    """
    n = ids.shape[1] - 2
    features = states[:, :n].to(head.fc.weight.dtype)
    prefix = 0 if vision is None else head.vision_tokens
    positions = torch.arange(prefix, prefix + n, device=ids.device)[None]
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    diagonal = torch.eye(n, dtype=torch.bool, device=ids.device)
    keys, values, outputs = [], [], []
    if vision is not None:  # the image's k prefix positions, seen by every query
        key, value = head.prefix_keys(vision)
        keys.append(key)
        values.append(value)
        causal = torch.cat([causal.new_ones(n, prefix), causal], dim=1)
    bias = None if vision is None else vision.bias
    for k in range(min(steps, n)):
        tokens = ids[:, k + 1 : k + 1 + n]
        if tokens.shape[1] < n:  # (the last steps' final positions have no next token: any id, never scored)
            tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], n - tokens.shape[1])], dim=1)
        q, key, value, residual = head.project(features, embed[tokens], positions + k, bias)
        keys.append(key)
        values.append(value)
        visible = torch.cat([causal] + [diagonal] * k, dim=1)
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, torch.finfo(q.dtype).min)
        features = head.finish(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask, residual)
        outputs.append(features)
    return outputs


def eagle3_loss(head: Eagle3Head, embed: torch.Tensor, batch: dict[str, torch.Tensor], states: torch.Tensor,
                ttt_steps: int = 3, vision: VisionContext | None = None, kl_weight: float = 0.0,
                target_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """The training-time-test loss over a batch (module docstring; :func:`unroll`).

    Args:
        head: the head being trained.
        embed: the target's input embedding table [V, H].
        batch: ``ids`` [B, L] and ``learn`` [B, L] (:func:`collate_ids`).
        states: the target's fused-layer states [B, L, 3 H] (:func:`target_states`), followed with
            ``kl_weight`` > 0 by its last ``hidden_states`` entry [B, L, 3 H + H].
        ttt_steps: unrolled steps K (1: plain teacher forcing).
        vision: a :class:`~mmspec.modeling.eagle3.VisionEagle3Head`'s context of the batch's images
            (:meth:`~mmspec.modeling.eagle3.VisionEagle3Head.vision_context`), or None.
        kl_weight: w of the KL term (module docstring); 0: none.
        target_rows: with ``kl_weight``, the target's LM-head rows of the draft vocabulary [N, H]
            (``lm_head[head.token_ids]``).

    Returns:
        (sum_k 0.8^k (CE_k + w KL_k) over the draft vocabulary, step 0's top-1 accuracy there);
        positions whose token is outside the draft vocabulary get no CE, and a batch with nothing
        scored (a held-out batch of tokens the training data never had) gives a zero loss and accuracy 0.
    """
    ids, learn = batch["ids"], batch["learn"]
    fused = len(head.config.aux_layers) * head.config.target_hidden_size
    if kl_weight and states.shape[-1] != fused + head.config.target_hidden_size:
        raise ValueError(f"kl_weight needs the target's last layer after the {len(head.config.aux_layers)} fused ones: states "
                         f"[..., {fused + head.config.target_hidden_size}], got [..., {states.shape[-1]}]")
    final = states[..., fused:] if kl_weight else None
    to_draft = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
    to_draft[head.token_ids.to(ids.device)] = torch.arange(head.config.draft_vocab_size, device=ids.device)
    total, accuracy = None, 0.0
    for k, s in enumerate(unroll(head, embed, ids, states[..., :fused], ttt_steps, vision)):
        span = s.shape[1] - k  # positions t whose target x_{t+k+2} exists
        target = to_draft[ids[:, k + 2 : k + 2 + span]]
        learnt = learn[:, k + 2 : k + 2 + span]
        use = learnt & (target >= 0)
        scored = learnt if kl_weight else use  # (the KL reads every learnt row; the CE those inside the vocabulary)
        if not scored.any():
            continue
        logits = head.logits(s[:, :span][scored]).float()
        if kl_weight:  # p: the target's distribution of x_{t+k+2}, from h at t + k + 1
            log_p = torch.log_softmax(final[:, k + 1 : k + 1 + span][learnt].float() @ target_rows.T.float(), dim=-1)
            term = 0.8**k * kl_weight * F.kl_div(torch.log_softmax(logits, dim=-1), log_p, log_target=True, reduction="batchmean")
            total = term if total is None else total + term
            logits = logits[(target >= 0)[learnt]]
        if not use.any():
            continue
        term = 0.8**k * F.cross_entropy(logits, target[use])
        total = term if total is None else total + term
        if k == 0:
            accuracy = (logits.argmax(-1) == target[use]).float().mean().item()
    if total is None:  # no learnt token of the batch is in the draft vocabulary: nothing to learn, none drafted right
        return head.lm_head.weight.sum() * 0.0, 0.0
    return total, accuracy
