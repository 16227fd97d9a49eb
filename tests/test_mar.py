"""MAR-style continuous-token generation (mmspec.modeling.mar, .kl_vae, adapters.image.mar,
drafters.continuous): the official parameter layouts, MAR's masking semantics, and CSpD through the
core's loop (the target as its own draft reproduces AR decoding token for token)."""

import pytest
import torch

from mmspec.adapters.image.mar import MARTarget
from mmspec.core.loop import speculative_decode
from mmspec.core.sampling import SamplingConfig
from mmspec.drafters.continuous import MARDrafter
from mmspec.modeling.kl_vae import KLAutoencoder, KLConfig
from mmspec.modeling.mar import PRESETS, MARConfig, MARModel

SAMPLE = SamplingConfig(do_sample=True)
TINY = dict(img_size=32, vae_stride=4, vae_embed_dim=4, encoder_embed_dim=32, encoder_depth=1, encoder_num_heads=2,
            decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, buffer_size=4, class_num=10, diffloss_d=1,
            diffloss_w=32, num_train_steps=12, num_sampling_steps=6)


def tiny_mar(seed: int, **overrides) -> MARModel:
    """A random tiny MAR whose head depends on its input (MAR initialises the head's output at 0)."""
    torch.manual_seed(seed)
    model = MARModel(MARConfig(**{**TINY, **overrides}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.diffloss.net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def official_mar_base_shapes() -> dict[str, tuple[int, ...]]:
    """MAR-B's state dict as the official checkpoint lays it out (LTH14/mar, models/mar.py)."""
    d, w, shapes = 768, 1024, {}
    shapes.update({"class_emb.weight": (1000, d), "fake_latent": (1, d), "z_proj.weight": (d, 16), "z_proj.bias": (d,),
                   "z_proj_ln.weight": (d,), "z_proj_ln.bias": (d,), "encoder_pos_embed_learned": (1, 320, d),
                   "encoder_norm.weight": (d,), "encoder_norm.bias": (d,), "decoder_embed.weight": (d, d),
                   "decoder_embed.bias": (d,), "mask_token": (1, 1, d), "decoder_pos_embed_learned": (1, 320, d),
                   "decoder_norm.weight": (d,), "decoder_norm.bias": (d,), "diffusion_pos_embed_learned": (1, 256, d)})
    for stack in ("encoder_blocks", "decoder_blocks"):
        for i in range(12):
            p = f"{stack}.{i}."
            shapes.update({p + "norm1.weight": (d,), p + "norm1.bias": (d,), p + "norm2.weight": (d,), p + "norm2.bias": (d,),
                           p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,), p + "attn.proj.weight": (d, d),
                           p + "attn.proj.bias": (d,), p + "mlp.fc1.weight": (4 * d, d), p + "mlp.fc1.bias": (4 * d,),
                           p + "mlp.fc2.weight": (d, 4 * d), p + "mlp.fc2.bias": (d,)})
    n = "diffloss.net."
    shapes.update({n + "time_embed.mlp.0.weight": (w, 256), n + "time_embed.mlp.0.bias": (w,), n + "time_embed.mlp.2.weight": (w, w),
                   n + "time_embed.mlp.2.bias": (w,), n + "cond_embed.weight": (w, d), n + "cond_embed.bias": (w,),
                   n + "input_proj.weight": (w, 16), n + "input_proj.bias": (w,), n + "final_layer.linear.weight": (32, w),
                   n + "final_layer.linear.bias": (32,), n + "final_layer.adaLN_modulation.1.weight": (2 * w, w),
                   n + "final_layer.adaLN_modulation.1.bias": (2 * w,)})
    for i in range(6):
        p = f"{n}res_blocks.{i}."
        shapes.update({p + "in_ln.weight": (w,), p + "in_ln.bias": (w,), p + "mlp.0.weight": (w, w), p + "mlp.0.bias": (w,),
                       p + "mlp.2.weight": (w, w), p + "mlp.2.bias": (w,), p + "adaLN_modulation.1.weight": (3 * w, w),
                       p + "adaLN_modulation.1.bias": (3 * w,)})
    return shapes


def test_mar_base_has_the_official_layout():
    with torch.device("meta"):
        model = MARModel(MARConfig(**PRESETS["mar_base"]))
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ours == official_mar_base_shapes()
    assert sum(v.numel() for v in model.state_dict().values()) == 207_924_768  # MAR-B: 208M


def test_official_state_dicts_load_and_round_trip(tmp_path):
    model = tiny_mar(0)
    random = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    model.load_official(random)
    model.save(tmp_path / "mar")
    again = MARModel.from_pretrained(tmp_path / "mar")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in random.items())
    with pytest.raises(ValueError, match="not a MAR state dict"):
        model.load_official({**random, "extra.weight": torch.zeros(1)})
    vae = KLAutoencoder(KLConfig(resolution=32, ch=32, ch_mult=[1, 2], num_res_blocks=1, attn_resolutions=[16], embed_dim=4))
    vae.load_official({**{k: torch.randn(v.shape) for k, v in vae.state_dict().items()}, "loss.logvar": torch.zeros(())})
    assert vae.encode(torch.zeros(1, 3, 32, 32)).shape == (1, 4, 16, 16)


