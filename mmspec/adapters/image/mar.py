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

from ...core.continuous import ContinuousOutput, FinalStep, MaskedARState
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
        noise = torch.randn(self.noise_shape, generator=generator, device=generator.device)
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
        cond: MARCondition = state.condition
        seq = state.tokens if extra is None else torch.cat([state.tokens, extra.to(state.tokens)], dim=1)
        positions = state.order[index]
        groups = 1 if cond.uncond_buffer is None else 2
        with torch.inference_mode():
            if self.config.attention == "causal":
                rows = groups
                z = self.model.causal_contexts(seq.expand(rows, -1, -1), state.order[: seq.shape[1]].expand(rows, -1),
                                               positions.expand(rows, -1), prefix, self._buffers(cond, 1))
                return z.reshape(rows * len(index), -1)
            # bidirectional: one context row per distinct prefix (one row when every query shares it)
            shared = bool((prefix == prefix[0]).all())
            prefixes = prefix[:1] if shared else prefix
            rows = prefixes.shape[0]
            grid = seq.new_zeros(rows, state.num_positions, seq.shape[2])
            known = torch.zeros(rows, state.num_positions, dtype=torch.bool, device=seq.device)
            take = torch.arange(seq.shape[1], device=seq.device)[None] < prefixes[:, None]
            order = state.order[: seq.shape[1]]
            grid[:, order] = torch.where(take.unsqueeze(-1), seq.expand(rows, -1, -1), grid[:, order])
            known[:, order] = take
            z = self.model.contexts(grid.repeat(groups, 1, 1), known.repeat(groups, 1), self._buffers(cond, rows))
            row = torch.arange(groups * rows, device=z.device).repeat_interleave(len(index) if shared else 1)
            return z[row, positions.repeat(groups)]

    def sample(self, state: MaskedARState, z: torch.Tensor, index: torch.Tensor) -> FinalStep:
        """Run the head's chains for the tokens at ``order[index]`` with their noise: FinalStep [1, Q]."""
        cond: MARCondition = state.condition
        with torch.inference_mode():
            return sample_chain(self._head(cond.guidance_scale), self.model.schedule, z, state.noise[index], cond.temperature)

    def final_steps(self, state: MaskedARState, extra: torch.Tensor | None, first: int = 0) -> ContinuousOutput:
        """The final steps of positions ``order[n + first .. n + k]`` (n committed, k = extra's length):
        context i knows the committed tokens and ``extra[:, :i]``."""
        k = 0 if extra is None else extra.shape[1]
        n = state.length
        if n + k >= state.num_positions:
            raise ValueError(f"no position left to predict after {n} + {k} tokens of {state.num_positions}")
        index = torch.arange(n + first, n + k + 1, device=state.order.device)
        return ContinuousOutput(self.sample(state, self.conditions(state, extra, index, index), index))

    def parallel_step(self, state: MaskedARState, count: int) -> FinalStep:
        """MAR's own decoding step: the next ``count`` tokens, all conditioned on the committed ones
        (independent given them), in one forward."""
        n = state.length
        index = torch.arange(n, min(n + count, state.num_positions), device=state.order.device)
        return self.sample(state, self.conditions(state, None, index, torch.full_like(index, n)), index)

    # the core's Target interface -------------------------------------------------------------
    def prefill(self, model_inputs: dict[str, Any], hidden_layer: int | None = None) -> tuple[MaskedARState, ContinuousOutput]:
        if hidden_layer is not None:
            raise ValueError("a MAR target gives no hidden states; use a drafter that does not need them")
        for name in ("order", "noise"):
            if name not in model_inputs:
                raise ValueError(f"model_inputs lacks {name!r}; build them with MARTarget.prepare_inputs")
        if tuple(model_inputs["noise"].shape) != self.noise_shape:
            raise ValueError(f"noise must be {self.noise_shape} for this model, got {tuple(model_inputs['noise'].shape)}")
        state = MaskedARState(model_inputs["order"], model_inputs["noise"], self.condition(model_inputs),
                              self.config.token_embed_dim)
        return state, self.final_steps(state, None)

    def forward(self, state: MaskedARState, tokens: torch.Tensor, hidden_layer: int | None = None, tree=None) -> ContinuousOutput:
        """Verification over drafts ``tokens`` [1, K, D]: K + 1 final steps."""
        if tree is not None:
            raise ValueError("continuous drafts are linear; a MAR target verifies no token trees")
        return self.final_steps(state, tokens)

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
