"""Parity with Hugging Face transformers: logits of tiny random HF models, export round trips.

Models are created by transformers from configs (`initializer_range=0.2` so logits are O(5)),
saved with `save_pretrained`, loaded by `rlvr.models.hf.load_hf_checkpoint` and compared on
the non-pad positions of a right-padded batch.
"""

import json
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402

from rlvr import sharding  # noqa: E402
from rlvr.models import hf  # noqa: E402
from rlvr.models.config import ModelConfig  # noqa: E402
from rlvr.models.params import abstract_params, param_shardings  # noqa: E402
from rlvr.models.tokenizer import byte_level_tokenizer  # noqa: E402
from rlvr.models.transformer import forward, init_cache  # noqa: E402

VOCAB, SEQ, LENGTHS = 320, 12, (12, 7)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name: (config class, config overrides, position offset: large offsets make RoPE scaling matter)
CASES = {
    "qwen2": (transformers.Qwen2Config, {}, 0),
    "qwen2_sliding": (transformers.Qwen2Config,
                      dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), 0),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16), 0),
    "llama_bias": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True), 0),
    "mistral_sliding": (transformers.MistralConfig, dict(sliding_window=4), 0),
    "qwen3_tied": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True), 0),
    "llama_mqa": (transformers.LlamaConfig, dict(num_key_value_heads=1), 0),
    "llama3_rope": (transformers.LlamaConfig, dict(rope_parameters=LLAMA3_ROPE), 500),
    "linear_rope": (transformers.LlamaConfig,
                    dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}), 500),
}


def _hf_model(name: str):
    config_cls, overrides, _ = CASES[name]
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    return model.eval()


def _batch(offset: int = 0):
    """Right-padded batch of 2 sequences of different lengths."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (2, SEQ))
    mask = (np.arange(SEQ)[None] < np.array(LENGTHS)[:, None]).astype(np.int64)
    positions = np.broadcast_to(np.arange(SEQ) + offset, (2, SEQ)).copy()
    return ids * mask, mask, positions


def _hf_logits(model, ids, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))
    return out.logits.float().numpy()


def _our_logits(cfg, params, ids, mask, positions) -> np.ndarray:
    fn = jax.jit(lambda p, t, pos, seg: forward(cfg, p, t, pos, seg)[0])
    return np.asarray(fn(params, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)))


def _max_err(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    return float(np.abs(a - b)[mask.astype(bool)].max())


@pytest.mark.hf
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf_and_export_round_trips(name, tmp_path):
    model = _hf_model(name)
    model.save_pretrained(tmp_path / "hf")
    ids, mask, positions = _batch(CASES[name][2])
    ref = _hf_logits(model, ids, mask, positions)

    cfg, params = hf.load_hf_checkpoint(str(tmp_path / "hf"))
    ours = _our_logits(cfg, params, ids, mask, positions)
    err = _max_err(ours, ref, mask)

    hf.export_hf_checkpoint(cfg, params, str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager", dtype=torch.float32).eval()
    export_err = _max_err(_hf_logits(reloaded, ids, mask, positions), ref, mask)
    print(f"\n[parity] {name:16s} load max|dlogit|={err:.2e}  export round trip={export_err:.2e}  "
          f"(max|logit|={np.abs(ref).max():.1f})")
    assert np.abs(ref).max() > 1.0, "logits too small for a meaningful test"
    assert err <= 1e-4
    assert export_err <= 1e-6


@pytest.mark.hf
def test_per_layer_weights_load_and_export_like_scanned_ones(tmp_path):
    """`model.scan_layers=False` (one module per layer) reads a HF checkpoint into per-layer params that
    give HF's logits, and exports the same tensors back."""
    name = next(iter(CASES))
    model = _hf_model(name)
    model.save_pretrained(tmp_path / "hf")
    ids, mask, positions = _batch(CASES[name][2])
    cfg, params = hf.load_hf_checkpoint(str(tmp_path / "hf"), overrides={"scan_layers": False})
    assert "layers" not in params and "layers_0" in params
    assert _max_err(_our_logits(cfg, params, ids, mask, positions), _hf_logits(model, ids, mask, positions),
                    mask) <= 1e-4
    exported = hf.to_hf_tensors(cfg, params)
    original = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert all(np.array_equal(exported[k], original[k]) for k in exported)


@pytest.mark.hf
def test_config_fields_detected():
    cases = {name: hf.config_from_hf(CASES[name][0](**{**COMMON, **CASES[name][1]}).to_dict())
             for name in CASES}
    assert cases["qwen2"].qkv_bias and not cases["qwen2"].o_bias and not cases["qwen2"].qk_norm
    assert cases["qwen2"].sliding_window == 0 and cases["qwen2_sliding"].sliding_window == 4
    assert cases["qwen3"].qk_norm and cases["qwen3"].head_dim == 16
    assert cases["llama_bias"].qkv_bias and cases["llama_bias"].o_bias and cases["llama_bias"].mlp_bias
    assert cases["mistral_sliding"].sliding_window == 4
    assert cases["qwen3_tied"].tie_word_embeddings and cases["llama_mqa"].num_kv_heads == 1
    assert cases["llama3_rope"].rope_scaling_type == "llama3"
    assert cases["llama3_rope"].rope_original_max_position == 64
    assert cases["linear_rope"].rope_scaling_factor == 4.0


