"""LoRA and QLoRA (rlvr.models.lora): parity with the base model, with the merged weights, and with
`peft` on top of transformers for an adapter trained by a real job on a Hugging Face checkpoint."""

import ast
import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlvr import sharding
from rlvr.models import lora
from rlvr.models import params as params_lib
from rlvr.models.config import PRESETS, LoraConfig, ModelConfig
from rlvr.models.transformer import forward


def _trained_adapters(params, seed=3, scale=0.05):
    """The params with every lora_b drawn at random (a fresh adapter's B is zero)."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: scale * jax.random.normal(next(keys), x.shape, x.dtype) if p[-1].key == "lora_b" else x, params)


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_fresh_adapter_is_the_base_and_merging_is_exact(quantize):
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    cfg = dataclasses.replace(ModelConfig(**PRESETS["tiny"]),
                              lora=LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "o_proj", "down_proj"),
                                              quantize=quantize, quant_block=32))
    base = params_lib.init_params(lora.without_lora(cfg), jax.random.key(0), mesh)
    params = lora.attach(cfg, base, jax.random.key(1), mesh)
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, cfg.vocab_size)
    plain = lora.without_lora(cfg)

    # a fresh adapter (B = 0) is its base exactly: the base itself, or its dequantised weights
    reference = base if quantize == "none" else lora.merge(cfg, lora.frozen(params))
    fresh = forward(cfg, params, tokens)[0]
    np.testing.assert_array_equal(np.asarray(fresh), np.asarray(forward(plain, reference, tokens)[0]))
    if quantize != "none":  # the quantised base is close to, not equal to, the float one
        bits = {"int8": 8, "int4": 4}[quantize]
        err = np.max(np.abs(np.asarray(reference["layers"]["mlp"]["down_proj"]["kernel"])
                            - np.asarray(base["layers"]["mlp"]["down_proj"]["kernel"])))
        bound = np.max(np.abs(np.asarray(base["layers"]["mlp"]["down_proj"]["kernel"]))) / (2 ** (bits - 1) - 1)
        assert 0 < err <= bound / 2 + 1e-7  # half a quantisation step at most
        stored = params["layers"]["mlp"]["down_proj"]["kernel"]  # int8: a byte per weight; int4: two per byte
        assert stored.nbytes * 8 == base["layers"]["mlp"]["down_proj"]["kernel"].size * bits

    # a trained adapter: the unmerged forward equals the merged weights' forward
    trained = _trained_adapters(params)
    unmerged = np.asarray(forward(cfg, trained, tokens)[0])
    merged = np.asarray(forward(plain, lora.merge(cfg, trained), tokens)[0])
    assert np.max(np.abs(unmerged - np.asarray(fresh))) > 1e-3  # the adapter changes the output
    np.testing.assert_allclose(unmerged, merged, atol=1e-5, rtol=0)

    # what trains: the adapters alone
    names = {p[-1].key for p, _ in jax.tree_util.tree_leaves_with_path(lora.trainable(trained))}
    assert names == {"lora_a", "lora_b"}
    assert sum(x.size for x in jax.tree.leaves(lora.trainable(trained))) == lora.adapter_count(cfg)


def test_quant_block_errors_name_the_field_and_a_vlm_keeps_its_vision_tower_float():
    """QLoRA with lora.quant_block not dividing a projection's input width is a clear error naming the
    field, the projection and a fix (it was a reshape error of jax.numpy). A VLM's vision tower (no
    adapters) is not quantised: its 48-wide layers, which no block of 32 divides, stay float (this too
    was a reshape error), and the quantised VLM's forward equals its merged weights'."""
    from rlvr.models import vision
    from rlvr.models.config import VisionConfig
    from rlvr.models.params import abstract_params

    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    tiny = lora.without_lora(ModelConfig(**PRESETS["tiny"]))  # widths 128, 384
    base = params_lib.init_params(tiny, jax.random.key(0), mesh)
    with pytest.raises(ValueError, match=r"lora\.quant_block=96 must divide.*layers/\w+/\w+_proj takes 128: "
                                         r"set lora\.quant_block to a divisor of it \(e\.g\. 32\) or "
                                         r"lora\.quantize='none'"):
        lora.attach(dataclasses.replace(tiny, lora=LoraConfig(rank=4, quantize="int8", quant_block=96)), base,
                    jax.random.key(1), mesh)

    cfg = ModelConfig(family="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, qk_norm=False, mrope_section=(2, 3, 3))
    cfg = dataclasses.replace(cfg, vision=VisionConfig(hidden_size=48, intermediate_size=64, num_layers=2,
                                                       num_heads=2, out_hidden_size=64, window_size=56,
                                                       full_attention_layers=(1,), image_token_id=290))
    rng = np.random.default_rng(0)
    base = jax.tree_util.tree_map_with_path(lambda p, s: rng.normal(0, 0.2, s.shape).astype(np.float32),
                                            abstract_params(cfg))
    qlora = dataclasses.replace(cfg, lora=LoraConfig(rank=4, quantize="int8", quant_block=32))
    params = lora.attach(qlora, base, jax.random.key(1), mesh)
    assert params["layers"]["mlp"]["down_proj"]["kernel"].dtype == jnp.int8
    np.testing.assert_array_equal(params["visual"]["blocks"]["down_proj"]["kernel"],
                                  base["visual"]["blocks"]["down_proj"]["kernel"])
    ids = np.array([[1, 2, 3] + [290] * 4 + [5, 6]])
    segments = np.ones_like(ids)
    images = vision.image_inputs(cfg.vision, [rng.normal(size=(16, cfg.vision.patch_dim)).astype(np.float32)],
                                 [[(1, 4, 4)]], ids, segments)
    got = forward(qlora, params, jnp.asarray(ids), None, jnp.asarray(segments), images=images)[0]
    want = forward(cfg, lora.merge(qlora, lora.frozen(params)), jnp.asarray(ids), None, jnp.asarray(segments),
                   images=images)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)

def test_sglang_weight_sync_of_a_qlora_policy_is_the_merged_model(tmp_path):
    """The SGLang backend's weight sync writes a LoRA policy merged (plain weights SGLang loads)."""
    import types

    from rlvr.models import hf
    from rlvr.rl.backends import SGLangBackend

    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    cfg = dataclasses.replace(ModelConfig(**PRESETS["tiny"]), lora=LoraConfig(rank=4, quantize="int8", quant_block=32))
    base = params_lib.init_params(lora.without_lora(cfg), jax.random.key(0), mesh)
    params = _trained_adapters(lora.attach(cfg, base, jax.random.key(1), mesh))

    async def loaded(path, version, pause_mode):
        return None

    fake = types.SimpleNamespace(cfg=cfg, export_dir=str(tmp_path), tokenizer_dir=None, keep_exports=2, _exports=[],
                                 _run=lambda coro: coro.close(), client=types.SimpleNamespace(
                                     update_weights_from_disk=loaded))
    SGLangBackend.update_weights(fake, params, 1)
    _, written = hf.load_hf_checkpoint(str(tmp_path / "weights_v1"), mesh=mesh)
    want = lora.merge(cfg, params)
    for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(written), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-6, err_msg=str(path))


