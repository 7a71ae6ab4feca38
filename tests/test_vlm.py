"""The Qwen2.5-VL-layout VLM (rlvr.models.vision): logits against transformers on mixed image+text
batches, HF export round trip, the image processor against HF's, packed rows against unpacked.

The HF model is random (`initializer_range=0.2` so logits are O(5)) with 2 ViT layers, one windowed
and one full, and images large enough for several attention windows."""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from rlvr import losses  # noqa: E402
from rlvr.data import images  # noqa: E402
from rlvr.models import vision  # noqa: E402
from rlvr.models.config import ModelConfig, VisionConfig  # noqa: E402
from rlvr.models.generate import greedy_generate  # noqa: E402
from rlvr.models.params import abstract_params  # noqa: E402
from rlvr.models.transformer import forward  # noqa: E402

IMG, VS, VE = 290, 292, 293
GRIDS = [(1, 8, 12), (1, 4, 6)]  # in patches: 2x3 and 1x2 windows of 4x4 patches


def _rows(rng, pieces):
    """Token rows: text runs between <|vision_start|> <|image_pad|>*n <|vision_end|> blocks."""
    rows = []
    for texts, counts in pieces:
        row = []
        for i, n in enumerate(texts):
            row += list(rng.integers(0, 280, n))
            if i < len(counts):
                row += [VS] + [IMG] * counts[i] + [VE]
        rows.append(row)
    length = max(map(len, rows))
    ids, mask = np.zeros((len(rows), length), np.int64), np.zeros((len(rows), length), np.int64)
    for b, row in enumerate(rows):
        ids[b, :len(row)], mask[b, :len(row)] = row, 1
    return ids, mask


def _logits(cfg, params, ids, segments, imgs, positions=None):
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape) if positions is None else positions
    fn = jax.jit(lambda p, i: forward(cfg, p, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments),
                                      images=i)[0])
    return np.asarray(fn(params, imgs))


@pytest.mark.hf
def test_vlm_logits_match_hf_and_export_round_trips(tmp_path):
    import torch
    import transformers

    from rlvr.models import hf

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
                         initializer_range=0.2, rms_norm_eps=1e-6),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1], initializer_range=0.2),
        image_token_id=IMG, video_token_id=291, vision_start_token_id=VS, vision_end_token_id=VE)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(0)
    pixels = rng.normal(size=(sum(t * h * w for t, h, w in GRIDS), 3 * 2 * 14 * 14)).astype(np.float32)
    ids, mask = _rows(rng, [([5, 3], [24]), ([2, 4], [6])])  # right-padded, one image per row

    def hf_logits(m):
        with torch.no_grad():
            return m(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                     image_grid_thw=torch.tensor(GRIDS), mm_token_type_ids=torch.tensor((ids == IMG).astype(np.int64))
                     ).logits.numpy()

    ref = hf_logits(model)
    cfg, params = hf.load_hf_checkpoint(str(tmp_path / "hf"))
    imgs = vision.image_inputs(cfg.vision, [pixels[:96], pixels[96:]], [[GRIDS[0]], [GRIDS[1]]], ids, mask)
    err = np.abs(_logits(cfg, params, ids, mask, imgs) - ref)[mask == 1].max()
    hf.export_hf_checkpoint(cfg, params, str(tmp_path / "export"))
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    export_err = np.abs(hf_logits(reloaded) - ref)[mask == 1].max()
    print(f"\n[vlm parity] max|dlogit|={err:.2e} export round trip={export_err:.2e} max|logit|={np.abs(ref).max():.1f}")
    assert np.abs(ref).max() > 1.0
    assert err <= 1e-4
    assert export_err <= 1e-6

    # one decoder module per layer (model.scan_layers=False): the same logits, the same export
    flat_cfg, flat = hf.load_hf_checkpoint(str(tmp_path / "hf"), overrides={"scan_layers": False})
    assert "layers" not in flat and "layers_1" in flat
    np.testing.assert_allclose(_logits(flat_cfg, flat, ids, mask, imgs)[mask == 1], ref[mask == 1], atol=1e-4)
    exported, flat_exported = hf.to_hf_tensors(cfg, params), hf.to_hf_tensors(flat_cfg, flat)
    assert flat_exported.keys() == exported.keys()
    assert all(np.array_equal(v, exported[k]) for k, v in flat_exported.items())

    # decoding after an image prompt (cached prefill with the image, then M-RoPE ids + the prompt's
    # delta): the greedy tokens of transformers' generate
    n = int(mask[0].sum())
    with torch.no_grad():
        hf_tokens = model.generate(input_ids=torch.tensor(ids[:1, :n]), pixel_values=torch.tensor(pixels[:96]),
                                   image_grid_thw=torch.tensor(GRIDS[:1]), max_new_tokens=6, do_sample=False,
                                   mm_token_type_ids=torch.tensor((ids[:1, :n] == IMG).astype(np.int64)),
                                   eos_token_id=None, pad_token_id=0)[0, n:].tolist()
    ours = greedy_generate(cfg, params, [ids[0, :n].tolist()], 6, eos_id=-1, images=([pixels[:96]], [[GRIDS[0]]]))
    assert ours[0] == hf_tokens


