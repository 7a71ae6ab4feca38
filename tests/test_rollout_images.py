"""The rollout engine on image prompts (a Qwen2.5-VL-layout VLM) against a naive full forward of the
VLM, the trainer's log-probs, and itself: images are prefilled in chunks at their placeholders with
M-RoPE ids, decoding continues with the prompt's M-RoPE delta, and the prefix cache keys pages by
image content."""

import base64
import dataclasses
import io
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from rlvr import losses
from rlvr.data import images as images_lib
from rlvr.models import vision
from rlvr.models.config import ModelConfig, VisionConfig
from rlvr.models.params import abstract_params
from rlvr.models.transformer import forward
from rlvr.rollout.engine import Engine
from rlvr.rollout.types import Request, SamplingParams

VS, VE, IMG = 320, 321, 322  # the image tokens of configs/data/vlm_tokenizer (a BPE with a chat template)
TOKENIZER = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "data", "vlm_tokenizer")
CFG = dataclasses.replace(
    ModelConfig(family="qwen2", vocab_size=328, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, qkv_bias=True, qk_norm=False, mrope_section=(2, 3, 3)),
    vision=VisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, out_hidden_size=64,
                        window_size=56, full_attention_layers=(1,), image_token_id=IMG, vision_start_token_id=VS,
                        vision_end_token_id=VE))
OPTS = dict(max_slots=4, max_len=128, page_size=8, decode_steps=4, prefill_rows=2, prefill_chunk=16)


@pytest.fixture(scope="module")
def params():
    rng = np.random.default_rng(1)
    return jax.tree_util.tree_map_with_path(  # O(1) logits, so a wrong id, mask or feature shows
        lambda path, s: jnp.ones(s.shape) if path[-1].key == "scale" else jnp.asarray(rng.normal(0, 0.2, s.shape),
                                                                                        jnp.float32),
        abstract_params(CFG))


