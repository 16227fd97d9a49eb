"""MAR-style continuous-token generators as targets of the core's loop (:class:`MARTarget`).

A step's K drafts are verified exactly: the target's conditional for draft i must know drafts
1..i-1, and MAR's transformer is bidirectional, so the forward reads K + 1 contexts (the committed
tokens plus the first i drafts, i = 0..K) as K + 1 rows of one batched forward, then runs its
diffusion head on the K + 1 positions with the noise the drafter used (trajectory alignment).
(The released CSpD code reads one context, the committed tokens only, for the whole window: the
target it then preserves is MAR's K-tokens-per-step parallel decoding, not one token per step.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...core.continuous import ContinuousOutput, FinalStep, MaskedARBatch, MaskedARState
from ...modeling.diffusion import GuidedHead, sample_chain
from ...modeling.mar import MARModel

ORDERS = ("random", "raster")


@dataclass
class MARCondition:
    """What a MAR target conditions on during one generation: the buffer of the conditional row
    [1, B, E], that of the unconditional row (None without guidance), the guidance scale and the
    temperature of the diffusion chain."""

    buffer: torch.Tensor
    uncond_buffer: torch.Tensor | None
    guidance_scale: float
    temperature: float


class MARTarget:
    """A :class:`~mmspec.modeling.mar.MARModel` behind the core's target interface (continuous).

    ``model_inputs`` (:meth:`prepare_inputs` builds them): ``labels`` LongTensor [1] or ``text``
    [1, L, text_dim] (+ ``text_mask`` [1, L]), ``order`` LongTensor [N], ``noise`` [N, S + 1, D],
    ``chain_temperature`` (tau, scaling every reverse step's std) and ``guidance_scale`` (classifier-free guidance w >= 1 on the heads'
    eps: eps = eps_u + w (eps_c - eps_u); the variance from the conditional row, as MAR does).
    """

    continuous = True
    vocab_size = None
    input_names = ("labels", "text", "text_mask", "order", "noise", "chain_temperature", "guidance_scale")

    def __init__(self, model: MARModel) -> None:
        self.model = model.eval()
        self.config = model.config

    @property
    def device(self) -> torch.device:
        return self.model.fake_latent.device

    @property
    def noise_shape(self) -> tuple[int, int, int]:
        """[N, S + 1, D] of one generation's noise."""
        return (self.config.seq_len, self.model.schedule.sampling_steps + 1, self.config.token_embed_dim)

    @property
    def num_image_tokens(self) -> int:
        return self.config.seq_len

    @property
    def grid(self) -> tuple[int, int]:
        return (self.config.seq_h, self.config.seq_h)

    def prepare_inputs(self, generator: torch.Generator, order: str = "random", chain_temperature: float = 1.0,
                       guidance_scale: float = 1.0, **condition: Any) -> dict[str, Any]:
        """Draw the generation order and every token's chain noise from ``generator``."""
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if not chain_temperature > 0:
            raise ValueError(f"temperature must be > 0 for a diffusion head, got {chain_temperature}")
        if guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1, got {guidance_scale}")
        n = self.config.seq_len
        perm = torch.randperm(n, generator=generator, device=generator.device) if order == "random" else torch.arange(n)
        noise = torch.randn(self.noise_shape, dtype=torch.float32, generator=generator, device=generator.device)
        return {"order": perm.to(self.device), "noise": noise.to(self.device), "chain_temperature": float(chain_temperature),
                "guidance_scale": float(guidance_scale), **condition}

    def condition(self, model_inputs: dict[str, Any]) -> MARCondition:
        """This model's buffers for ``model_inputs`` (a drafter calls it for its own model)."""
        with torch.inference_mode():
            buffer = self.model.buffer(model_inputs.get("labels"), model_inputs.get("text"), model_inputs.get("text_mask"))
            guidance = float(model_inputs.get("guidance_scale", 1.0))
            uncond = self.model.buffer() if guidance != 1.0 else None
        return MARCondition(buffer, uncond, guidance, float(model_inputs.get("chain_temperature", 1.0)))

    def _head(self, guidance: float):
        net = self.model.diffloss.net
        return net if guidance == 1.0 else GuidedHead(net, guidance)

    def _buffers(self, cond: MARCondition, rows: int) -> torch.Tensor:
        buffer = cond.buffer.expand(rows, -1, -1)
        if cond.uncond_buffer is None:
            return buffer
        return torch.cat([buffer, cond.uncond_buffer.expand(rows, -1, -1)])

    def conditions(self, state: MaskedARState, extra: torch.Tensor | None, index: torch.Tensor,
                   prefix: torch.Tensor) -> torch.Tensor:
        """The diffusion conditions z [G * Q, W] (G = 2 with guidance, conditional rows first) of the
        tokens at ``order[index]`` (LongTensor [Q]), query j conditioned on the first ``prefix[j]``
        tokens of (committed tokens, then ``extra`` [1, k, D])."""
        return self.conditions_rows([state], [extra], [index], [prefix])

    def conditions_rows(self, states: list[MaskedARState], extras: list[torch.Tensor | None],
                        indexes: list[torch.Tensor], prefixes: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`conditions` of several sequences in one transformer forward: z [G * M, W], M = the
        sequences' queries in order (all conditional rows, then all unconditional ones, as
        :class:`~mmspec.modeling.diffusion.GuidedHead` takes them)."""
        conds: list[MARCondition] = [s.condition for s in states]
        groups = 1 if conds[0].uncond_buffer is None else 2
        seqs = [s.tokens if e is None else torch.cat([s.tokens, e.to(s.tokens)], dim=1) for s, e in zip(states, extras)]
        buffers = torch.cat([c.buffer for c in conds] + [c.uncond_buffer for c in conds if groups == 2])
        with torch.inference_mode():
            if self.config.attention == "causal":
                # one row per sequence, padded to the longest (pad tokens come after every prefix; pad queries are dropped)
                b, m, q = len(states), max(x.shape[1] for x in seqs), max(len(i) for i in indexes)
                tokens = seqs[0].new_zeros(b, m, seqs[0].shape[2])
                order = torch.zeros(b, m, dtype=torch.long, device=tokens.device)
                queries = torch.zeros(b, q, dtype=torch.long, device=tokens.device)
                prefix = torch.zeros(b, q, dtype=torch.long, device=tokens.device)
                for r, (state, seq, index, pre) in enumerate(zip(states, seqs, indexes, prefixes)):
                    tokens[r, : seq.shape[1]] = seq[0]
                    order[r, : seq.shape[1]] = state.order[: seq.shape[1]]
                    queries[r, : len(index)] = state.order[index]
                    prefix[r, : len(index)] = pre
                z = self.model.causal_contexts(tokens.repeat(groups, 1, 1), order.repeat(groups, 1),
                                               queries.repeat(groups, 1), prefix.repeat(groups, 1), buffers)
                real = (torch.arange(q, device=z.device)[None, :] < torch.tensor([len(i) for i in indexes], device=z.device)[:, None])
                return z[real.repeat(groups, 1)]
            # bidirectional: one context row per distinct prefix of each sequence (one row when its queries share it)
            grids, knowns, rows_of, where = [], [], [], []
            for state, seq, index, pre in zip(states, seqs, indexes, prefixes):
                shared = bool((pre == pre[0]).all())
                contexts = pre[:1] if shared else pre
                grid = seq.new_zeros(len(contexts), state.num_positions, seq.shape[2])
                known = torch.zeros(len(contexts), state.num_positions, dtype=torch.bool, device=seq.device)
                take = torch.arange(seq.shape[1], device=seq.device)[None] < contexts[:, None]
                order = state.order[: seq.shape[1]]
                grid[:, order] = torch.where(take.unsqueeze(-1), seq.expand(len(contexts), -1, -1), grid[:, order])
                known[:, order] = take
                first = sum(g.shape[0] for g in grids)
                rows_of.append(first + (torch.zeros_like(index) if shared else torch.arange(len(index), device=index.device)))
                where.append(state.order[index])
                grids.append(grid)
                knowns.append(known)
            grid, known = torch.cat(grids), torch.cat(knowns)
            contexts = grid.shape[0]
            context_buffers = torch.cat([conds[i].buffer.expand(g.shape[0], -1, -1) for i, g in enumerate(grids)]
                                        + [conds[i].uncond_buffer.expand(g.shape[0], -1, -1) for i, g in enumerate(grids) if groups == 2])
            z = self.model.contexts(grid.repeat(groups, 1, 1), known.repeat(groups, 1), context_buffers)
            row, position = torch.cat(rows_of).to(z.device), torch.cat(where).to(z.device)
            return torch.cat([z[row + g * contexts, position] for g in range(groups)])

    def sample(self, state: MaskedARState, z: torch.Tensor, index: torch.Tensor) -> FinalStep:
        """Run the head's chains for the tokens at ``order[index]`` with their noise: FinalStep [1, Q]."""
        return self.sample_rows([state], z, [index])

    def sample_rows(self, states: list[MaskedARState], z: torch.Tensor, indexes: list[torch.Tensor]) -> FinalStep:
        """:meth:`sample` of several sequences' queries (z from :meth:`conditions_rows`) in one batch of
        chains, each token with its own sequence's noise: FinalStep [1, M]. The sequences share the
        guidance scale and the chain's temperature (one head)."""
        cond: MARCondition = states[0].condition
        if any((s.condition.guidance_scale, s.condition.temperature) != (cond.guidance_scale, cond.temperature) for s in states):
            raise ValueError("the rows of a batch must share the guidance scale and the temperature (one diffusion head)")
        noise = torch.cat([s.noise[i] for s, i in zip(states, indexes)])
        with torch.inference_mode():
            return sample_chain(self._head(cond.guidance_scale), self.model.schedule, z, noise, cond.temperature)

    def final_steps(self, state: MaskedARState, extra: torch.Tensor | None, first: int = 0) -> ContinuousOutput:
        """The final steps of positions ``order[n + first .. n + k]`` (n committed, k = extra's length):
        context i knows the committed tokens and ``extra[:, :i]``."""
        return ContinuousOutput(self._final_steps_rows([state], [extra], [first])[0])

    def _final_steps_rows(self, states: list[MaskedARState], extras: list[torch.Tensor | None],
                          firsts: list[int]) -> list[FinalStep]:
        """:meth:`final_steps` of several sequences (``extras[b]`` None or [1, k_b, D]) in one
        transformer forward and one batch of chains: FinalStep [1, k_b + 1 - first_b] each."""
        indexes = []
        for state, extra, first in zip(states, extras, firsts):
            n, k = state.length, 0 if extra is None else extra.shape[1]
            if n + k >= state.num_positions:
                raise ValueError(f"no position left to predict after {n} + {k} tokens of {state.num_positions}")
            indexes.append(torch.arange(n + first, n + k + 1, device=state.order.device))
        steps = self.sample_rows(states, self.conditions_rows(states, extras, indexes, indexes), indexes)
        return _split(steps, [len(i) for i in indexes])

    def parallel_step(self, state: MaskedARState, count: int) -> FinalStep:
        """MAR's own decoding step: the next ``count`` tokens, all conditioned on the committed ones
        (independent given them), in one forward."""
        return self.parallel_step_rows([state], [count])[0]

    def parallel_step_rows(self, states: list[MaskedARState], counts: list[int]) -> list[FinalStep]:
        """:meth:`parallel_step` of several sequences in one forward and one batch of chains."""
        indexes = [torch.arange(s.length, min(s.length + c, s.num_positions), device=s.order.device)
                   for s, c in zip(states, counts)]
        steps = self.sample_rows(states, self.conditions_rows(states, [None] * len(states), indexes,
                                                              [torch.full_like(i, s.length) for s, i in zip(states, indexes)]), indexes)
        return _split(steps, [len(i) for i in indexes])

    # the core's Target interface -------------------------------------------------------------
    def _state(self, model_inputs: dict[str, Any], hidden_layer: int | None) -> MaskedARState:
        if hidden_layer is not None:
            raise ValueError("a MAR target gives no hidden states; use a drafter that does not need them")
        for name in ("order", "noise"):
            if name not in model_inputs:
                raise ValueError(f"model_inputs lacks {name!r}; build them with MARTarget.prepare_inputs")
        if tuple(model_inputs["noise"].shape) != self.noise_shape:
            raise ValueError(f"noise must be {self.noise_shape} for this model, got {tuple(model_inputs['noise'].shape)}")
        return MaskedARState(model_inputs["order"], model_inputs["noise"], self.condition(model_inputs),
                             self.config.token_embed_dim)

    def prefill(self, model_inputs: dict[str, Any], hidden_layer: int | None = None) -> tuple[MaskedARState, ContinuousOutput]:
        state = self._state(model_inputs, hidden_layer)
        return state, self.final_steps(state, None)

    def forward(self, state: MaskedARState, tokens: torch.Tensor, hidden_layer: int | None = None, tree=None) -> ContinuousOutput:
        """Verification over drafts ``tokens`` [1, K, D]: K + 1 final steps."""
        if tree is not None:
            raise ValueError("continuous drafts are linear; a MAR target verifies no token trees")
        return self.final_steps(state, tokens)

    # batches (mmspec.core.batch) ----------------------------------------------------------------
    def prefill_rows(self, rows: list[dict[str, Any]], hidden_layer: int | None = None) -> tuple[MaskedARBatch, list[ContinuousOutput]]:
        """B generations' first tokens in one forward: the batch and each row's output ([1, 1])."""
        states = [self._state(inputs, hidden_layer) for inputs in rows]
        batch = MaskedARBatch(states)
        out = self.forward_rows(batch, [s.tokens for s in states])
        return batch, [out.row(b, 1) for b in range(len(states))]

    def forward_rows(self, state: MaskedARBatch, tokens: list[torch.Tensor], hidden_layer: int | None = None) -> ContinuousOutput:
        """Verify each row's drafts ``tokens[b]`` [1, k_b, D] (:meth:`MaskedARBatch.verification_inputs`)
        in one transformer forward and one batch of chains: final steps [B, max k_b + 1] (row b's
        first k_b + 1 are :meth:`forward`'s; the rest repeat its last)."""
        if hidden_layer is not None:
            raise ValueError("a MAR target gives no hidden states; use a drafter that does not need them")
        steps = self._final_steps_rows(state.rows, [d if d.shape[1] else None for d in tokens], [0] * state.size)
        width = max(s.length for s in steps)
        return ContinuousOutput(FinalStep.cat([FinalStep.cat([s] + [s[:, -1:]] * (width - s.length)) for s in steps], dim=0))

    def unpatchify(self, tokens: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [B, N, D] (raster order; in generation ``order`` when given) -> latents
        [B, C, h, w] for the autoencoder (MAR's unpatchify)."""
        c = self.config
        if order is not None:
            raster = torch.zeros_like(tokens)
            raster[:, order] = tokens
            tokens = raster
        p, h = c.patch_size, c.seq_h
        x = tokens.reshape(tokens.shape[0], h, h, c.vae_embed_dim, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(tokens.shape[0], c.vae_embed_dim, h * p, h * p)


def _split(steps: FinalStep, sizes: list[int]) -> list[FinalStep]:
    """FinalStep [1, sum sizes] -> one FinalStep [1, size] per size, in order."""
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return [steps[:, a:b] for a, b in zip(bounds, bounds[1:])]