@pytest.mark.hf
def test_image_preprocessing_matches_hf_processor(tmp_path):
    import base64
    import io

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
                for shape in ((100, 150, 3), (30, 40, 3), (300, 61, 3), (64, 64))]  # upscaled, thin, grey
    ref = Qwen2VLImageProcessorPil()(pictures, return_tensors="np")
    buffer = io.BytesIO()
    pictures[0].save(buffer, "PNG")
    pictures[1].save(tmp_path / "b.png")
    sources = ["data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), str(tmp_path / "b.png"),
               *pictures[2:]]
    patches, grids = images.preprocess(sources, VisionConfig())
    assert grids == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    np.testing.assert_allclose(patches, ref["pixel_values"], atol=1e-6, rtol=0)
    text = images.expand_placeholders(f"a{images.IMAGE_PAD}b{images.IMAGE_PAD}", grids[:2], VisionConfig())
    assert text.count(images.IMAGE_PAD) == sum(t * h * w // 4 for t, h, w in grids[:2])
    with pytest.raises(ValueError, match="placeholders"):
        images.expand_placeholders(images.IMAGE_PAD, grids[:2], VisionConfig())


def test_packed_rows_equal_separate_rows():
    """Two image+text sequences packed into one row (segment ids, positions restarting) give the
    logits they give in rows of their own: the M-RoPE ids, ViT groups and placeholders are per segment."""
    cfg = ModelConfig(family="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, qk_norm=False, mrope_section=(2, 3, 3))
    cfg = dataclasses.replace(cfg, vision=VisionConfig(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, out_hidden_size=64, window_size=56,
        full_attention_layers=(1,), image_token_id=IMG))
    vcfg = cfg.vision
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map_with_path(  # random weights of O(1) logits, without an init pass
        lambda path, s: np.ones(s.shape, np.float32) if path[-1].key == "scale"
        else rng.normal(0, 0.2, s.shape).astype(np.float32), abstract_params(cfg))
    pixels = [rng.normal(size=(t * h * w, vcfg.patch_dim)).astype(np.float32) for t, h, w in GRIDS]
    ids, mask = _rows(rng, [([5, 3], [24]), ([2, 4], [6])])
    separate = vision.image_inputs(vcfg, pixels, [[GRIDS[0]], [GRIDS[1]]], ids, mask)
    ref = _logits(cfg, params, ids, mask, separate)
    n0, n1 = mask.sum(1)
    packed_ids = np.concatenate([ids[0, :n0], ids[1, :n1]])[None]
    segments = np.array([[1] * n0 + [2] * n1])
    positions = np.array([list(range(n0)) + list(range(n1))])
    packed = vision.image_inputs(vcfg, [np.concatenate(pixels)], [GRIDS], packed_ids, segments)
    out = _logits(cfg, params, packed_ids, segments, packed, positions)
    # the trainer's chunked log-probs (no [B, T, V] logits) on the image batch: those of the full logits
    chunked, _, _ = jax.jit(lambda p, i: losses.model_token_logprobs(
        cfg, p, jnp.asarray(packed_ids), jnp.asarray(positions), jnp.asarray(segments), chunk_size=16, images=i))(
        params, packed)
    np.testing.assert_allclose(chunked, losses.next_token_logprobs(jnp.asarray(out), jnp.asarray(packed_ids)),
                               atol=1e-5)
    assert np.abs(ref).max() > 1.0  # tolerance: fp32 rounding of other shapes; a wrong id or mask is O(1)
    np.testing.assert_allclose(out[0, :n0], ref[0, :n0], atol=1e-3)
    np.testing.assert_allclose(out[0, n0:], ref[1, :n1], atol=1e-3)


@pytest.mark.hf
def test_sft_trainer_takes_chat_records_with_images(tmp_path):
    """`rlvr.main.run` (the SFT trainer) from a Qwen2.5-VL checkpoint on chat records whose user turns
    hold image parts (file paths and a base64 data URL): it trains, the encoder included (the images
    reach the loss), and the workdir reloads as the same VLM."""
    import base64
    import json

    from hf_fixtures import write_random_vlm
    from PIL import Image

    from rlvr import api, config_lib, main
    from rlvr.models import hf

    write_random_vlm(str(tmp_path / "hf"))
    rng = np.random.default_rng(0)
    records = []
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        source = str(tmp_path / f"{i}.png")
        if i == 0:
            source = "data:image/png;base64," + base64.b64encode((tmp_path / "0.png").read_bytes()).decode()
        records.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": source}, {"type": "text", "text": "Value?"}]},
            {"role": "assistant", "content": f"{i}"}]})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = config_lib.load_config("configs/sft_tiny.py:smoke", {
        "init.hf_checkpoint": str(tmp_path / "hf"), "data.path": str(tmp_path / "train.jsonl"),
        "data.eval_path": str(tmp_path / "train.jsonl"), "data.seq_len": 64, "data.batch_size": 8,
        "data.image_patches": 32})
    summary = main.run(config, str(tmp_path / "run"))
    assert np.isfinite(summary["final_loss"]) and np.isfinite(summary["heldout_loss"])
    start_cfg, start = hf.load_hf_checkpoint(str(tmp_path / "hf"))
    trained = api.load_trained(str(tmp_path / "run"))
    assert trained.cfg.vision == start_cfg.vision
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), trained.params["visual"],
                         start["visual"])
    assert min(jax.tree.leaves(moved)) > 0  # every encoder tensor got a gradient step


