"""Paged decode attention (rlvr.kernels.paged_attention): the Pallas kernel (interpret mode on CPU),
the native CPU kernel and the XLA implementations against a dense numpy reference built by gathering each row's pages,
over drawn page sizes, lengths, GQA groups, query counts and sliding windows; against the model's
own decode attention on its paged cache; implementation choice and shape errors."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlvr.kernels.paged_attention import paged_attention, ragged_pages

from rlvr.models import transformer


def dense_reference(q, k_pool, v_pool, table, lengths, window=0, softcap=0.0):
    """numpy: gather row b's pages into dense [S, KVH, D] keys/values; query i of row b is at
    position lengths[b] - Q + i and sees keys at positions <= its own (inside the window)."""
    b, nq, h, d = q.shape
    kvh = k_pool.shape[2]
    out = np.zeros((b, nq, h, d), np.float64)
    for row in range(b):
        keys = k_pool[table[row]].reshape(-1, kvh, d).astype(np.float64)
        values = v_pool[table[row]].reshape(-1, kvh, d).astype(np.float64)
        kv_pos = np.arange(keys.shape[0])
        for i in range(nq):
            t = lengths[row] - nq + i
            seen = (kv_pos <= t) & (kv_pos < lengths[row])
            if window:
                seen &= t - kv_pos < window
            if not seen.any():
                continue
            for head in range(h):
                kv = head // (h // kvh)
                s = keys[seen, kv] @ q[row, i, head].astype(np.float64) / np.sqrt(d)
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[row, i, head] = (p / p.sum()) @ values[seen, kv]
    return out


@functools.partial(jax.jit, static_argnames=("window", "softcap", "layered"))
def _all(q, k, v, table, lengths, layer, ragged, *, window, softcap, layered):
    kw = dict(layer=layer if layered else None, sliding_window=window, softcap=softcap)
    outs = [paged_attention(q, k, v, table, lengths, implementation="pallas", interpret=True, **kw),
            paged_attention(q, k, v, table, lengths, implementation="xla", **kw),
            paged_attention(q, k, v, table, lengths, implementation="native", **kw)]
    if q.shape[1] == 1:  # the ragged implementation: one query per row, pages as a flat list
        outs.append(paged_attention(q, k, v, table, lengths, implementation="ragged", ragged=ragged, **kw))
    return outs


@settings(max_examples=24, deadline=None, derandomize=True)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4, 8]), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([4, 8]), batch=st.integers(1, 3),
       pages_per_row=st.integers(1, 4), queries=st.sampled_from([1, 1, 2, 3]), layered=st.booleans(),
       softcap=st.sampled_from([0.0, 0.0, 5.0]), seed=st.integers(0, 2**16))
def test_matches_dense_reference(data, page_size, kv_heads, group, head_dim, batch, pages_per_row, queries, layered,
                                 softcap, seed):
    rng = np.random.default_rng(seed)
    capacity = page_size * pages_per_row
    lengths = np.array(data.draw(st.lists(st.integers(0, capacity), min_size=batch, max_size=batch)), np.int32)
    window = data.draw(st.sampled_from([0, 1, max(capacity // 2, 1), capacity + 3]))
    num_pages = batch * pages_per_row + 2
    # Rows share pages (a shared prompt prefix); unused table entries point at page 0, whose
    # contents (large, never to be read) would show up in any output that attended to them.
    table = rng.integers(1, num_pages, (batch, pages_per_row)).astype(np.int32)
    for row in range(batch):
        table[row, -(-int(lengths[row]) // page_size):] = 0
    layers = 3 if layered else 1
    shape = (layers, num_pages, page_size, kv_heads, head_dim)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    k[:, 0], v[:, 0] = 1e4, 1e4
    layer = int(rng.integers(0, layers))
    q = rng.standard_normal((batch, queries, kv_heads * group, head_dim)).astype(np.float32)
    pool_k, pool_v = (k, v) if layered else (k[0], v[0])
    ragged = ragged_pages(table, lengths, page_size, block_pages=2, blocks_per_chunk=2)  # several chunks, padded
    outs = _all(q, pool_k, pool_v, table, lengths, np.int32(layer), ragged, window=window, softcap=softcap,
                layered=layered)
    want = dense_reference(q, k[layer], v[layer], table, lengths, window, softcap)
    for got in outs:
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_ragged_reads_a_shared_prefix_once_for_its_rows():
    """Rows 0-8 hold the same first three pages (a group's prompt; more rows than one shared block
    serves): the ragged builder lists those blocks once for several rows, and the attention still
    equals the dense reference for every row (different lengths, an idle row, a sliding window)."""
    rng = np.random.default_rng(0)
    page_size, kv_heads, group, head_dim, width, pages = 2, 2, 2, 8, 6, 80
    table = rng.integers(1, pages, (11, width)).astype(np.int32)
    table[1:9, :3] = table[0, :3]
    lengths = np.array([7, 5, 12, 3, 6, 11, 9, 6, 2, 0, 12], np.int32)
    for row in range(11):
        table[row, -(-int(lengths[row]) // page_size):] = 0
    shape = (2, pages, page_size, kv_heads, head_dim)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    k[:, 0], v[:, 0] = 1e4, 1e4
    q = rng.standard_normal((11, kv_heads * group, head_dim)).astype(np.float32)
    for block_pages, most in ((1, 8), (3, 7)):  # 3 pages: rows 3 and 8 hold fewer of the block's pages
        ragged = ragged_pages(table, lengths, page_size, block_pages=block_pages, blocks_per_chunk=2)
        assert (np.asarray(ragged.shared_rows) < 11).sum(axis=-1).max() == most
        for window in (0, 4):
            got = paged_attention(q, k, v, table, lengths, layer=1, implementation="ragged", ragged=ragged,
                                  sliding_window=window)
            want = dense_reference(q[:, None], k[1], v[1], table, lengths, window)[:, 0]
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16", "bits"])
def test_native_reads_shared_pages_once_per_cluster_and_matches_the_reference(pool_dtype):
    """The native kernel attends rows sharing their first pages together (a group's prompt) and
    reads a page once for the rows that hold it at that position. Here 19 rows share their first
    3 pages (more than one cluster of 16 holds), rows 3-6 share two more pages than the others (a
    subset), row 9 also holds the shared pages at other positions, row 10 is idle, lengths differ;
    with and without a sliding window, pools of float32, bfloat16 and bf16 stored as uint16 bits:
    every row equals the dense reference (mutation: a page read for every row of its pass,
    whether it holds the page or not, fails)."""
    from rlvr.kernels.bits import as_bits

    rng = np.random.default_rng(4)
    rows, page_size, kv_heads, group, head_dim, width, pages = 21, 4, 2, 4, 16, 9, 120
    table = rng.integers(1, pages, (rows, width)).astype(np.int32)
    table[:19, :3] = table[0, :3]
    table[3:7, 3:5] = table[3, 3:5]
    table[9, 4:7] = table[0, :3]
    lengths = rng.integers(13, width * page_size + 1, rows).astype(np.int32)
    lengths[10] = 0
    for row in range(rows):
        table[row, -(-int(lengths[row]) // page_size):] = 0
    shape = (2, pages, page_size, kv_heads, head_dim)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    k[:, 0], v[:, 0] = 1e4, 1e4
    if pool_dtype != "float32":
        k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (k, v))
    pool_k, pool_v = jnp.asarray(k), jnp.asarray(v)
    if pool_dtype != "float32":
        pool_k, pool_v = pool_k.astype(jnp.bfloat16), pool_v.astype(jnp.bfloat16)
    if pool_dtype == "bits":
        pool_k, pool_v = as_bits(pool_k), as_bits(pool_v)
    q = rng.standard_normal((rows, kv_heads * group, head_dim)).astype(np.float32)
    for window in (0, 10):
        got = paged_attention(q, pool_k, pool_v, table, lengths, layer=1, implementation="native",
                              sliding_window=window)
        want = dense_reference(q[:, None], k[1], v[1], table, lengths, window)[:, 0]
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(np.asarray(got)[10], 0.0)


@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16"])
def test_native_kernel_at_model_shapes_with_prefill_chunks(pool_dtype):
    """The native kernel at model shapes (16-token pages, head_dim 64 and 128: 8 and 16 channel
    blocks): lone rows with 1-4 queries per kv head (its row path), and prefill-like chunks of 40
    queries per row (work items of a slice of a row's or a cluster's queries, each reading only
    the keys its queries see), with rows 0-2 sharing their first two pages in the chunked cases;
    lengths that end mid-block, an idle row, a sliding window, and query ends past the table
    (`lengths` > R·P: a prefill chunk's padded end, whose queries there are padding and read only
    the table's keys). Equals the dense reference."""
    from rlvr.kernels.paged_attention.native import native_paged_attention

    rng = np.random.default_rng(7)
    rows, page_size, kv_heads, width = 7, 16, 2, 5
    for head_dim, group, queries in ((64, 2, 1), (64, 1, 1), (128, 4, 1), (64, 1, 3), (64, 2, 2), (64, 2, 40),
                                     (64, 4, 40)):
        table = rng.permutation(np.arange(1, rows * width + 1)).reshape(rows, width).astype(np.int32)
        if queries > 4:
            table[1:3, :2] = table[0, :2]
        lengths = np.array([41, 57, 46, 37, 80, 0, 80 + queries - 1], np.int32)
        lengths[:4] = np.maximum(lengths[:4], queries) if queries > 4 else [1, 9, 16, 37]
        shape = (3, rows * width + 1, page_size, kv_heads, head_dim)
        k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
        if pool_dtype != "float32":
            k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (k, v))
        q = rng.standard_normal((rows, queries, kv_heads * group, head_dim)).astype(np.float32)
        for window in (0, 21):
            got = native_paged_attention(jnp.asarray(q), jnp.asarray(k, pool_dtype), jnp.asarray(v, pool_dtype),
                                         jnp.asarray(table), jnp.asarray(lengths), layer=2, sliding_window=window)
            want = dense_reference(q, k[2], v[2], table, lengths, window)
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5,
                                       err_msg=f"head_dim {head_dim}, group {group}, queries {queries}, "
                                               f"window {window}")


