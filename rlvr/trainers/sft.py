"""Supervised fine-tuning (and plain next-token training): loss on the masked target tokens.

Read top to bottom: tokenizer and model → data stream (chat JSONL rendered with the model's
chat template, loss on assistant tokens only; or text; or the built-in arithmetic corpus)
→ the shared training loop → held-out evaluation → summary.json.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlvr import api, losses, observe
from rlvr.data import shards
from rlvr.data.arithmetic import ArithmeticData
from rlvr.data.chat import check_tool_calls, encode_record, uses_tools
from rlvr.data.images import ImageTokenStream, check_image_tokens, encode_image_record, uses_images
from rlvr.data.sources import load_records
from rlvr.data.stream import TokenStream
from rlvr.job import Job
from rlvr.models.generate import greedy_generate
from rlvr.models.transformer import forward
from rlvr.models.vision import batch_images
from rlvr.trainers.loop import train_loop


def sft_loss(cfg, params, batch, rng, frozen, *, logprob_chunk_size: int = 0):
    """Sum of target-token NLL; weight = number of target tokens. `logprob_chunk_size` > 0
    (`train.logprob_chunk_size`): log-probs in chunks of that many positions, never the full logits."""
    del frozen
    images = batch_images(batch)  # a VLM's batch of image records (rlvr.data.images.ImageTokenStream)
    if logprob_chunk_size:
        logp, _, _ = losses.model_token_logprobs(cfg, params, batch["tokens"], batch["positions"],
                                                 batch["segment_ids"], chunk_size=logprob_chunk_size, rng=rng,
                                                 images=images)
    else:
        logits, _ = forward(cfg, params, batch["tokens"], batch["positions"], batch["segment_ids"], rng=rng,
                            images=images)
        logp = losses.next_token_logprobs(logits, batch["tokens"])
    mask = losses.target_mask(batch["loss_mask"], batch["segment_ids"])
    return -jnp.sum(logp * mask), {"weight": mask.sum(), "target_tokens": mask.sum()}


def distill_loss(cfg, teacher_cfg, top_k: int, weight: float, chunk_size: int, params, batch, rng, frozen):
    """Logit distillation (`distill.*`, rlvr.losses.distill): Σ over target tokens of (1 - weight)·NLL +
    weight·KL(teacher top-k ‖ student); `frozen["teacher"]`: the teacher's params. Reports both terms."""
    from rlvr.losses.distill import model_hidden_and_head, topk_forward_kl

    args = (batch["tokens"], batch["positions"], batch["segment_ids"])
    x, head, tied = model_hidden_and_head(cfg, params, *args, rng=rng)
    xt, head_t, tied_t = model_hidden_and_head(teacher_cfg, frozen["teacher"], *args)
    logp, kl = topk_forward_kl(x, head, xt, head_t, batch["tokens"][:, 1:], top_k=top_k, chunk_size=chunk_size,
                               student_vocab_major=tied, teacher_vocab_major=tied_t)
    mask = losses.target_mask(batch["loss_mask"], batch["segment_ids"]).astype(jnp.float32)
    nll, kl = -jnp.sum(logp * mask), jnp.sum(kl * mask)
    return (1 - weight) * nll + weight * kl, {"weight": mask.sum(), "target_tokens": mask.sum(), "nll": nll,
                                              "distill_kl": kl}


def configured_loss(config: ml_collections.ConfigDict, cfg):
    """`sft_loss` for this model with the config's loss options (`train.logprob_chunk_size`)."""
    return functools.partial(sft_loss, cfg, logprob_chunk_size=config.train.get("logprob_chunk_size", 0))


def _image_stream(config: ml_collections.ConfigDict, tokenizer, vision, records, encode=None, evaluation=False):
    """The stream of records with image content parts (a VLM: `model.vision`); `encode` None: encode them.
    `evaluation`: in file order, each record once (`TokenStream.one_epoch`)."""
    d = config.data
    if vision is None:
        raise api.ConfigError(f"the data ({d.path or d.tfds_name}) has image content parts but the model has no "
                              "vision encoder: start from a VLM checkpoint (init.hf_checkpoint, Qwen2.5-VL layout).")
    try:
        check_image_tokens(tokenizer, vision)
    except ValueError as e:
        raise api.ConfigError(str(e)) from None
    encode = encode or functools.partial(encode_image_record, tokenizer, vision, max_pixels=d.image_max_pixels)
    return ImageTokenStream(records, encode, d.batch_size, d.seq_len, tokenizer.pad_id, config.seed, vision,
                            d.image_patches, pack=d.pack, shuffle=not evaluation, one_epoch=evaluation)


def build_data(config: ml_collections.ConfigDict, tokenizer, split: str | None = None, vision=None):
    d = config.data
    if d.source == "arithmetic":
        return ArithmeticData(tokenizer, d.batch_size, d.seq_len, config.seed, d.max_operand)
    records = load_records(d, split)
    if any(uses_images(r) for r in records):
        return _image_stream(config, tokenizer, vision, records)
    if any(uses_tools(r) for r in records):
        try:
            check_tool_calls(tokenizer, f"the data ({d.path or d.tfds_name})")
        except ValueError as e:
            raise api.ConfigError(str(e)) from None
    return TokenStream(records, functools.partial(encode_record, tokenizer), d.batch_size, d.seq_len,
                       tokenizer.pad_id, config.seed, pack=d.pack)