@pytest.mark.hf
@pytest.mark.parametrize("name", ["qwen2_sliding", "qwen3_tied", "llama_bias", "llama3_rope", "linear_rope",
                                  "mistral_sliding"])
def test_config_round_trips_through_transformers(name, tmp_path):
    cfg = hf.config_from_hf(CASES[name][0](**{**COMMON, **CASES[name][1]}).to_dict())
    (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(cfg)))
    assert hf.config_from_hf(transformers.AutoConfig.from_pretrained(tmp_path).to_dict()) == cfg


@pytest.mark.hf
def test_rope_scaling_changes_logits(tmp_path):
    """Guards the RoPE-scaling cases against being vacuous at the tested positions."""
    model = _hf_model("llama3_rope")
    model.save_pretrained(tmp_path)
    ids, mask, positions = _batch(CASES["llama3_rope"][2])
    cfg, params = hf.load_hf_checkpoint(str(tmp_path), overrides={"rope_scaling_type": "none"})
    unscaled = _our_logits(cfg, params, ids, mask, positions)
    assert _max_err(unscaled, _hf_logits(model, ids, mask, positions), mask) > 1e-2


@pytest.mark.hf
def test_bf16_checkpoint(tmp_path):
    model = _hf_model("qwen3")
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    model.to(torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    ids, mask, positions = _batch()
    # Reference: the bf16 weights upcast, fp32 compute (a fresh load, so RoPE tables stay fp32).
    upcast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    ref = _hf_logits(upcast, ids, mask, positions)
    original = _hf_logits(model, ids, mask, positions)
    cfg, params = hf.load_hf_checkpoint(str(tmp_path))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    err = _max_err(_our_logits(cfg, params, ids, mask, positions), ref, mask)
    cfg16, params16 = hf.load_hf_checkpoint(str(tmp_path), dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(params16)} == {jnp.dtype("bfloat16")}
    err16 = _max_err(_our_logits(cfg16, params16, ids, mask, positions), ref, mask)
    loose = _max_err(_our_logits(cfg, params, ids, mask, positions), original, mask)
    print(f"\n[parity] bf16 checkpoint   fp32 params max|dlogit|={err:.2e}  bf16 params={err16:.2e}  "
          f"vs the fp32 original={loose:.2e}")
    assert err <= 1e-4
    assert loose <= 0.5
    assert err16 <= 1e-4  # bf16 storage, fp32 compute: the same numbers


@pytest.mark.hf
def test_sharded_checkpoint_load_and_export(tmp_path):
    model = _hf_model("qwen2")
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ids, mask, positions = _batch()
    ref = _hf_logits(model, ids, mask, positions)
    cfg, params = hf.load_hf_checkpoint(str(tmp_path / "hf"))
    err = _max_err(_our_logits(cfg, params, ids, mask, positions), ref, mask)

    byte_level_tokenizer().save(str(tmp_path / "tok"))
    hf.export_hf_checkpoint(cfg, params, str(tmp_path / "export"), tokenizer_dir=str(tmp_path / "tok"),
                            max_shard_bytes=60_000)
    shards = sorted(p.name for p in (tmp_path / "export").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "export" / "model.safetensors.index.json").exists()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (258, 256)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "export")
    assert (config.eos_token_id, config.pad_token_id) == (258, 256)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager", dtype=torch.float32)
    export_err = _max_err(_hf_logits(reloaded.eval(), ids, mask, positions), ref, mask)
    print(f"\n[parity] sharded ckpt     load max|dlogit|={err:.2e}  export ({len(shards)} shards)={export_err:.2e}")
    assert err <= 1e-4
    assert export_err <= 1e-6


@pytest.mark.hf
def test_load_onto_8_device_mesh(tmp_path):
    if len(jax.devices()) < 8:
        pytest.fail("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 set before jax starts")
    model = _hf_model("qwen2")
    model.save_pretrained(tmp_path)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    cfg, params = hf.load_hf_checkpoint(str(tmp_path), mesh=mesh)
    expected = param_shardings(cfg, mesh)
    for (path, x), want in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(expected),
                               strict=True):
        assert x.sharding.is_equivalent_to(want, x.ndim), (path, x.sharding, want)
    specs = {s.spec for s in jax.tree.leaves(expected)}
    assert any(any(e is not None for e in spec) for spec in specs), "nothing sharded: weak test"
    ids, mask, positions = _batch()
    err = _max_err(_our_logits(cfg, params, ids, mask, positions), _hf_logits(model, ids, mask, positions), mask)
    _, single = hf.load_hf_checkpoint(str(tmp_path))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print(f"\n[parity] 8-device mesh    load max|dlogit|={err:.2e}")
    assert err <= 1e-4