def test_single_query_bfloat16_traced_layer():
    """q [B, H, D] in bfloat16, the layer index traced (as in a scan over layers); the ragged
    path's products take bf16 inputs from bf16 pages (float32 accumulation)."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((2, 9, 4, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 9, 4, 2, 16)).astype(np.float32)
    table = np.array([[3, 1, 0], [5, 6, 7]], np.int32)
    lengths = np.array([6, 12], np.int32)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    ragged = ragged_pages(table, lengths, 4)

    @jax.jit
    def run(q, k, v):
        def layer_out(_, layer):
            return None, [paged_attention(q, k, v, table, lengths, layer=layer, implementation=impl, interpret=True,
                                          ragged=ragged if impl == "ragged" else None)
                          for impl in ("pallas", "xla", "ragged", "native")]
        return jax.lax.scan(layer_out, None, jnp.arange(2))[1]

    outs = run(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16))
    for impl_out in outs:
        assert impl_out.dtype == jnp.bfloat16 and impl_out.shape == (2, 2, 4, 16)
        for layer in range(2):
            want = dense_reference(q[:, None], k[layer], v[layer], table, lengths)[:, 0]
            np.testing.assert_allclose(np.asarray(impl_out[layer], np.float32), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("window", [0, 5])
def test_matches_the_models_decode_attention(window):
    """One decode step of `rlvr.models.transformer` on its paged cache: `paged_indices` + the dense
    gather + `dot_product_attention` equal the kernel given the same pool, with the page table and
    lengths recovered from `paged_indices`' outputs as the proposed `Attention.__call__` wiring
    does (row 3 is an idle row: the model attends over nothing meaningful there, the kernel gives 0)."""
    rng = np.random.default_rng(2)
    layers, num_pages, page_size, kvh, d, h, b = 2, 10, 4, 2, 8, 4, 4
    pool = {n: jnp.asarray(rng.standard_normal((layers, num_pages, page_size, kvh, d)), jnp.float32)
            for n in ("k", "v")}
    table = jnp.asarray([[1, 2, 3], [4, 5, 0], [6, 7, 8], [0, 0, 0]], jnp.int32)
    positions = jnp.asarray([[9], [4], [11], [0]], jnp.int32)  # the decoded token's position (already written)
    segments = jnp.asarray([[1], [1], [1], [0]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
    mask, (_, read_idx, columns, _) = transformer.paged_indices({**pool, "page_table": table}, positions, segments,
                                                             window)
    layer = 1
    offset = layer * num_pages * page_size
    k = pool["k"].reshape(-1, kvh, d)[offset + read_idx]
    v = pool["v"].reshape(-1, kvh, d)[offset + read_idx]
    want = transformer.dot_product_attention(q, k, v, mask)
    # the wiring: table and lengths from kv_index = (write_idx, read_idx, columns)
    row_table = read_idx[:, ::page_size] // page_size
    lengths = jnp.where(columns[:, 0] < read_idx.shape[1], columns[:, 0] + 1, 0)
    np.testing.assert_array_equal(row_table, table)
    np.testing.assert_array_equal(lengths, [10, 5, 12, 0])
    for impl in ("pallas", "xla"):
        got = paged_attention(q, pool["k"], pool["v"], row_table, lengths, layer=layer, sliding_window=window,
                              implementation=impl, interpret=True)
        np.testing.assert_allclose(np.asarray(got[:3]), np.asarray(want[:3]), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got[3]), 0.0)


@pytest.mark.parametrize("window,key_block", [(0, 64), (0, 8), (6, 8)])
def test_prefill_attention_reads_keys_up_to_the_chunks_reach(window, key_block):
    """The model's prefill attention (`transformer._paged_prefill_attention`, a chunk of queries over
    the rows' pages in a loop of key blocks) against the numpy dense reference, row by row: rows
    that start a prompt, continue one at position 37 (2 pages from 7 queries), and an idle row
    (padding only: output 0); GQA 4:2, pages shuffled in the pool. The values of every page from
    the first whole key block past the chunk's reach are NaN: read, they would poison the
    product (0 x NaN), so the loop provably stops at the reach, not at the rows' capacity."""
    rng = np.random.default_rng(5)
    layers, num_pages, page_size, kvh, d, h, per_row = 2, 100, 4, 2, 8, 4, 32  # capacity 128 tokens
    table = rng.permutation(num_pages)[:3 * per_row].reshape(3, per_row)
    starts, counts = [0, 37, 0], [5, 7, 0]
    t = max(counts)
    positions = np.array([[s + i for i in range(t)] for s in starts], np.int32)
    segments = np.array([[1 if i < c else 0 for i in range(t)] for c in counts], np.int32)
    k_pool, v_pool = (rng.standard_normal((layers, num_pages, page_size, kvh, d)).astype(np.float32)
                      for _ in range(2))
    reach = max(s + c for s, c in zip(starts, counts, strict=True))
    width = max(p for p in range(1, per_row + 1) if per_row % p == 0 and p * page_size <= max(key_block, page_size))
    unread = table[:, -(-reach // (width * page_size)) * width:]
    assert unread.size, "the test needs pages past the reach"
    v_pool[:, unread] = np.nan
    cache = {"k": jnp.asarray(k_pool), "v": jnp.asarray(v_pool), "page_table": jnp.asarray(table, jnp.int32)}
    mask, (_, read_idx, _, _) = transformer.paged_indices(cache, jnp.asarray(positions), jnp.asarray(segments), window)
    q = rng.standard_normal((3, t, h, d)).astype(np.float32)
    got = np.asarray(jax.jit(transformer._paged_prefill_attention, static_argnums=(2, 5))(
        jnp.asarray(q), {"k": cache["k"], "v": cache["v"]}, 1, read_idx, mask, key_block))
    assert np.isfinite(got).all()
    for row, (start, count) in enumerate(zip(starts, counts, strict=True)):
        if count:
            want = dense_reference(q[row:row + 1, :count], k_pool[1], v_pool[1], table[row:row + 1],
                                   np.array([start + count]), window)
            np.testing.assert_allclose(got[row, :count], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[2], 0.0)
    np.testing.assert_array_equal(got[0, counts[0]:], 0.0)  # padding queries see nothing


def test_implementation_choice(caplog, monkeypatch):
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((4, 2, 1, 8)), jnp.float32)
    q, table, lengths = jnp.ones((1, 2, 8)), jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([3], jnp.int32)
    with pytest.raises(ValueError, match="implementation='cuda'"):
        paged_attention(q, k, k, table, lengths, implementation="cuda")
    if jax.default_backend() != "tpu":
        with pytest.raises(RuntimeError, match="implementation='pallas' was requested but cannot run"):
            paged_attention(q, k, k, table, lengths, implementation="pallas")
        from rlvr.kernels.paged_attention import api

        api._logged.clear()
        with caplog.at_level(logging.INFO, logger="rlvr.kernels.paged_attention.api"):
            auto = paged_attention(q, k, k, table, lengths)
        assert "using the XLA implementation" in caplog.text
        np.testing.assert_allclose(auto, paged_attention(q, k, k, table, lengths, implementation="xla"))
        from rlvr.kernels.paged_attention import NativeDecode

        native_out = paged_attention(q, k, k, table, lengths, ragged=NativeDecode())  # the engine's request
        np.testing.assert_allclose(native_out, auto, atol=1e-6)
        monkeypatch.setattr(api, "native_unavailable_reason", lambda: "no C++ compiler 'g++' on PATH")
        with pytest.raises(RuntimeError, match="implementation='native' was requested but cannot run: no C"):
            paged_attention(q, k, k, table, lengths, implementation="native")


@pytest.mark.parametrize("change, message", [
    (dict(q=jnp.ones((2, 3, 8))), "multiple of the pool's 2 kv heads"),
    (dict(q=jnp.ones((2, 4, 6))), "head_dim of q"),
    (dict(q=jnp.ones((2, 4))), "q must be"),
    (dict(v=jnp.ones((5, 4, 2, 4, 8))), "same shape"),
    (dict(k=jnp.ones((3, 5, 4, 2, 8)), v=jnp.ones((3, 5, 4, 2, 8))), "pass layer="),
    (dict(layer=0), "single layer's pool"),
    (dict(table=jnp.ones((3, 2), jnp.int32)), "page_table must be"),
    (dict(table=jnp.ones((2, 2), jnp.float32)), "integer page ids"),
    (dict(lengths=jnp.ones((2, 1), jnp.int32)), "lengths must be"),
    (dict(window=-1), "sliding_window"),
])
def test_shape_errors(change, message):
    args = dict(q=jnp.ones((2, 4, 8)), k=jnp.ones((5, 4, 2, 8)), v=jnp.ones((5, 4, 2, 8)),
                table=jnp.ones((2, 2), jnp.int32), lengths=jnp.ones((2,), jnp.int32), layer=None, window=0)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        paged_attention(args["q"], args["k"], args["v"], args["table"], args["lengths"], layer=args["layer"],
                        sliding_window=args["window"], implementation="xla")


def test_layer_out_of_range():
    k = jnp.ones((2, 5, 4, 2, 8))
    with pytest.raises(ValueError, match="layer=2 is out of range"):
        paged_attention(jnp.ones((2, 4, 8)), k, k, jnp.ones((2, 2), jnp.int32), jnp.ones((2,), jnp.int32), layer=2)


def test_engine_decodes_through_the_paged_kernel_identically():
    """The engine's decode steps through the ragged kernel (decode_attention="ragged"), the native
    CPU kernel ("native") and over the contiguous per-call window ("window", `implementation="xla"`'s
    attention without the gather): the same greedy tokens and log-probs."""

    from rlvr import api, config_lib
    from rlvr.models.tokenizer import byte_level_tokenizer
    from rlvr.rollout.engine import Engine
    from rlvr.rollout.types import Request, SamplingParams

    config = config_lib.load_config("configs/quickstart.py:smoke", {})
    model = api.build_model(config)
    tokenizer = byte_level_tokenizer()
    outputs = {}
    for attention in ("ragged", "window", "native"):
        engine = Engine(model.cfg, model.params, tokenizer, max_slots=4, max_len=64, page_size=8,
                        decode_attention=attention)
        requests = [Request(f"r{i}", tokenizer.encode(f"{i}+{3 * i}="), SamplingParams(max_new_tokens=12,
                                                                                       temperature=0.0,
                                                                                       ignore_eos=True))
                    for i in range(3)]
        outputs[attention] = {c.rid: c for c in engine.generate(requests)}
    for rid, ref in outputs["ragged"].items():
        for other in ("window", "native"):
            got = outputs[other][rid]
            assert got.output_ids == ref.output_ids
            np.testing.assert_allclose(got.output_logprobs, ref.output_logprobs, atol=2e-5)


@pytest.mark.parametrize("mesh_shape", [{"tensor": 2}, {"data": 2, "tensor": 2}, {"data": 2, "tensor": 4}])
def test_pallas_on_a_mesh_runs_in_a_shard_map_and_matches_the_reference(mesh_shape):
    """A Mosaic kernel cannot be partitioned by XLA, so on a multi-device mesh the Pallas path runs
    inside `jax.shard_map` (heads over `tensor`, rows over `data`): with the pool sharded over KV
    heads and the mesh set (`jax.set_mesh`, as the engine's calls do), interpret mode on the fake
    CPU devices equals `paged_attention_reference` and the dense numpy reference. With tensor=4 and
    2 KV heads the heads cannot split (they stay whole; rows still split over data)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from rlvr.kernels.paged_attention import paged_attention_reference

    from rlvr import sharding

    mesh = sharding.make_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
    rng = np.random.default_rng(7)
    layers, num_pages, page_size, kv_heads, head_dim, batch, width = 3, 11, 4, 2, 8, 4, 3
    k, v = (rng.standard_normal((layers, num_pages, page_size, kv_heads, head_dim)).astype(np.float32)
            for _ in range(2))
    table = rng.integers(1, num_pages, (batch, width)).astype(np.int32)
    lengths = np.array([1, 5, 12, 0], np.int32)
    q = rng.standard_normal((batch, 1, 2 * kv_heads, head_dim)).astype(np.float32)
    pool = NamedSharding(mesh, P(None, None, None, "tensor" if kv_heads % mesh.shape["tensor"] == 0 else None))
    k_dev, v_dev = jax.device_put(k, pool), jax.device_put(v, pool)

    @jax.jit
    def run(q, k, v, table, lengths, layer):
        kw = dict(layer=layer, sliding_window=6)
        return (paged_attention(q, k, v, table, lengths, implementation="pallas", interpret=True, **kw),
                paged_attention_reference(q, k, v, table, lengths, **kw))

    with jax.set_mesh(mesh):
        got, reference = run(q, k_dev, v_dev, table, lengths, jnp.int32(2))
        text = run.lower(q, k_dev, v_dev, table, lengths, jnp.int32(2)).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text, "the Pallas call is not inside a shard_map"
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got), dense_reference(q, k[2], v[2], table, lengths, 6), rtol=2e-5,
                               atol=2e-5)