def test_lora_sft_on_an_hf_checkpoint_exports_a_peft_adapter_and_a_merged_model(tmp_path):
    """A LoRA SFT job (2 steps) on a random Qwen3 HF checkpoint with a BPE tokenizer: the checkpoint
    holds the adapters and their optimizer state only; the PEFT export loaded by `peft` on the
    transformers model and the merged export loaded by transformers give our logits within 1e-4."""
    import torch
    from hf_fixtures import write_random_hf

    from rlvr import api, config_lib, export
    from rlvr.main import run

    model_dir = write_random_hf(str(tmp_path / "qwen3"), "qwen3")
    workdir = str(tmp_path / "run")
    config = config_lib.load_config(f"configs/recipes/chat_sft_dpo.py:{model_dir},sft,smoke",
                                    {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": "attention,down_proj",
                                     "optimizer.learning_rate": 1e-2, "distill.teacher": model_dir,
                                     "distill.weight": 0.5, "distill.top_k": 1024, "distill.chunk_size": 64,
                                     "optimizer.warmup_steps": 1, "train.num_steps": 3})
    run(config, workdir)
    # logit distillation from the base itself (top_k = the vocabulary: the whole distribution)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        first = next(m for m in map(json.loads, f) if "distill_kl" in m)
    # step 2 follows step 1's update at learning rate 0 (warm-up): the adapters are still fresh
    assert first["step"] == 2 and abs(first["distill_kl"]) < 1e-5 and first["nll"] > 1  # a fresh adapter is its teacher
    assert first["loss"] == pytest.approx(0.5 * first["nll"] + 0.5 * first["distill_kl"], rel=1e-4)

    trained = api.load_trained(workdir)
    adapters = lora.trainable(trained.params)
    assert float(jnp.max(jnp.abs(adapters["layers"]["mlp"]["down_proj"]["lora_b"]))) > 0  # it trained
    metadata = max(glob.glob(os.path.join(workdir, "checkpoints", "*", "state", "_METADATA")))  # the last step's
    with open(metadata) as f:  # orbax's tree: every saved leaf's path
        saved = [ast.literal_eval(k) for k in json.load(f)["tree_metadata"]]
    weights = {p[-1] for p in saved if p[0] in ("params", "opt_state") and "layers" in p or "embed_tokens" in p
               or "lm_head" in p or "norm" in p}
    assert weights == {"lora_a", "lora_b"}, weights  # params and Adam moments: adapters only, no base weight
    with open(os.path.join(os.path.dirname(os.path.dirname(metadata)), "extra", "metadata")) as f:
        assert json.load(f)["lora_base"] == f"init.hf_checkpoint={model_dir}"  # the pointer to the base

    out = str(tmp_path / "adapter")
    _, base_dir = export.export_adapter(workdir, out)
    assert base_dir == model_dir  # the adapter points at the HF checkpoint it was trained on
    merged_dir = str(tmp_path / "merged")
    export.export(workdir, merged_dir)

    tokens = np.asarray(trained.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True))[None]
    ours = np.asarray(forward(trained.cfg, trained.params, jnp.asarray(tokens))[0])
    base_logits = np.asarray(forward(lora.without_lora(trained.cfg), lora.frozen(trained.params),
                                     jnp.asarray(tokens))[0])
    assert np.max(np.abs(ours - base_logits)) > 1e-3  # the adapter is not a no-op
    for out_dir, base in ((out, base_dir), (merged_dir, None)):
        _, theirs = export.load_transformers(out_dir, base)
        with torch.no_grad():
            logits = theirs(torch.tensor(tokens)).logits.float().numpy()
        np.testing.assert_allclose(logits, ours, atol=1e-4, rtol=0)