def test_kl16_has_the_official_layout():
    with torch.device("meta"):
        vae = KLAutoencoder(KLConfig())
    shapes = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    expected = {"encoder.conv_in.weight": (128, 3, 3, 3), "encoder.down.2.block.0.nin_shortcut.weight": (256, 128, 1, 1),
                "encoder.down.4.attn.1.proj_out.weight": (512, 512, 1, 1), "encoder.down.3.downsample.conv.weight": (256, 256, 3, 3),
                "encoder.mid.attn_1.q.weight": (512, 512, 1, 1), "encoder.conv_out.weight": (32, 512, 3, 3),
                "quant_conv.weight": (32, 32, 1, 1), "post_quant_conv.weight": (16, 16, 1, 1),
                "decoder.conv_in.weight": (512, 16, 3, 3), "decoder.up.4.block.2.conv2.weight": (512, 512, 3, 3),
                "decoder.up.3.block.0.nin_shortcut.weight": (256, 512, 1, 1), "decoder.up.4.upsample.conv.weight": (512, 512, 3, 3),
                "decoder.up.1.block.0.nin_shortcut.weight": (128, 256, 1, 1), "decoder.conv_out.weight": (3, 128, 3, 3)}
    assert {k: shapes.get(k) for k in expected} == expected
    assert not any(k.startswith(("encoder.down.4.downsample", "decoder.up.0.upsample")) or ".attn." in k and k.startswith("decoder.up")
                   for k in shapes)


