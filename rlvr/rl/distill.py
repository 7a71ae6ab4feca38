"""On-policy distillation: a teacher's per-token log-probs on the student's own samples as a dense reward.

With `rl.teacher` (a Hugging Face directory or an rlvr workdir, possibly of another size, with the
student's tokenizer) every sampled token t of every rollout gets the advantage

    A_t = A_task · [rl.distill_task_advantage] − rl.distill_coef · (log π_student(x_t) − log π_teacher(x_t))

where log π_student is the sampler's own log-prob of the token (its behaviour log-prob) and
log π_teacher the teacher's, under the same sampling transformation (`rl.temperature`, top-k/p): the
per-token reverse KL KL(π_student ‖ π_teacher), estimated on the student's samples, with its policy
gradient (no discount: each token is credited with its own term, as in on-policy distillation). The
teacher term is added after the group normalisation of the task advantage, so it is not whitened
away; `rl.distill_task_advantage=False` trains on the teacher alone (pure distillation).

That is `rl.distill_estimator="sampled"`: teacher log-probs come from
`rlvr.rl.update.reference_logprobs_fn` in the producer (the chunked log-prob kernel). With "full" the
estimate is replaced by the exact per-position term: the train step runs the teacher on the batch and
adds rl.distill_coef · Σ_v π_student(v)(log π_student(v) − log π_teacher(v)) at every sampled position
to the loss (`rlvr.rl.objective`, `rlvr.losses.distill.full_reverse_kl`; the raw softmaxes), both
models' logits in chunks. Either way neither model's [tokens × vocab] logits are materialised.
`rl.teacher_step` picks a workdir teacher's checkpoint (0 = its latest); `rlvr.api.load_teacher` loads it.
"""

from __future__ import annotations

import numpy as np


def teacher_token_advantages(behaviour_logp: list[np.ndarray], teacher_logp: list[np.ndarray],
                             loss_masks: list[np.ndarray | None], coef: float) -> tuple[list[np.ndarray], list[float]]:
    """Per sample: (the per-token distillation advantage −coef·(log π_student − log π_teacher), 0 on
    observation tokens) and the sample's mean per-token reverse-KL estimate over its sampled tokens."""
    advantages, kls = [], []
    for student, teacher, mask in zip(behaviour_logp, teacher_logp, loss_masks, strict=True):
        student, teacher = np.asarray(student, np.float32), np.asarray(teacher, np.float32)
        sampled = np.ones_like(student) if mask is None else np.asarray(mask, np.float32)
        gap = (student - teacher) * sampled
        advantages.append(-coef * gap)
        kls.append(float(gap.sum() / max(sampled.sum(), 1.0)))
    return advantages, kls