def test_topk_forward_kl_matches_full_logits():
    from rlvr.losses.distill import topk_forward_kl

    rng = np.random.default_rng(0)
    b, t, e, v, vt, k = 2, 7, 8, 11, 13, 4  # the teacher's vocabulary padded beyond the student's
    hs, ht = rng.normal(size=(b, t, e)).astype(np.float32), rng.normal(size=(b, t, e)).astype(np.float32)
    ws, wt = rng.normal(size=(e, v)).astype(np.float32), rng.normal(size=(vt, e)).astype(np.float32)
    targets = rng.integers(0, v, (b, t))
    logp, kl = topk_forward_kl(jnp.asarray(hs), jnp.asarray(ws), jnp.asarray(ht), jnp.asarray(wt), jnp.asarray(targets),
                               top_k=k, chunk_size=3, teacher_vocab_major=True)

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    ls, lt = log_softmax(hs @ ws), log_softmax((ht @ wt.T)[..., :v])
    top = np.argsort(-lt, axis=-1)[..., :k]
    pt = np.take_along_axis(lt, top, -1)
    pt = pt - np.log(np.exp(pt).sum(-1, keepdims=True))
    want = (np.exp(pt) * (pt - np.take_along_axis(ls, top, -1))).sum(-1)
    np.testing.assert_allclose(np.asarray(kl), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logp), np.take_along_axis(ls, targets[..., None], -1)[..., 0], atol=1e-5)
    # the gradient reaches the student only: against the full-logits formula's
    full = lambda h: jnp.sum(jnp.exp(pt) * (pt - jnp.take_along_axis(jax.nn.log_softmax(h @ ws), top, -1)))
    got = jax.grad(lambda h: jnp.sum(topk_forward_kl(h, jnp.asarray(ws), jnp.asarray(ht), jnp.asarray(wt),
                                                     jnp.asarray(targets), top_k=k, chunk_size=3,
                                                     teacher_vocab_major=True)[1]))(jnp.asarray(hs))
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.grad(full)(jnp.asarray(hs))), atol=1e-5)


def test_full_reverse_kl_matches_numpy_and_the_naive_gradient():
    """On-policy distillation's full-vocabulary reverse KL in chunks (a tied student head, a teacher
    vocabulary padded beyond the student's, a sharpened teacher) equals the NumPy brute force, and its
    gradient in the student's hidden states and head equals jax.grad of the full-logits formula."""
    from rlvr.losses.distill import full_reverse_kl

    rng = np.random.default_rng(1)
    b, t, e, v, vt = 2, 7, 8, 11, 13
    hs, ht = rng.normal(size=(b, t, e)).astype(np.float32), rng.normal(size=(b, t, e)).astype(np.float32)
    ws, wt = rng.normal(size=(v, e)).astype(np.float32), rng.normal(size=(e, vt)).astype(np.float32)
    weights = jnp.asarray(rng.uniform(size=(b, t)).astype(np.float32))
    kl = lambda h, w: full_reverse_kl(h, w, jnp.asarray(ht), jnp.asarray(wt), chunk_size=3,
                                      student_vocab_major=True, teacher_temperature=0.7)

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    ls, lt = log_softmax(hs.astype(np.float64) @ ws.T), log_softmax((ht.astype(np.float64) @ wt)[..., :v] / 0.7)
    np.testing.assert_allclose(np.asarray(kl(jnp.asarray(hs), jnp.asarray(ws))), (np.exp(ls) * (ls - lt)).sum(-1),
                               atol=1e-5)
    naive = lambda h, w: jnp.sum(weights * jnp.sum(jax.nn.softmax(h @ w.T) * (jax.nn.log_softmax(h @ w.T)
                                                                            - jnp.asarray(lt, jnp.float32)), -1))
    got = jax.grad(lambda h, w: jnp.sum(weights * kl(h, w)), argnums=(0, 1))(jnp.asarray(hs), jnp.asarray(ws))
    want = jax.grad(naive, argnums=(0, 1))(jnp.asarray(hs), jnp.asarray(ws))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)


