"""The non-autoregressive stage of a VALL-E-style voice: codebooks 1 .. K-1 from codebook 0.

VALL-E splits a residual codec's K codebooks between two models: an autoregressive LM over
codebook 0 alone (the stream that carries what is said and when; here a
:class:`~mmspec.modeling.codec_lm.CodecLM` with ``num_codebooks=1``) and a non-autoregressive model
that fills in the finer codebooks given the whole of codebook 0. Speculative decoding then verifies
one code per position of a single stream, the layout where a drafted position is one code rather
than a frame of K codes (docs/speech.md says why the delay layout defeats it).

VALL-E's NAR stage makes one pass per codebook (codebook k from codebooks < k). This one runs its
encoder once, as the last iteration of SoundStorm does, because its cost is paid by every method
alike and would otherwise rival the AR stage on a CPU:

    h = Encoder(E_0(x_0) + A + P)                                        [F, D]

with a bidirectional transformer encoder over the frames (E_0: codebook-0 embeddings, A: the
frame's :func:`~mmspec.modeling.codec_lm.frame_alignment` embeddings, P: learned positions). Its
heads then read each frame's state either all at once (``depth_layers=0``):

    p(x_{1..K-1, f} | x_0, text) = prod_k Cat(x_{k, f}; softmax(W_k h_f))

or, with a depth head (``depth_layers=N``), one codebook after another within the frame, as the
residual quantizer built them, so that codebook k knows which codes 1 .. k-1 took (the argmax
codes then fit together; on the embedded voice the cross-entropy fell from 4.10 to 3.79 nats a
code, and Piper's codebook 0 through the stage read at 7.3 % WER instead of 10.1 %):

    z_{k, f} = h_f + c_k + sum_{1 <= j < k} E_j(x_{j, f}),   z <- z + MLP_n(LN(z))  (n = 1 .. N)
    p(x_{1..K-1, f} | x_0, text) = prod_k Cat(x_{k, f}; softmax(W_k z_{k, f}))

(c_k: a learned codebook embedding; the N blocks are shared by the codebooks). Training is teacher
forced (all k at once); generation walks k = 1 .. K-1 over all frames together: K-1 small steps
after the one encoder pass. ``c``, ``E_j`` and each block's last layer start at zero, so a depth
head added to a trained one-pass stage starts as that stage.

Generation takes each code's argmax (VALL-E's NAR decodes greedily too), so the stage is a
deterministic function of codebook 0 and the alignment: every method of the AR stage gets the
same fine codebooks for the same codebook 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.verify import exact_argmax
from .codec_lm import AlignmentInputs, frame_alignment
from .fast_linear import PreparedWeights
from .fused import int8_fits, int8_linear, int8_path
from .persistence import DataclassModel


@dataclass
class CodecNARConfig:
    text_vocab: int = 256
    num_codebooks: int = 8  # all of the codec's, codebook 0 included (the input)
    codebook_size: int = 256
    dim: int = 256
    layers: int = 4
    heads: int = 4
    ffn: int = 768
    max_positions: int = 1024
    depth_layers: int = 0  # 0: codebooks 1.. at once; N: one after another through N shared residual MLP blocks
    depth_ffn: int = 512


class CodecNAR(DataclassModel, AlignmentInputs, nn.Module):
    """forward(codes0 [B, F], alignment [B, F, 4], mask [B, F] or None, fine [B, F, K - 1] or None)
    -> logits [B, F, K - 1, C] of codebooks 1 .. K-1 (a depth head reads ``fine``, the codes of
    codebooks 1 .. K-1, teacher forced, or without it its own argmax codes); :meth:`complete`
    fills in one utterance."""

    config_class = CodecNARConfig
    config_file = "codec_nar.json"
    weights_file = "codec_nar.safetensors"
    kind = "codec NAR stage"
    save_dtype = torch.bfloat16
    load_dtype = torch.float32

    def __init__(self, config: CodecNARConfig) -> None:
        super().__init__(config)
        if config.num_codebooks < 2:
            raise ValueError("a NAR stage needs a codec of at least 2 codebooks")
        self.code_embeddings = nn.Embedding(config.codebook_size, config.dim)
        self.positions = nn.Embedding(config.max_positions, config.dim)
        self.add_alignment_inputs(config.text_vocab, config.dim)
        layer = nn.TransformerEncoderLayer(config.dim, config.heads, config.ffn, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.layers, norm=nn.LayerNorm(config.dim), enable_nested_tensor=False)
        self.heads = nn.Linear(config.dim, (config.num_codebooks - 1) * config.codebook_size, bias=False)
        self._weights = PreparedWeights()  # (inference on a CPU: :meth:`_linear`)
        self._int8: str | None = None  # read_as_int8's kernel path
        if config.depth_layers:
            fine = config.num_codebooks - 1
            self.codebook_inputs = nn.Embedding(fine, config.dim)  # c_k
            self.fine_embeddings = nn.Embedding(max(1, fine - 1) * config.codebook_size, config.dim)  # E_1 .. E_{K-2}
            self.depth_blocks = nn.ModuleList(
                nn.Sequential(nn.LayerNorm(config.dim), nn.Linear(config.dim, config.depth_ffn), nn.GELU(),
                              nn.Linear(config.depth_ffn, config.dim))
                for _ in range(config.depth_layers))
            with torch.no_grad():
                for zeroed in (self.codebook_inputs.weight, self.fine_embeddings.weight,
                               *(p for block in self.depth_blocks for p in block[-1].parameters())):
                    zeroed.zero_()

    def forward(self, codes0: torch.Tensor, alignment: torch.Tensor, mask: torch.Tensor | None = None,
                fine: torch.Tensor | None = None) -> torch.Tensor:
        frames = codes0.shape[1]
        if frames > self.config.max_positions:
            raise ValueError(f"{frames} frames exceed the NAR stage's {self.config.max_positions} positions")
        x = (self.code_embeddings(codes0) + self.positions(torch.arange(frames, device=codes0.device))
             + self.embed_alignment(alignment))
        if self._inference(x):
            hidden = self._encode(x, mask)
        else:
            hidden = self.encoder(x, src_key_padding_mask=None if mask is None else ~mask.bool())
        c = self.config
        if not c.depth_layers:
            logits = self._linear("heads", hidden, self.heads.weight) if self._inference(hidden) else self.heads(hidden)
            return logits.view(*codes0.shape, c.num_codebooks - 1, c.codebook_size)
        return self.depth_logits(hidden) if fine is None else self.teacher_forced_logits(hidden, fine)

    def refine(self, z: torch.Tensor) -> torch.Tensor:
        """The depth head's shared residual blocks, z [..., D] -> [..., D]."""
        fused = self._inference(z)
        for index, block in enumerate(self.depth_blocks):
            if not fused:
                z = z + block(z)
                continue
            norm, up, _, down = block  # z + W_2 GELU(W_1 LN(z) + b_1) + b_2
            inner = self._linear(f"depth.{index}.up", norm(z), up.weight, up.bias, activation="gelu")
            z = self._linear(f"depth.{index}.down", inner, down.weight, down.bias, residual=z)
        return z

    @staticmethod
    def _inference(x: torch.Tensor) -> bool:
        """Whether the forward takes :meth:`_encode` and :meth:`_linear` for its depth blocks and
        heads: no gradient wanted, on a CPU. There PyTorch's encoder and modules spend more time
        around their GEMMs than in them, and oneDNN makes its primitives again for every new frame
        count (the embedded voice's stage over a sentence of a new length, 125 frames, bf16, one AMX
        core: 17.5 ms through the modules, 7.7 ms here; 9.3 and 6.8 ms for a length seen before)."""
        return x.device.type == "cpu" and not torch.is_grad_enabled()

    def read_as_int8(self, path: str | None = None) -> None:
        """Read every linear of the inference forward (:meth:`_linear`: encoder, depth blocks, heads)
        as int8 weights through the int8 kernel (:func:`~mmspec.modeling.fused.int8_linear`: weights
        per output row and input rows per row quantised symmetrically, the products summed exactly
        in int32); ``path``: how it sums (:func:`~mmspec.modeling.fused.int8_paths`, default the
        fastest here). A linear whose shape the kernel does not take (N % 16, K % 4) stays as it is.
        Training (gradients) still reads the float weights.

        Raises:
            ValueError: ``path`` does not run here.
        """
        self._int8 = int8_path(path)

    def _linear(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`~mmspec.modeling.fast_linear.PreparedWeights.linear` over this stage's copies (the
        int8 kernel over their int8 copies after :meth:`read_as_int8`)."""
        n, k = weight.shape
        if self._int8 is None or not int8_fits(weight) or x.dtype != weight.dtype or x.device.type != "cpu":
            return self._weights.linear(name, x, weight, bias, activation, residual)
        blob = self._weights.int8(name, weight)
        out = int8_linear(x.reshape(-1, k).contiguous(), blob, n, bias, self._int8).view(*x.shape[:-1], n)
        return F.gelu(out) if activation == "gelu" else out if residual is None else out + residual

    def _encode(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The encoder's forward (pre-norm layers, exact GELU) over x [B, F, D] with every linear
        one :meth:`_linear` (a weight prepared once, the GELU or the residual sum after it):

            h = x + W_o MHA(LN_1(x)) + b_o,   x' = h + W_2 GELU(W_1 LN_2(h) + b_1) + b_2

        mask [B, F] (1: a frame, 0: padding, which no frame attends to) or None."""
        batch, frames, dim = x.shape
        heads = self.config.heads
        keep = None if mask is None else mask.bool()[:, None, None, :]  # [B, 1, 1, F]
        for index, layer in enumerate(self.encoder.layers):
            attention = layer.self_attn
            qkv = self._linear(f"encoder.{index}.qkv", layer.norm1(x), attention.in_proj_weight, attention.in_proj_bias)
            q, k, v = qkv.view(batch, frames, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)  # each [B, heads, F, D / heads]
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(batch, frames, dim)
            x = self._linear(f"encoder.{index}.out", attended, attention.out_proj.weight, attention.out_proj.bias, residual=x)
            inner = self._linear(f"encoder.{index}.up", layer.norm2(x), layer.linear1.weight, layer.linear1.bias,
                                 activation="gelu")
            x = self._linear(f"encoder.{index}.down", inner, layer.linear2.weight, layer.linear2.bias, residual=x)
        return self.encoder.norm(x)

    def head_weights(self) -> torch.Tensor:
        """W_k for every fine codebook, [K - 1, C, D]."""
        c = self.config
        return self.heads.weight.view(c.num_codebooks - 1, c.codebook_size, c.dim)

    def teacher_forced_logits(self, hidden: torch.Tensor, fine: torch.Tensor) -> torch.Tensor:
        """hidden [B, F, D], fine [B, F, K - 1] (codebook k reads the given codes of 1 .. k-1)
        -> logits [B, F, K - 1, C]."""
        c = self.config
        offsets = torch.arange(fine.shape[-1] - 1, device=fine.device) * c.codebook_size
        before = self.fine_embeddings(fine[..., :-1] + offsets).cumsum(dim=-2)  # [B, F, K-2, D]
        prefix = torch.cat([torch.zeros_like(before[..., :1, :]), before], dim=-2)  # [B, F, K-1, D]
        z = self.refine(hidden[..., None, :] + self.codebook_inputs.weight + prefix)
        return torch.einsum("bfkd,kcd->bfkc", z, self.head_weights())

    def depth_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, F, D] -> logits [B, F, K - 1, C], codebook k reading the argmax codes of 1 .. k-1."""
        c = self.config
        weights, logits = self.head_weights(), []
        running = hidden
        for k in range(c.num_codebooks - 1):
            logits.append(self._linear(f"head.{k}", self.refine(running + self.codebook_inputs.weight[k]), weights[k]))  # [B, F, C]
            if k < c.num_codebooks - 2:
                running = running + self.fine_embeddings(exact_argmax(logits[-1]) + k * c.codebook_size)
        return torch.stack(logits, dim=-2)

    def loss(self, codes: torch.Tensor, alignment: torch.Tensor, mask: torch.Tensor,
             inputs0: torch.Tensor | None = None, fine_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Cross-entropy of codebooks 1 .. K-1 over the real frames.

        Args: codes [B, K, F] (padding anywhere mask is 0), alignment [B, F, 4], mask [B, F];
            inputs0 [B, F]: the codebook-0 input when it differs from ``codes[:, 0]`` (noisy input);
            fine_inputs [B, K - 1, F]: the codes a depth head reads when they differ from ``codes[:, 1:]``.
        """
        fine = (codes[:, 1:] if fine_inputs is None else fine_inputs).transpose(1, 2)
        logits = self(codes[:, 0] if inputs0 is None else inputs0, alignment, mask, fine).float()  # [B, F, K-1, C]
        targets = codes[:, 1:].transpose(1, 2).masked_fill(~mask.bool()[..., None], -100)  # [B, F, K-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)

    @torch.no_grad()
    def complete(self, codes0: torch.Tensor, phonemes: torch.Tensor, durations: torch.Tensor) -> torch.Tensor:
        """One utterance's codebook 0 -> all of its codes.

        Args: codes0 [F] (codes < C), phonemes [P] and durations [P] (frames per phoneme: the
            alignment the AR stage was given).
        Returns: LongTensor [K, F], row 0 = ``codes0``, rows 1.. the argmax codes.
        """
        frames = codes0.shape[0]
        if frames == 0:
            return codes0.new_zeros(self.config.num_codebooks, 0)
        alignment = frame_alignment(phonemes, durations, torch.arange(frames, device=codes0.device), self.config.text_vocab)
        fine = exact_argmax(self(codes0[None], alignment[None])[0])  # [F, K-1] (argmax over bf16 is slow on CPUs)
        return torch.cat([codes0[None], fine.T], dim=0)