# --- rlvr-only checks (no transformers needed at run time) ----------------------------------

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rope_theta=1e4)


def _random_params(cfg: ModelConfig):
    """Random numpy params, weights ~N(0, 0.2) (like HF's initializer_range=0.2), norms ~1."""
    rng = np.random.default_rng(1)

    def draw(path, x):
        name = path[-1].key
        if name == "scale":
            return (1.0 + 0.1 * rng.standard_normal(x.shape)).astype(np.float32)
        return (0.2 * rng.standard_normal(x.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(cfg))


@pytest.mark.parametrize("cfg", [
    ModelConfig(family="llama", qk_norm=False, qkv_bias=True, o_bias=True, mlp_bias=True, **TINY),
    ModelConfig(family="qwen3", tie_word_embeddings=True, **TINY),
], ids=["llama_all_biases", "qwen3_tied"])
def test_table_round_trip(cfg):
    params = _random_params(cfg)
    tensors = hf.to_hf_tensors(cfg, params)
    assert all(t.shape == hf.hf_shape(e, cfg) for e in hf.table_for(cfg) for t in
               (tensors[n] for n in e.names(cfg)))
    back = hf.from_hf_tensors(cfg, tensors)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert sum(t.size for t in tensors.values()) == cfg.num_params()


def test_each_shard_reads_only_its_rows(tmp_path, monkeypatch):
    cfg = ModelConfig(family="qwen2", qk_norm=False, qkv_bias=True, **TINY)
    params = _random_params(cfg)
    hf.export_hf_checkpoint(cfg, params, str(tmp_path))
    reads: list[tuple[str, tuple]] = []
    original = hf._Reader.slicer

    def recording_slicer(self, name):
        inner = original(self, name)
        return lambda index: reads.append((name, index)) or inner(index)

    monkeypatch.setattr(hf._Reader, "slicer", recording_slicer)
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4}, devices=jax.devices()[:8])
    _, loaded = hf.load_hf_checkpoint(str(tmp_path), mesh=mesh)
    q_reads = [idx for name, idx in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    rows = {(i[0].start, i[0].stop) for i in q_reads}
    cols = {(i[1].start, i[1].stop) for i in q_reads}
    assert rows == {(16 * h, 16 * (h + 1)) for h in range(4)}  # one head's rows per tensor shard
    assert cols == {(0, 32), (32, 64)}  # half the embed columns per fsdp shard
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_errors_name_the_field():
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="supported model types"):
        hf.config_from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_parameters.rope_type='yarn'"):
        hf.config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="rope_scaling.rope_type='dynamic'"):
        hf.config_from_hf({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    old_style = hf.config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}})
    assert (old_style.rope_theta, old_style.rope_scaling_type, old_style.rope_scaling_factor) == (
        5e5, "linear", 2.0)
    with pytest.raises(ValueError, match="qk_norm"):
        hf.config_to_hf(ModelConfig(family="llama", qk_norm=True, **TINY))


@pytest.mark.parametrize("window", [0, 3])
def test_kv_cache_decode_matches_full_forward(window):
    cfg = ModelConfig(family="qwen3", sliding_window=window, **TINY)
    params = _random_params(cfg)
    lengths, prompt_lengths = np.array([10, 6]), np.array([4, 2])
    seq = int(lengths.max())
    rng = np.random.default_rng(0)
    valid = np.arange(seq)[None] < lengths[:, None]
    tokens = rng.integers(0, VOCAB, (2, seq)) * valid
    positions = np.broadcast_to(np.arange(seq), (2, seq))
    step = jax.jit(forward, static_argnums=0)
    full = np.asarray(step(cfg, params, tokens, positions, valid.astype(np.int32))[0])

    width = int(prompt_lengths.max())
    prompt_seg = (np.arange(width)[None] < prompt_lengths[:, None]).astype(np.int32)
    logits, cache = step(cfg, params, tokens[:, :width] * prompt_seg, positions[:, :width], prompt_seg,
                         init_cache(cfg, 2, seq))
    err = float(np.abs(np.asarray(logits) - full[:, :width])[prompt_seg.astype(bool)].max())
    for k in range(seq - int(prompt_lengths.min())):
        pos = prompt_lengths + k
        live = pos < lengths
        pos = np.minimum(pos, seq - 1)
        tok = np.where(live, tokens[np.arange(2), pos], 0)
        logits, cache = step(cfg, params, tok[:, None], pos[:, None], live[:, None].astype(np.int32), cache)
        diff = np.abs(np.asarray(logits)[:, 0] - full[np.arange(2), pos])[live]
        err = max(err, float(diff.max()) if diff.size else 0.0)
    print(f"\n[kv-cache] window={window} prefill+decode vs full forward max|dlogit|={err:.2e} "
          f"(max|logit|={np.abs(full).max():.1f})")
    assert np.abs(full).max() > 1.0
    assert err <= 1e-5