def test_key_mask_equals_dropping_unknown_tokens():
    """MAR's encoder drops the masked tokens; ours keeps them out of the attention keys. The known
    tokens' encoder outputs, hence every position's condition, must agree."""
    model = tiny_mar(1)
    c = model.config
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(1, c.seq_len, c.token_embed_dim, generator=g)
    known = torch.rand(1, c.seq_len, generator=g) < 0.4
    buffer = model.buffer(torch.tensor([2]))
    with torch.no_grad():
        ours = model.contexts(tokens, known, buffer)
        x = torch.cat([buffer, model.z_proj(tokens)], 1) + model.encoder_pos_embed_learned
        x = model.z_proj_ln(x)
        keep = torch.cat([torch.ones(c.buffer_size, dtype=torch.bool), known[0]])
        h = x[:, keep]
        for block in model.encoder_blocks:
            h = block(h)
        h = model.decoder_embed(model.encoder_norm(h))
        full = model.mask_token.expand(1, c.seq_len + c.buffer_size, -1).clone()
        full[:, keep] = h
        full = full + model.decoder_pos_embed_learned
        for block in model.decoder_blocks:
            full = block(full)
        reference = model.decoder_norm(full)[:, c.buffer_size:] + model.diffusion_pos_embed_learned
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention,guidance", [("bidirectional", 1.0), ("bidirectional", 2.5), ("causal", 2.5)])
def test_self_draft_reproduces_ar(attention, guidance):
    """With the target as its own draft, every drafted token is the target's own sample under the
    same noise: all accepted, and the image equals plain decoding's token for token."""
    target = MARTarget(tiny_mar(2, attention=attention))
    inputs = target.prepare_inputs(torch.Generator().manual_seed(1), labels=torch.tensor([3]), guidance_scale=guidance)
    ar, ar_stats = speculative_decode(target, inputs, None, SAMPLE, target.config.seq_len, generator=torch.Generator().manual_seed(2))
    spec, stats = speculative_decode(target, inputs, MARDrafter(target.model, 4, prefill_fraction=0.1), SAMPLE,
                                     target.config.seq_len, generator=torch.Generator().manual_seed(2))
    assert ar.tokens.shape == spec.tokens.shape == (1, 64, 4) and ar_stats.verify_steps == 63
    assert stats.acceptance_rate == 1.0 and stats.verify_steps < 20
    torch.testing.assert_close(spec.tokens, ar.tokens, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_parallel_drafts(attention):
    """A parallel draft (all K from the committed tokens) is verified exactly too; with the target as
    its own parallel drafter, the first draft of every step is the target's own sample, hence accepted."""
    target = MARTarget(tiny_mar(13, attention=attention))
    inputs = target.prepare_inputs(torch.Generator().manual_seed(2), labels=torch.tensor([5]), guidance_scale=2.0)
    state, stats = speculative_decode(target, inputs, MARDrafter(target, 4, prefill_fraction=0.1, parallel=True), SAMPLE,
                                      64, generator=torch.Generator().manual_seed(0))
    assert state.tokens.shape == (1, 64, 4) and stats.draft_forwards == stats.verify_steps - 7
    assert stats.accepted_per_position[0] == stats.drafted_per_position[0]
    other, _ = speculative_decode(target, inputs, MARDrafter(tiny_mar(14, attention=attention), 3, parallel=True), SAMPLE,
                                  64, generator=torch.Generator().manual_seed(0))
    assert other.tokens.shape == (1, 64, 4) and bool(torch.isfinite(other.tokens).all())


def test_cspd_with_a_different_draft():
    target = MARTarget(tiny_mar(3))
    inputs = target.prepare_inputs(torch.Generator().manual_seed(1), order="raster", labels=torch.tensor([1]))
    assert inputs["order"].tolist() == list(range(64))
    drafter = MARDrafter(tiny_mar(4), 3, prefill_fraction=0.25)
    state, stats = speculative_decode(target, inputs, drafter, SAMPLE, 64, generator=torch.Generator().manual_seed(0))
    assert state.tokens.shape == (1, 64, 4) and bool(torch.isfinite(state.tokens).all())
    assert stats.new_tokens == 64 and stats.drafted > 0 and stats.config["residual_capped"] == 0
    # 16 pre-filled tokens (the prefill's + 15 plain steps), and the last token's step has no budget to draft
    assert stats.drafted_per_position[0] == stats.verify_steps - 16
    again, _ = speculative_decode(target, inputs, MARDrafter(tiny_mar(4), 3, prefill_fraction=0.25), SAMPLE, 64,
                                  generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.tokens, state.tokens)  # same seed, same image
    latents = target.unpatchify(state.tokens, inputs["order"])
    assert latents.shape == (1, 4, 8, 8) and torch.equal(latents[0, :, 0, 1], state.tokens[0, 1])


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_one_forward_equals_separate_contexts(attention):
    """The verification forward (K + 1 contexts) and a parallel step (k queries on one prefix) give
    each query the condition it gets alone."""
    target = MARTarget(tiny_mar(7, attention=attention))
    inputs = target.prepare_inputs(torch.Generator().manual_seed(3), labels=torch.tensor([4]), guidance_scale=1.5)
    state, _ = target.prefill(inputs)
    state.commit(torch.randn(1, 5, 4))
    drafts = torch.randn(1, 3, 4)
    index = torch.arange(5, 9)
    together = target.conditions(state, drafts, index, index)
    alone = torch.cat([target.conditions(state, drafts[:, :i], index[i : i + 1], index[i : i + 1]).view(2, 1, -1)
                       for i in range(4)], dim=1).view(8, -1)
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)
    shared = target.conditions(state, None, index, torch.full_like(index, 5))
    single = torch.cat([target.conditions(state, None, index[i : i + 1], index[:1]).view(2, 1, -1) for i in range(4)], 1)
    torch.testing.assert_close(shared, single.view(8, -1), rtol=1e-4, atol=1e-5)
    assert target.parallel_step(state, 4).sample.shape == (1, 4, 4)


