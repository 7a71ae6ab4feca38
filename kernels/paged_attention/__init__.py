"""Paged (ragged) decode attention (installed as `rlvr.kernels.paged_attention`).

What: `paged_attention(q, k_pages, v_pages, page_table, lengths, *, layer=None, sliding_window=0,
softcap=0.0, scale=None, implementation=None, interpret=False)`: attention of one (q [B, H, D]) or
a few (q [B, Q, H, D], the last Q tokens of each row, causal) new tokens per sequence over the
rollout engine's KV page pool, read through the page table, with per-row lengths and GQA.
Implementations: "pallas" (`pallas.py`, a Mosaic TPU kernel with the page table, lengths and
layer scalar-prefetched; runs anywhere with interpret=True), "native" (`native.py` + `native.cc`,
a C++ XLA:CPU custom call compiled on first use: the rollout engine's CPU decode), "ragged" (`ragged.py`, plain jnp over
a flat list of the rows' pages: work follows the tokens cached; one query per row) and "xla"
(`reference.py`, plain jnp: gather the row's pages, masked float32 softmax).
`paged_attention_reference` is the latter.

Why: the engine's decode step today gathers every row's whole page-table width of K/V into a
dense [B, S, KVH, D] copy per layer and step and masks it; the kernel instead reads each row's
own pages in place, only up to its length (and only inside a sliding window), with an online
softmax, so the cost follows the tokens actually cached rather than the padded table width.

How: pass the pool as `rlvr.rollout.engine` stores it (`init_paged_cache`: k/v [layers, pages,
page_size, kv_heads, head_dim]; give `layer=`) or one layer's slice, the row page table [B, R]
and lengths = position of the last query + 1 (0 for idle rows):

    from rlvr.kernels.paged_attention import paged_attention
    out = paged_attention(q, cache["k"], cache["v"], cache["page_table"], positions[:, -1] + 1,
                          layer=layer_id, sliding_window=cfg.sliding_window)   # [B, 1, H, D]

`implementation=None` uses Pallas on TPU and XLA elsewhere (logged once; "native" with
`ragged=NativeDecode()`); asking for "pallas" or "native"
where it cannot run raises RuntimeError. Bad shapes raise ValueError naming the argument.
"""

from rlvr.kernels.paged_attention.api import IMPLEMENTATIONS, paged_attention, pallas_unavailable_reason
from rlvr.kernels.paged_attention.native import NativeDecode, native_unavailable_reason
from rlvr.kernels.paged_attention.ragged import RaggedPages, ragged_pages
from rlvr.kernels.paged_attention.reference import contiguous_attention, paged_attention_reference

__all__ = ["IMPLEMENTATIONS", "NativeDecode", "RaggedPages", "contiguous_attention", "native_unavailable_reason",
           "paged_attention", "paged_attention_reference", "pallas_unavailable_reason", "ragged_pages"]