def test_vlm_parameters_shard_by_the_logical_axis_rules():
    """At Qwen2.5-VL-7B's encoder widths (abstract shapes only) on fsdp=2 x tensor=4: encoder heads and
    MLP over `tensor`, widths over `fsdp`, as the decoder's."""
    from jax.sharding import PartitionSpec as P

    from rlvr import sharding
    from rlvr.models.params import param_specs

    cfg = ModelConfig(family="qwen2", vocab_size=512, hidden_size=3584, intermediate_size=256, num_layers=1,
                      num_heads=28, num_kv_heads=4, head_dim=128, qkv_bias=True, qk_norm=False,
                      mrope_section=(16, 24, 24), vision=VisionConfig(num_layers=2, full_attention_layers=(1,)))
    specs = param_specs(cfg, sharding.make_mesh({"fsdp": 2, "tensor": 4}))
    assert specs["visual/blocks/qkv/kernel"] == P(None, "fsdp", None, "tensor")
    assert specs["visual/blocks/gate_proj/kernel"] == P(None, "fsdp", "tensor")
    assert specs["visual/blocks/proj/kernel"] == P(None, "tensor", None, "fsdp")
    assert specs["visual/patch_embed/kernel"] == P(None, None, None, None, "fsdp")
    assert specs["visual/merger_fc1/kernel"] == P(None, "tensor")
    assert specs["visual/merger_fc2/kernel"] == P("tensor", "fsdp")
    assert specs["layers/self_attn/q_proj/kernel"] == P(None, "fsdp", "tensor")


def test_full_distillation_of_a_vlm_sees_the_images():
    """On-policy distillation's full estimator (rl.distill_estimator='full') on image rollouts: the
    student's log-probs and its KL to a VLM teacher are those of both models' full forwards with the
    images (they were computed as if there were none); a text teacher reads the same tokens as text."""
    from rlvr.rl.objective import Objective, distill_logprobs

    cfg = ModelConfig(family="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, qk_norm=False, mrope_section=(2, 3, 3))
    cfg = dataclasses.replace(cfg, vision=VisionConfig(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, out_hidden_size=64, window_size=56,
        full_attention_layers=(1,), image_token_id=IMG))
    rng = np.random.default_rng(2)
    random_params = lambda c: jax.tree_util.tree_map_with_path(
        lambda path, s: np.ones(s.shape, np.float32) if path[-1].key == "scale"
        else rng.normal(0, 0.2, s.shape).astype(np.float32), abstract_params(c))
    student, teacher = random_params(cfg), random_params(cfg)
    text_cfg = dataclasses.replace(cfg, vision=None)
    text_teacher = random_params(text_cfg)
    pixels = [rng.normal(size=(t * h * w, cfg.vision.patch_dim)).astype(np.float32) for t, h, w in GRIDS]
    ids, mask = _rows(rng, [([5, 3], [24]), ([2, 4], [6])])
    imgs = vision.image_inputs(cfg.vision, pixels, [[GRIDS[0]], [GRIDS[1]]], ids, mask)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    batch = {"tokens": jnp.asarray(ids), "positions": jnp.asarray(positions), "segment_ids": jnp.asarray(mask),
             **{f"image_{k}": jnp.asarray(v) for k, v in zip(vision.IMAGE_KEYS, imgs, strict=True)}}
    obj = Objective(distill_coef=1.0, logprob_chunk_size=16)
    valid = mask[:, 1:] * mask[:, :-1] > 0

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    ls = log_softmax(_logits(cfg, student, ids, mask, imgs).astype(np.float64))[:, :-1]
    want_logp = np.take_along_axis(ls, ids[:, 1:, None], -1)[..., 0]
    for teacher_cfg, params, teacher_imgs in ((cfg, teacher, imgs), (text_cfg, text_teacher, None)):
        lt = log_softmax(_logits(teacher_cfg, params, ids, mask, teacher_imgs).astype(np.float64))[:, :-1]
        logp, _, _, kl = jax.jit(lambda s, t, b, c=teacher_cfg: distill_logprobs(cfg, c, obj, s, t, b))(
            student, params, batch)
        np.testing.assert_allclose(np.asarray(logp)[valid], want_logp[valid], atol=1e-4)
        np.testing.assert_allclose(np.asarray(kl)[valid], (np.exp(ls) * (ls - lt)).sum(-1)[valid], atol=1e-4)