def _png(seed: int, size=(84, 56)) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _prompt(before: int, after: int, seed: int = 0) -> list[int]:
    """Text, one unexpanded image block (as a chat template writes it), text."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 280, before).tolist() + [VS, IMG, VE] + rng.integers(0, 280, after).tolist()


@jax.jit
def _vlm_logits(params, tokens, segments, inputs):
    return forward(CFG, params, tokens, None, segments, images=inputs)[0]


def _naive_greedy(params, prompt, image, steps, width=96):
    """Reference: the whole VLM (vision tower, placeholders, M-RoPE ids from the full sequence) over
    prompt + output so far, for every new token; (tokens, their log-probs)."""
    patches, grids = images_lib.preprocess([image], CFG.vision)
    ids = []
    for t in prompt:
        ids += [IMG] * images_lib.placeholder_count(grids[0], CFG.vision) if t == IMG else [t]
    out, logprobs = [], []
    for _ in range(steps):
        seq = ids + out
        buffer = np.zeros((1, width), np.int32)
        buffer[0, :len(seq)] = seq
        segments = (np.arange(width) < len(seq)).astype(np.int32)[None]
        inputs = vision.image_inputs(CFG.vision, [patches], [grids], buffer, segments)
        logits = np.asarray(_vlm_logits(params, jnp.asarray(buffer), jnp.asarray(segments), inputs))[0, len(seq) - 1]
        out.append(int(logits.argmax()))
        logprobs.append(float(jax.nn.log_softmax(logits)[out[-1]]))
    return ids, out, logprobs


@jax.jit
def _trainer_logprobs(params, tokens, segments, inputs):
    return losses.model_token_logprobs(CFG, params, tokens, None, segments, chunk_size=16, images=inputs)[0]


def _req(rid, prompt, image, **sampling):
    return Request(rid, prompt, SamplingParams(**{"max_new_tokens": 6, "temperature": 0.0, **sampling}),
                   image_data=[image])


def test_image_prompts_decode_as_the_full_vlm_and_the_prefix_cache_keys_images(params):
    """Greedy tokens and log-probs of image prompts (the image across a chunk boundary, a prompt
    longer than a chunk) equal a naive full VLM forward; the trainer's log-probs of the same tokens
    equal the engine's to 1e-5; a second request with the same image reuses its pages, one with a
    different image behind the same placeholder tokens does not, and decodes differently."""
    engine = Engine(CFG, params, **OPTS)
    red, blue = _png(0), _png(1)
    prompts = [(_prompt(11, 9), red), (_prompt(3, 30, seed=1), blue)]
    outs = engine.generate([_req(f"r{i}", p, img) for i, (p, img) in enumerate(prompts)])
    for (prompt, image), out in zip(prompts, outs, strict=True):
        ids, tokens, logprobs = _naive_greedy(params, prompt, image, 6)
        assert out.prompt_ids == ids and out.output_ids == tokens
        np.testing.assert_allclose(out.output_logprobs, logprobs, atol=1e-5)
        # the trainer: chunked log-probs of prompt + output with the batch's ImageInputs
        seq, segments = np.zeros((1, 96), np.int32), np.zeros((1, 96), np.int32)
        seq[0, :len(ids) + len(tokens)], segments[0, :len(ids) + len(tokens)] = ids + tokens, 1
        patches, grids = images_lib.preprocess([image], CFG.vision)
        trainer = _trainer_logprobs(params, seq, segments, vision.image_inputs(CFG.vision, [patches], [grids], seq,
                                                                               segments))
        np.testing.assert_allclose(np.asarray(trainer)[0, len(ids) - 1:len(ids) + len(tokens) - 1],
                                   out.output_logprobs, atol=1e-5)

    # prefix cache: same prompt tokens and image -> pages reused, same tokens; another image -> not
    same, other = engine.generate([_req("same", prompts[0][0], red)]), None
    assert same[0].cached_tokens >= 16 and same[0].output_ids == outs[0].output_ids
    other = engine.generate([_req("other", prompts[0][0], blue)])[0]
    assert other.prompt_ids == outs[0].prompt_ids  # the same placeholder tokens ...
    assert other.cached_tokens <= 8  # ... but only the page before the image is shared
    assert other.output_ids == _naive_greedy(params, prompts[0][0], blue, 6)[1] != outs[0].output_ids


def test_images_are_read_by_the_weights_that_prefill_them(params):
    """A weight update between submit and prefill (async RL: requests queue while the trainer
    pushes weights) must not leave the image encoded by the old vision tower beside text read by
    the new decoder: the outputs equal a naive full VLM forward under the new weights. The update
    compiles nothing new (uncommitted construction params used to key every program anew)."""
    engine = Engine(CFG, params, **OPTS)
    prompt, image = _prompt(5, 4), _png(2)
    engine.generate([_req("warm", prompt, image)])
    compiles = {k: v for k, v in engine.metrics().items() if k.startswith("compiles")}
    engine.submit(_req("queued", prompt, image))
    new = dict(params, visual=jax.tree.map(lambda x: -x, params["visual"]))
    engine.update_weights(new, 1)
    out = None
    while engine.waiting or engine.num_running:
        for completion in engine.step():
            out = completion
    ids, tokens, logprobs = _naive_greedy(new, prompt, image, 6)
    assert out.prompt_ids == ids and out.output_ids == tokens
    np.testing.assert_allclose(out.output_logprobs, logprobs, atol=1e-5)
    assert {k: v for k, v in engine.metrics().items() if k.startswith("compiles")} == compiles


def test_a_generated_image_placeholder_is_cut_off_and_never_reaches_the_trainer():
    """A VLM policy that samples `<|image_pad|>` in its answer (a run at lr 1e-3 did while collapsing) crashed
    the step: the batch builder found placeholders with no image behind them. The producer now cuts the
    output before the first one and records the sample as a failure (not trained on)."""
    from rlvr.rl.batching import Sample, build_batch
    from rlvr.rl.producer import without_image_placeholders
    from rlvr.rollout.types import Completion

    image = _png(0)
    _, grids = images_lib.preprocess([image], CFG.vision)
    prompt = [5, VS] + [IMG] * images_lib.placeholder_count(grids[0], CFG.vision) + [VE, 6]
    completion = Completion("r", prompt, [7, 8, IMG, 9], [-1.0, -2.0, -3.0, -4.0], [0, 0, 0, 0],
                            {"type": "stop", "matched": 9})
    cut, position = without_image_placeholders(completion, CFG.vision)
    assert position == 2 and cut.output_ids == [7, 8] and cut.output_logprobs == [-1.0, -2.0]
    assert cut.output_versions == [0, 0] and cut.finish_reason == {"type": "length", "length": 2}
    assert without_image_placeholders(completion, None) == (completion, None)
    assert without_image_placeholders(cut, CFG.vision) == (cut, None)

    def batch(c):
        sample = Sample(0, 0, c.prompt_ids, c.output_ids, c.output_logprobs, c.output_versions, False, {"reward": 0.0},
                        images=[image])
        return build_batch([sample], 64, 0, vision=CFG.vision)

    with pytest.raises(ValueError, match="image placeholders"):
        batch(completion)
    tokens = batch(cut)["tokens"][0]
    assert tokens[:len(prompt) + 2].tolist() == prompt + [7, 8] and IMG not in tokens[len(prompt):].tolist()


def test_image_requests_are_checked(params):
    engine = Engine(CFG, params, **OPTS)
    with pytest.raises(ValueError, match="image_data has 2 images"):
        engine.submit(Request("x", _prompt(2, 2), image_data=[_png(0), _png(1)]))
    text_only = Engine(dataclasses.replace(CFG, vision=None), {k: v for k, v in params.items() if k != "visual"},
                       **OPTS)
    with pytest.raises(ValueError, match="no vision encoder"):
        text_only.submit(Request("y", _prompt(2, 2), image_data=[_png(0)]))


def test_openai_image_url_parts_and_sglang_image_data_reach_the_engine(params):
    """The `openai` SDK's chat request with an `image_url` part (a base64 PNG data URL), SGLang's
    `/generate` with `image_data` (a data URL, raw base64, a batch's per-prompt entries) and rlvr's
    SGLang client (rl.backend='sglang') give the tokens the engine gives that chat prompt and image
    directly; a text-only server refuses image parts with a 400 naming them."""
    import httpx
    import openai

    from rlvr.models.tokenizer import Tokenizer
    from rlvr.rollout.client import SGLangClient
    from rlvr.rollout.driver import EngineDriver
    from rlvr.rollout.server import serve

    tokenizer = Tokenizer.from_dir(TOKENIZER)
    engine = Engine(CFG, params, tokenizer, **OPTS)
    image = _png(2)
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is bar A?"}]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"
                                           "What is bar A?"}], add_generation_prompt=True)
    assert chat.count(IMG) == 1
    direct = engine.generate([_req("d", chat, image, ignore_eos=True)])[0]
    driver = EngineDriver(engine)
    server, _ = serve(driver)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                               max_tokens=6, temperature=0.0,
                                               extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = reply.choices[0].model_dump()
        assert choice["token_ids"] == direct.output_ids and choice["prompt_token_ids"] == direct.prompt_ids
        body = {"input_ids": chat, "image_data": image, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0,
                                                                              "ignore_eos": True}}
        out = httpx.post(server.url + "/generate", json=body, timeout=120).json()
        assert out["output_ids"] == direct.output_ids
        bad = httpx.post(server.url + "/generate", json={**body, "image_data": [image, image]}, timeout=60)
        assert bad.status_code == 400 and "image_data has 2 images" in bad.json()["error"]["message"]
        # SGLang's other shapes (GenerateReqInput): raw base64 (sglang.lang sends that), and a batch with one
        # entry per prompt, a bare string or a list of that prompt's images
        raw = httpx.post(server.url + "/generate", json={**body, "image_data": image.split(",", 1)[1]}, timeout=120)
        assert raw.json()["output_ids"] == direct.output_ids
        batch = httpx.post(server.url + "/generate", json={**body, "input_ids": [chat, direct.prompt_ids],
                                                            "image_data": [image, [image]]}, timeout=120).json()
        assert [o["output_ids"] for o in batch] == [direct.output_ids] * 2
        # rl.backend='sglang': rlvr's SGLang client sends a VLM rollout request (expanded placeholders, as the
        # producer lays them out) with its image as image_data, and gets the engine's tokens and log-probs
        client = SGLangClient([server.url], timeout=120)
        sent = client.payload(_req("c", direct.prompt_ids, image, ignore_eos=True), "c")
        assert sent["image_data"] == [image]
        got = client.generate_sync([_req("c", direct.prompt_ids, image, ignore_eos=True)])[0]
        assert got.output_ids == direct.output_ids
        np.testing.assert_allclose(got.output_logprobs, direct.output_logprobs, atol=1e-5)
    finally:
        server.stop()
        driver.close()
    # a text-only model's server (its limits lack "images") refuses the part before any engine sees it
    from types import SimpleNamespace

    from rlvr.rollout.server_openai import _parse_chat
    from rlvr.rollout.server_protocol import ApiError, ModelLimits

    text_only = SimpleNamespace(limits=ModelLimits(CFG.vocab_size, 128, tokenizer))
    with pytest.raises(ApiError, match=r"messages\[0\].content\[0\] \(an image_url part\) is not supported"):
        _parse_chat(text_only, {"messages": [{"role": "user", "content": content}], "max_tokens": 2})


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """A workdir of `rlvr.main.run` of configs/vlm.py:smoke (SFT warm start, then one GRPO step)."""
    from rlvr import config_lib, main

    workdir = str(tmp_path_factory.mktemp("vlm") / "run")
    config = config_lib.load_config("configs/vlm.py:smoke", {"train.num_steps": 1, "rl.sft_steps": 1})
    return workdir, main.run(config, workdir)


def test_vlm_sft_then_rl_on_chart_tasks(vlm_run):
    """`rlvr.main.run` of configs/vlm.py:smoke: a random VLM's SFT warm start on rendered charts,
    then GRPO whose rollouts prefill the charts: the trainer scores the engine's tokens with the
    images (log-prob mismatch ~0; without them it would be O(1)) and the prompts carry the
    expanded placeholders (51 tokens: 12 of them the chart's)."""
    import json

    workdir, summary = vlm_run
    assert summary["job"] == "rl" and summary["final_step"] == 1
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "1"))
    with open(os.path.join(workdir, "sft", "summary.json")) as f:
        assert np.isfinite(json.load(f)["final_loss"])
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if '"logprob_mismatch"' in line]
    assert steps and all(s["logprob_mismatch"] <= 1e-5 and s["prompt_length"] == 51 for s in steps)


@pytest.mark.hf
def test_a_trained_vlm_exports_to_transformers(vlm_run, tmp_path, capsys):
    """`python -m rlvr.export VLM_WORKDIR --out DIR --verify` writes a Qwen2.5-VL directory that
    transformers loads (with its image processor) and passes: chat-template ids and greedy tokens equal,
    logits on a prompt with two images within 1e-4 of ours, where the images move them by far more.
    The same check on the export with one vision weight changed fails."""
    import re

    from safetensors.numpy import load_file, save_file

    from rlvr import api, export

    out = str(tmp_path / "hf")
    assert export.main([vlm_run[0], f"--out={out}", "--verify"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "2 images" in x)
    gap, effect = (float(v) for v in re.search(r"max\|dlogit\|=(\S+) .*move ours by (\S+);", line).groups())
    assert gap <= 1e-4 and effect > 100 * max(gap, 1e-6)
    weights = load_file(os.path.join(out, "model.safetensors"))
    weights["visual.merger.mlp.2.bias"] = weights["visual.merger.mlp.2.bias"] + 1.0
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    assert export.verify_image_logits(export.merged(api.load_trained(vlm_run[0])), out)["max_abs_diff"] > 1e-3
