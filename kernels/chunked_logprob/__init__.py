"""Chunked token log-probs and entropies (installed as `rlvr.kernels.chunked_logprob`).

What: `token_logprobs(hidden [B,T,E], lm_head [E,V], targets [B,T], *, chunk_size, softcap=0.0,
return_entropy=False, vocab_major=False, sampling=Sampling())` returns log p(target) [B, T] float32
(and the entropy [B, T] of each position's next-token distribution), differentiable w.r.t.
`hidden` and `lm_head`; p is the distribution a sampler with `sampling` (temperature, top-k,
top-p, min-p) draws from, defined once by `sampling_logits`, which the rollout engine samples
with. `token_logprobs_reference` computes the same from the full logits.

Why: a loss that calls `forward(...)` materialises float32 logits [B, T, V], and its backward
holds several more tensors of that size (softmax, its cotangent); at long sequences and large
vocabularies (T = 32k, V = 152k: 20 GB per row) this dominates training memory. Here the logits
exist one chunk of `chunk_size` positions at a time, in the forward and (recomputed, by a custom
VJP) in the backward; the d lm_head accumulator is float32.

How: take the model's final-norm hidden states and the output projection, e.g.

    from rlvr.kernels.chunked_logprob import token_logprobs
    hidden, _ = Transformer(cfg).apply({"params": params}, tokens, positions, segment_ids,
                                       method=Transformer.hidden_states)
    w = params["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]["kernel"]
    logp = token_logprobs(hidden[:, :-1], w, tokens[:, 1:], chunk_size=512,
                          vocab_major=cfg.tie_word_embeddings)

`rlvr.losses.model_token_logprobs` does exactly this for a model (value head included); the SFT and
RL losses use it when `train.logprob_chunk_size` > 0. Temporary memory per chunk is about
B·chunk_size·V·4 bytes times a small constant; pick chunk_size so that is a few hundred MB.
"""

from rlvr.kernels.chunked_logprob.api import token_logprobs
from rlvr.kernels.chunked_logprob.reference import Sampling, sampling_logits, token_logprobs_reference

__all__ = ["Sampling", "sampling_logits", "token_logprobs", "token_logprobs_reference"]
