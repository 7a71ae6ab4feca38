"""A trained reward model as a reward function for RL (the RLHF path), with normalisation.

    rm = RewardModel.from_workdir("/tmp/rlvr_rm")
    rewards = rm.score(prompts, responses)          # raw scores, one per response
    rewards = rm.normalized(prompts, responses)     # (score - running mean) / running std

Scores are the value head at the response's last token (its end-of-turn token), exactly as
the reward-model trainer scores pairs, so training and use cannot drift apart.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlvr import api
from rlvr.data.chat import render_completion, render_prompt
from rlvr.data.packing import pack_examples
from rlvr.losses import preference as pref
from rlvr.models.tokenizer import Tokenizer
from rlvr.models.transformer import forward_with_values

Prompt = str | Sequence[Mapping[str, Any]]


@functools.partial(jax.jit, static_argnums=0)
def _last_token_values(cfg, params, batch):
    _, values, _ = forward_with_values(cfg, params, batch["tokens"], batch["positions"], batch["segment_ids"])
    last = jnp.argmax(jnp.cumsum(batch["loss_mask"], axis=1), axis=1)
    return jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]


class RewardModel:
    def __init__(self, model: api.Model, tokenizer: Tokenizer, seq_len: int):
        if not model.cfg.value_head:
            raise ValueError("a reward model needs model.value_head=True")
        self.model, self.tokenizer, self.seq_len = model, tokenizer, seq_len
        self.moments = pref.init_moments()

    @classmethod
    def from_workdir(cls, workdir: str) -> RewardModel:
        model = api.load_trained(workdir)
        return cls(model, model.tokenizer, api.load_run_config(workdir).data.seq_len)

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> np.ndarray:
        """Raw scores [N]; a response cut to fit `seq_len` is scored at the cut."""
        examples = []
        for prompt, response in zip(prompts, responses, strict=True):
            p, r = render_prompt(self.tokenizer, prompt), render_completion(self.tokenizer, response)
            examples.append((p + r, [0] * len(p) + [1] * len(r)))
        batch, _ = pack_examples(examples, len(examples), self.seq_len, self.tokenizer.pad_id, pack=False)
        return np.asarray(_last_token_values(self.model.cfg, self.model.params, batch))

    def normalized(self, prompts: Sequence[Prompt], responses: Sequence[str], update: bool = True) -> np.ndarray:
        """Scores standardised by running moments over everything scored so far (this batch
        included when `update`), so the RL reward scale does not drift with the RM's."""
        scores = self.score(prompts, responses)
        if update:
            self.moments = pref.update_moments(self.moments, jnp.asarray(scores))
        if int(self.moments.count) < 2:
            return scores - float(self.moments.mean)
        return np.asarray(pref.normalize_scores(jnp.asarray(scores), self.moments.mean, self.moments.std))