def evaluate_arithmetic(model: api.Model, tokenizer, data: ArithmeticData, count: int) -> float:
    """Greedy exact-match accuracy on held-out problems."""
    problems = data.problems(count, stream=1)
    prompts = [tokenizer.encode(p) for p, _ in problems]
    outputs = greedy_generate(model.cfg, model.params, prompts, 8, tokenizer.eos_id, tokenizer.pad_id)
    answers = [tokenizer.decode([t for t in out if t != tokenizer.eos_id]) for out in outputs]
    return float(np.mean([a == ref for a, (_, ref) in zip(answers, problems, strict=True)]))


def evaluate_loss(config: ml_collections.ConfigDict, model: api.Model, tokenizer) -> float | None:
    """Mean target-token NLL over (up to `train.eval_examples`) held-out records. Text records are split
    like training batches (rlvr.data.shards): each process encodes only its rows' records; records with
    images are encoded by every process (a VLM's batch sizes its image arrays by the whole batch)."""
    d = config.data
    held_out = d.eval_path if d.source == "jsonl" else d.eval_split
    if not held_out:
        return None
    records = load_records(d, "eval" if d.source == "jsonl" else d.eval_split)
    records = [records[i] for i in range(min(len(records), config.train.eval_examples))]
    if not any(uses_images(r) for r in records):
        stream = TokenStream(records, functools.partial(encode_record, tokenizer), d.batch_size, d.seq_len,
                             tokenizer.pad_id, 0, d.pack, shuffle=False, one_epoch=True)
        return _row_split_loss(config, model, stream)
    stream = _image_stream(config, tokenizer, model.cfg.vision, records, evaluation=True)
    loss_fn = jax.jit(configured_loss(config, model.cfg))
    total, weight = 0.0, 0.0
    while not stream.exhausted():
        loss_sum, aux = loss_fn(model.params, next(stream), None, None)
        total, weight = total + float(loss_sum), weight + float(aux["weight"])
    return total / max(weight, 1.0)


def _row_split_loss(config: ml_collections.ConfigDict, model: api.Model, stream: TokenStream) -> float:
    """The mean loss over `stream`'s first epoch, each process building only its rows of each batch; the
    rows' cursors are merged after each batch, so every process agrees on when the epoch is done."""
    loss_fn = jax.jit(configured_loss(config, model.cfg))
    total, weight = 0.0, 0.0
    while not stream.exhausted():
        loss_sum, aux = shards.apply_by_rows(lambda p, batch: loss_fn(p, batch, None, None), model.params,
                                             stream.next_rows, stream.shapes(), model.mesh)
        shards.merged_state(stream)
        total, weight = total + float(loss_sum), weight + float(aux["weight"])
    print(f"held-out: process {jax.process_index()} of {jax.process_count()} encoded {stream.records_read} records "
          f"(of a {len(stream.source)}-record set)")
    return total / max(weight, 1.0)


def train(job: Job) -> dict[str, Any]:
    """The SFT job (`job`: resolved by `rlvr.job.resolve`): train, evaluate, write summary.json."""
    config, workdir, tokenizer = job.config, job.workdir, job.tokenizer
    model = job.build_model()
    data = build_data(config, tokenizer, vision=model.cfg.vision)
    tokens_per_batch = config.data.batch_size * config.data.seq_len
    loss_fn, frozen, frozen_sharding = configured_loss(config, model.cfg), None, None
    if config.distill.teacher:
        d = config.distill
        teacher_cfg, teacher = api.load_teacher(d.teacher, model.mesh, tokenizer.vocab_size, "distill.teacher")
        loss_fn = functools.partial(distill_loss, model.cfg, teacher_cfg, d.top_k, d.weight, d.chunk_size)
        frozen = {"teacher": teacher}
        frozen_sharding = jax.tree.map(lambda x: x.sharding, frozen)
    result = train_loop(job, model, loss_fn, data, tokens_per_batch, frozen, frozen_sharding)
    final = api.Model(model.cfg, result.params, model.mesh)
    summary: dict[str, Any] = {"job": "sft", "final_step": config.train.num_steps,
                               "final_loss": result.last_metrics.get("loss"),
                               "tokens_per_s": result.last_metrics.get("tokens_per_s"),
                               "mfu": result.last_metrics.get("mfu")}
    if isinstance(data, ArithmeticData):
        summary["heldout_accuracy"] = evaluate_arithmetic(final, tokenizer, data, config.train.eval_examples)
    eval_loss = evaluate_loss(config, final, tokenizer)
    if eval_loss is not None:
        summary["heldout_loss"] = eval_loss
    write_summary(workdir, summary)
    return summary


def write_summary(workdir: str, summary: dict[str, Any]) -> None:
    with observe.open_log(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print("summary: " + json.dumps(summary))