def test_rollback_and_errors():
    target = MARTarget(tiny_mar(5))
    inputs = target.prepare_inputs(torch.Generator().manual_seed(1), labels=torch.tensor([0]))
    state, first = target.prefill(inputs)
    state.commit(first.steps.sample)
    drafts = torch.randn(1, 3, 4)
    before = target.forward(state, drafts).steps
    state.commit(drafts[:, :2])
    state.rollback(1)
    after = target.forward(state, drafts).steps
    torch.testing.assert_close(after.mean, before.mean)
    with pytest.raises(ValueError, match="lacks 'noise'; build them with MARTarget.prepare_inputs"):
        target.prefill({"order": inputs["order"], "labels": torch.tensor([0])})
    with pytest.raises(ValueError, match="order must be one of"):
        target.prepare_inputs(torch.Generator(), order="spiral")
    other = MARDrafter(tiny_mar(6, num_sampling_steps=4), 2)
    with pytest.raises(ValueError, match="must equal the target's"):
        speculative_decode(target, inputs, other, SAMPLE, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="needs do_sample=True"):
        speculative_decode(target, inputs, None, SamplingConfig(do_sample=False), 8)
    with pytest.raises(ValueError, match="class-conditioned"):
        target.model.buffer(text=torch.zeros(1, 2, 8))


def tiny_components(attention: str = "causal"):
    from mmspec.pipelines.text_to_image.mar_components import MARComponents

    target = MARTarget(tiny_mar(8, attention=attention, class_num=0, text_dim=6))
    vae = KLAutoencoder(KLConfig(resolution=32, ch=32, ch_mult=[1, 2, 2], num_res_blocks=1, attn_resolutions=[8], embed_dim=4))
    encode = lambda prompt: {"text": torch.full((1, 3, 6), float(len(prompt)) / 10)}
    return MARComponents(target=target, autoencoder=vae.eval(), encode=encode,
                         draft=MARTarget(tiny_mar(9, attention=attention, class_num=0, text_dim=6)))


def test_text_to_image_pipeline_with_a_mar(tmp_path):
    from mmspec.pipelines.text_to_image import TextToImagePipeline

    components = tiny_components()
    cspd = TextToImagePipeline(components=components, method="cspd", num_draft_tokens=3)
    out = cspd("a red circle", seed=5, guidance_scale=2.0, compare_baseline=True)
    assert out.tokens.shape == (1, 64, 4) and out.images[0].size == (32, 32)
    assert out.stats.method == "cspd" and out.stats.config["acceptance"] == "cspd" and out.stats.speedup is not None
    assert out.accepted_map.shape == (1, 8, 8) and int(out.accepted_map.max()) == out.stats.per_image[0]["verify_steps"]
    ar = TextToImagePipeline(components=components, method="ar")("a red circle", seed=5, guidance_scale=2.0)
    torch.testing.assert_close(ar.tokens, out.baseline_tokens)  # same seed, same order and noise: the same AR image
    tempered = TextToImagePipeline(components=components, method="cspd-tempered", num_draft_tokens=3)("a red circle", seed=5,
                                                                                                   guidance_scale=2.0)
    assert tempered.stats.config["acceptance"] == "cspd-tempered" and tempered.stats.config["exponent_temperature"] == 42.0
    selfdraft = TextToImagePipeline(components=components, method="cspd-self")("a red circle", seed=5, guidance_scale=2.0)
    assert selfdraft.stats.config["parallel"] and selfdraft.stats.tau > 1.0
    assert selfdraft.stats.config["draft"] == "the target itself" and "draft" not in out.stats.config  # (cspd: the draft MAR)
    parallel = TextToImagePipeline(components=components, method="mar-parallel:4")("a red circle", seed=5, guidance_scale=2.0)
    assert parallel.stats.target_forwards == 4 and parallel.tokens.shape == (1, 64, 4)
    later = parallel.stats.per_image[0]["committed_per_step"]  # the steps after the first, which plays the prefill
    assert len(later) == 3 and parallel.stats.tau == pytest.approx(sum(later) / 3)  # (was (64 - 1) / 3)
    assert parallel.stats.config["exact"] is False  # (several tokens drawn at once: labelled as not plain decoding's)
    assert sorted(set(parallel.accepted_map.flatten().tolist())) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="does not work with a continuous-token \\(MAR\\) model; choose one of ar, cspd, cspd-tempered, cspd-self"):
        TextToImagePipeline(components=components, method="sjd")
    broken = tmp_path / "broken-mar"  # a discrete-token method is refused before the model loads
    broken.mkdir()
    (broken / "mar.json").write_text("not json")
    for model in (broken, str(broken)):
        with pytest.raises(ValueError, match="method 'sjd' does not work with a continuous-token"):
            TextToImagePipeline(model=model, method="sjd")
    with pytest.raises(ValueError, match="keep do_sample=True"):
        cspd("a red circle", do_sample=False)
    with pytest.raises(ValueError, match="takes the number of steps"):
        TextToImagePipeline(components=components, method="mar-parallel:fast")