def test_teacher_token_advantages_by_hand():
    from rlvr.rl.batching import Sample, build_batch
    from rlvr.rl.distill import teacher_token_advantages

    adv, kls = teacher_token_advantages([[-1.0, -2.0, -0.5]], [[-1.5, -1.0, -3.0]], [[1, 0, 1]], 2.0)
    np.testing.assert_allclose(adv[0], [-1.0, 0.0, -5.0])  # -2·(student - teacher), 0 on the observation
    assert kls == [pytest.approx((0.5 + 2.5) / 2)]
    sample = Sample(0, 0, [5, 6], [7, 8, 9], [-1.0, -2.0, -0.5], [0, 0, 0], False, {"reward": 1.0}, advantage=0.25,
                    token_advantage=adv[0].tolist())
    batch = build_batch([sample], 8, 0)
    np.testing.assert_allclose(batch["advantages"][0, :5], [0, 0, -0.75, 0.25, -4.75])


@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_lora_grpo_distills_from_a_teacher_and_serves_updated_adapters(tmp_path, estimator):
    """On-policy distillation in a LoRA GRPO run on a random Qwen3 HF checkpoint (BPE, chat prompts).
    Sampled-token estimator, the teacher being that checkpoint: before any update the student's
    sampled log-probs are the teacher's (reverse KL 0: same tokens, aligned), after one update the
    engine samples from the updated adapters (KL > 0) with log-probs equal to the trainer's.
    Full-vocabulary estimator, the teacher another random Qwen3 (the same tokenizer) run inside the
    train step: its exact KL is reported (positive: two models), the engine serving the updated
    adapters (the estimator itself: test_full_reverse_kl_matches_numpy_and_the_naive_gradient)."""
    import json as json_lib

    from hf_fixtures import write_random_hf

    from rlvr import config_lib
    from rlvr.main import run

    model_dir = write_random_hf(str(tmp_path / "qwen3"), "qwen3")
    teacher = model_dir if estimator == "sampled" else write_random_hf(str(tmp_path / "teacher"), "qwen3", seed=1)
    config = config_lib.load_config(f"configs/recipes/grpo_math.py:{model_dir},smoke",
                                    {"lora.rank": 4, "lora.alpha": 8.0, "rl.teacher": teacher,
                                     "rl.distill_task_advantage": False, "optimizer.learning_rate": 3e-2,
                                     "optimizer.warmup_steps": 0, "rl.distill_estimator": estimator})
    workdir = str(tmp_path / "rl")
    run(config, workdir)
    key = "reward/teacher_kl" if estimator == "sampled" else "teacher_kl"  # the producer's or the step's
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        steps = [m for m in map(json_lib.loads, f) if key in m]
    assert len(steps) == 2
    if estimator == "sampled":  # (a one-sample estimate may be negative; before the update only float noise)
        # after it, well above that noise: the per-token differences of a signed one-sample mean partly
        # cancel (7.5e-6 on this box's run of 2026-12-03, 1e-5 and more before), stale adapters give < 1e-6
        assert abs(steps[0][key]) < 1e-6, steps[0][key]
        assert abs(steps[1][key]) > 3e-6, steps[1][key]
    else:
        assert steps[0][key] > 1e-3 and steps[1][key] > 1e-3, (steps[0][key], steps[1][key])
    assert steps[1]["logprob_mismatch"] < 1e-4


def test_lora_dpo_against_its_base_starts_at_log_2(tmp_path):
    """LoRA DPO with the online reference: the reference is the frozen base (no copy), so while the
    adapters are fresh the DPO loss is log 2 (label smoothing 0); then the adapters learn."""
    from rlvr import config_lib
    from rlvr.main import run

    config = config_lib.load_config("configs/dpo_tiny.py:dpo,online,smoke",
                                    {"lora.rank": 4, "preference.label_smoothing": 0.0,
                                     "optimizer.learning_rate": 1e-2, "optimizer.warmup_steps": 1,
                                     "train.num_steps": 3})
    run(config, str(tmp_path))
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "loss" in m]
    # step 2's loss follows step 1's update at learning rate 0 (warm-up): the policy is still the base
    assert [m["step"] for m in steps] == [2, 3]
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert steps[-1]["loss"] != pytest.approx(np.log(2), abs=1e-4)
