"""mmspec's LlamaGen-style VQ tokenizer and generator load state dicts laid out as the official
LlamaGen checkpoints (vq_ds16_*.pt: {"model": ...} with quantize.codebook_used; t2i_*.pt:
{"model": ...} with freqs_cis). The layouts below are written from LlamaGen's module structure,
independently of mmspec's classes, and filled with random values."""

import torch

from mmspec.modeling.llamagen import LlamaGenConfig, LlamaGenModel
from mmspec.modeling.vq import VQConfig, VQTokenizer


def official_vq_layout(ch, ch_mult, res_blocks, z, codes, dim):
    """name -> shape of LlamaGen's VQModel (Encoder/Decoder of taming's VQGAN + l2 codebook)."""
    shapes = {}

    def conv(name, cin, cout, k):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (cout, cin, k, k), (cout,)

    def norm(name, c):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (c,), (c,)

    def res(name, cin, cout):
        norm(f"{name}.norm1", cin); conv(f"{name}.conv1", cin, cout, 3)
        norm(f"{name}.norm2", cout); conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def attn(name, c):
        norm(f"{name}.norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{part}", c, c, 1)

    conv("encoder.conv_in", 3, ch, 3)
    cin = ch
    for i, m in enumerate(ch_mult):
        for j in range(res_blocks):
            res(f"encoder.conv_blocks.{i}.res.{j}", cin, ch * m); cin = ch * m
            if i == len(ch_mult) - 1:
                attn(f"encoder.conv_blocks.{i}.attn.{j}", cin)
        if i != len(ch_mult) - 1:
            conv(f"encoder.conv_blocks.{i}.downsample.conv", cin, cin, 3)
    res("encoder.mid.0", cin, cin); attn("encoder.mid.1", cin); res("encoder.mid.2", cin, cin)
    norm("encoder.norm_out", cin); conv("encoder.conv_out", cin, z, 3)
    conv("quant_conv", z, dim, 1); conv("post_quant_conv", dim, z, 1)
    shapes["quantize.embedding.weight"] = (codes, dim)
    cin = ch * ch_mult[-1]
    conv("decoder.conv_in", z, cin, 3)
    res("decoder.mid.0", cin, cin); attn("decoder.mid.1", cin); res("decoder.mid.2", cin, cin)
    for i, m in enumerate(reversed(ch_mult)):
        for j in range(res_blocks + 1):
            res(f"decoder.conv_blocks.{i}.res.{j}", cin, ch * m); cin = ch * m
            if i == 0:
                attn(f"decoder.conv_blocks.{i}.attn.{j}", cin)
        if i != len(ch_mult) - 1:
            conv(f"decoder.conv_blocks.{i}.upsample.conv", cin, cin, 3)
    norm("decoder.norm_out", cin); conv("decoder.conv_out", cin, 3, 3)
    return shapes


def official_gpt_layout(dim, layers, heads, vocab, hidden, caption_dim, prefix):
    shapes = {"tok_embeddings.weight": (vocab, dim), "cls_embedding.uncond_embedding": (prefix, caption_dim),
              "cls_embedding.cap_proj.fc1.weight": (dim, caption_dim), "cls_embedding.cap_proj.fc2.weight": (dim, dim),
              "norm.weight": (dim,), "output.weight": (vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attention.wqkv.weight": (3 * dim, dim), p + "attention.wo.weight": (dim, dim),
                       p + "feed_forward.w1.weight": (hidden, dim), p + "feed_forward.w3.weight": (hidden, dim),
                       p + "feed_forward.w2.weight": (dim, hidden), p + "attention_norm.weight": (dim,), p + "ffn_norm.weight": (dim,)})
    return shapes


def test_vq_tokenizer_loads_the_official_layout(tmp_path):
    layout = official_vq_layout(ch=32, ch_mult=[1, 1, 2], res_blocks=2, z=16, codes=64, dim=8)
    state = {name: torch.randn(shape) for name, shape in layout.items()}
    state["quantize.codebook_used"] = torch.zeros(65536)  # training-only buffer of the official checkpoints
    torch.save({"model": state, "optimizer": {}, "steps": 1}, tmp_path / "vq_ds4.pt")
    config = VQConfig(codebook_size=64, ch=32, encoder_ch_mult=[1, 1, 2], decoder_ch_mult=[1, 1, 2], num_res_blocks=2,
                      z_channels=16, image_size=32)
    vq = VQTokenizer.load_official(tmp_path / "vq_ds4.pt", config)
    assert set(vq.state_dict()) == set(layout)
    torch.testing.assert_close(vq.quantize.embedding.weight, state["quantize.embedding.weight"])
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    codes = vq.encode(images)
    assert codes.shape == (2, 8, 8) and int(codes.max()) < 64
    assert vq.decode(codes).shape == (2, 3, 32, 32)


def test_generator_loads_the_official_layout(tmp_path):
    config = LlamaGenConfig(dim=64, n_layer=2, n_head=4, vocab_size=50, cls_token_num=5, caption_dim=24, block_size=16,
                            multiple_of=32)
    layout = official_gpt_layout(64, 2, 4, 50, config.ffn_hidden, 24, 5)
    assert config.ffn_hidden == 192  # LlamaGen: find_multiple(int(2 * 4 * dim / 3), multiple_of)
    state = {name: torch.randn(shape) * 0.05 for name, shape in layout.items()}
    state["freqs_cis"] = torch.zeros(21, 8, 2)  # a buffer of the official checkpoints, recomputed here
    torch.save({"model": state}, tmp_path / "t2i.pt")
    model = LlamaGenModel.load_official(tmp_path / "t2i.pt", config)
    assert set(model.state_dict()) == set(layout)
    logits = model(torch.randint(50, (1, 15)), torch.randn(1, 5, 24)).logits
    assert logits.shape == (1, 20, 50)


def test_official_rope_zeroes_the_caption_positions():
    config = LlamaGenConfig(dim=32, n_layer=1, n_head=2, vocab_size=10, cls_token_num=3, caption_dim=8, block_size=4)
    table = LlamaGenModel(config).rope
    assert torch.all(table[:3] == 0)  # LlamaGen gives caption positions cos = sin = 0
    identity = LlamaGenModel(LlamaGenConfig(**{**config.__dict__, "rope_prefix": "identity"})).rope
    assert torch.all(identity[:3, :, 0] == 1) and torch.all(identity[:3, :, 1] == 0)
    assert torch.allclose(table[3:], identity[3:])
    # image token i turns with (row, column) = divmod(i, 2): token 1 and token 3 share the column
    assert torch.allclose(table[3 + 1, 4:], table[3 + 3, 4:]) and not torch.allclose(table[3 + 1, :4], table[3 + 3, :4])
