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
from ...modeling.diffusion import sample_chain
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
    ``temperature`` (tau) and ``guidance_scale`` (classifier-free guidance w >= 1 on the heads'
    eps: eps = eps_u + w (eps_c - eps_u); the variance from the conditional row, as MAR does).
    """

    continuous = True
    vocab_size = None
    input_names = ("labels", "text", "text_mask", "order", "noise", "temperature", "guidance_scale")

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

    def prepare_inputs(self, generator: torch.Generator, order: str = "random", temperature: float = 1.0,
                       guidance_scale: float = 1.0, **condition: Any) -> dict[str, Any]:
        """Draw the generation order and every token's chain noise from ``generator``."""
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for a diffusion head, got {temperature}")
        if guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1, got {guidance_scale}")
        n = self.config.seq_len
        perm = torch.randperm(n, generator=generator, device=generator.device) if order == "random" else torch.arange(n)
        noise = torch.randn(self.noise_shape, generator=generator, device=generator.device)
        return {"order": perm.to(self.device), "noise": noise.to(self.device), "temperature": float(temperature),
                "guidance_scale": float(guidance_scale), **condition}

    def condition(self, model_inputs: dict[str, Any]) -> MARCondition:
        """This model's buffers for ``model_inputs`` (a drafter calls it for its own model)."""
        with torch.inference_mode():
            buffer = self.model.buffer(model_inputs.get("labels"), model_inputs.get("text"), model_inputs.get("text_mask"))
            guidance = float(model_inputs.get("guidance_scale", 1.0))
            uncond = self.model.buffer() if guidance != 1.0 else None
        return MARCondition(buffer, uncond, guidance, float(model_inputs.get("temperature", 1.0)))

    def _head(self, guidance: float):
        net = self.model.diffloss.net
        if guidance == 1.0:
            return net

        def guided(x, t, z):  # z: [2M, W], conditional rows first
            out = net(torch.cat([x, x]), torch.cat([t, t]), z)
            cond, uncond = out.chunk(2)
            dim = x.shape[-1]
            eps = uncond[:, :dim] + guidance * (cond[:, :dim] - uncond[:, :dim])
            return torch.cat([eps, cond[:, dim:]], dim=-1)

        return guided

    def final_steps(self, state: MaskedARState, extra: torch.Tensor | None, first: int = 0) -> ContinuousOutput:
        """The final steps of positions ``order[n + first .. n + k]`` (n committed, k = extra's length):
        context i knows the committed tokens and ``extra[:, :i]``."""
        cond: MARCondition = state.condition
        k = 0 if extra is None else extra.shape[1]
        n = state.length
        if n + k >= state.num_positions:
            raise ValueError(f"no position left to predict after {n} + {k} tokens of {state.num_positions}")
        grid, known = state.canvas(extra, rows=k + 1)
        grid, known = grid[first:], known[first:]
        rows = grid.shape[0]
        buffer = cond.buffer.expand(rows, -1, -1)
        if cond.uncond_buffer is not None:
            grid, known = torch.cat([grid, grid]), torch.cat([known, known])
            buffer = torch.cat([buffer, cond.uncond_buffer.expand(rows, -1, -1)])
        with torch.inference_mode():
            z = self.model.contexts(grid, known, buffer)  # [R(2), N, W]
            index = torch.arange(n + first, n + k + 1, device=z.device)
            positions = state.order[index]
            z = z[torch.arange(z.shape[0], device=z.device), positions.repeat(z.shape[0] // rows)]
            steps = sample_chain(self._head(cond.guidance_scale), self.model.schedule, z, state.noise[index], cond.temperature)
        return ContinuousOutput(steps)

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

    def unpatchify(self, tokens: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Tokens [1, N, D] in generation ``order`` -> latents [1, C, h, w] for the autoencoder."""
        c = self.config
        grid = torch.zeros_like(tokens)
        grid[:, order] = tokens
        p, h = c.patch_size, c.seq_h
        x = grid.view(1, h, h, c.vae_embed_dim, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(1, c.vae_embed_dim, h * p, h * p)