@pytest.fixture(scope="module")
def mar_dir(tmp_path_factory):
    """A tiny text-conditioned MAR + draft + KL autoencoder saved in the embedded layout."""
    import json

    root = tmp_path_factory.mktemp("mar")
    for name, seed in (("mar", 10), ("mar-draft", 11)):
        tiny_mar(seed, attention="causal", class_num=0, text_dim=576, buffer_size=40, img_size=32, vae_stride=4).save(root / name)
    vae = KLAutoencoder(KLConfig(resolution=32, ch=32, ch_mult=[1, 2, 2], num_res_blocks=1, attn_resolutions=[8], embed_dim=4))
    vae.save(root / "kl")
    (root / "mar" / "mar.json").write_text(json.dumps({"kl": "../kl", "draft": "../mar-draft", "text_encoder_layers": 2}))
    return root / "mar"


def test_cli_and_bench_with_a_mar_directory(mar_dir, tmp_path, capsys):
    import json

    from mmspec.cli import main

    out = tmp_path / "images"
    assert main(["t2i", "a red circle", "--model", str(mar_dir), "--method", "cspd", "--num-draft-tokens", "3",
                 "--compare-baseline", "--out", str(out), "--json", "--no-optimize"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["stats"]["method"] == "cspd" and record["stats"]["tokens"] == 64 and (out / "grid.png").is_file()
    assert main(["t2i", "a red circle", "--model", str(mar_dir), "--method", "sjd", "--out", str(out)]) == 2
    assert "choose one of ar, cspd, cspd-tempered, cspd-self, mar-parallel" in capsys.readouterr().err
    results = tmp_path / "bench.json"
    assert main(["bench", "t2i", "--model", str(mar_dir), "--methods", "ar,mar-parallel:4,cspd/num_draft_tokens=2",
                 "--prompts", "2", "--rounds", "1", "--threads", "1", "--no-quality", "--results", str(results)]) == 0
    summary = json.loads(results.read_text())["summary"]
    assert set(summary) == {"ar", "mar-parallel:4", "cspd/num_draft_tokens=2"}
    assert summary["ar"]["step_compression"] == 1.0 and summary["mar-parallel:4"]["step_compression"] == 16.0
    assert summary["cspd/num_draft_tokens=2"]["exact"] and not summary["mar-parallel:4"]["exact"]


def test_precomputed_chain_equals_the_plain_head():
    """The head's chain() (adaLN modulations for all steps up front) gives the forward's outputs."""
    from mmspec.modeling.diffusion import GuidedHead, sample_chain

    model = tiny_mar(12)
    net, schedule = model.diffloss.net, model.schedule
    z = torch.randn(6, 32)
    noise = torch.randn(3, schedule.sampling_steps + 1, 4)
    with torch.no_grad():
        fast = sample_chain(GuidedHead(net, 2.0), schedule, z, noise)
        plain = sample_chain(lambda x, t, c: GuidedHead(net, 2.0)(x, t, c), schedule, z, noise)
    for name in ("mean", "std", "sample", "log_scale"):
        torch.testing.assert_close(getattr(fast, name), getattr(plain, name), rtol=1e-5, atol=1e-5)
