"""Scored rollouts -> the token-aligned train batch `rlvr.rl.objective.rl_loss` reads.

Padded (one sequence per row) or packed (several per row, with segment ids). The aggregation
is encoded as per-token weights and per-row weights, so packing never changes the loss:

  token_mean           w_t = 1        row weight = sampled tokens in the row   (DAPO)
  seq_mean_token_mean  w_t = 1/len_i  row weight = sequences in the row        (GRPO)
  seq_mean_token_sum   w_t = 1        row weight = sequences in the row
  token_sum_norm       w_t = 1        row weight = sequences × norm_len        (Dr.GRPO)

`trained_positions` (rl.sampled_logits_only) adds where the loss reads a log-prob, so the output layer
runs on sampled tokens only, not on prompts.

Shared prompts (rl.share_prompts): a group's completions follow one copy of their prompt in a row,

  tokens      P P P P | a a a | b b | c c c c       (prompt, then completions a, b, c)
  positions   0 1 2 3 | 4 5 6 | 4 5 | 4 5 6 7
  branch_ids  0 0 0 0 | 1 1 1 | 2 2 | 3 3 3 3

and each completion attends to the prompt and to itself (`rlvr.models.transformer.attention_mask`); the
first token of b and c is predicted by the prompt's last token (`head_source`). Every completion sees
what it saw in its own row, so the loss and its gradient are those of the unshared batch, while the
policy, reference and backward passes run the prompt once per group instead of once per completion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rlvr.losses import target_mask

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
MIN_COLUMNS = 64  # the narrowest trimmed batch (`bucket_columns`)
MIN_TRAINED = 16  # the fewest trained positions per row (`trained_positions`)


@dataclasses.dataclass
class Sample:
    """One scored completion of one prompt (a member of a group)."""

    group: int  # index of its group within the batch
    task_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    behaviour_logp: list[float]
    versions: list[int]  # weight version that produced each output token
    truncated: bool
    rewards: dict[str, float]  # "reward" plus components
    advantage: float = 0.0
    level: int = 0  # the task's difficulty level (curriculum)
    family: str = ""  # the task's family (per-family metrics, curriculum feedback)
    # per output token: 1 = sampled by the policy, 0 = an observation (multi-turn tool output);
    # None = every output token was sampled (single-turn)
    loss_mask: list[int] | None = None
    # per output token, added to `advantage`: a dense reward's (on-policy distillation, rlvr.rl.distill)
    token_advantage: list[float] | None = None
    # the prompt's images (a VLM policy): one source (path, data URL, base64) per placeholder run, in order
    images: list[str] | None = None

    @property
    def sampled_tokens(self) -> int:
        """Output tokens the policy sampled (the loss covers these only)."""
        return len(self.output_ids) if self.loss_mask is None else sum(self.loss_mask)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> Sample:
        return cls(**values)


def _row_unit(aggregation: str, length: int, norm_len: int) -> float:
    if aggregation == "token_mean":
        return float(length)
    if aggregation == "token_sum_norm":
        return float(norm_len) if length else 0.0
    return 1.0 if length else 0.0


def _bucket_rows(needed: int, multiple: int, limit: int) -> int:
    """Rows for a packed batch: the next of 4, 5, 6 or 7 × 2^k >= needed (eighths of the next power of
    two: 4 shapes per doubling, so few compiles, and under a fifth of the rows empty, where 2^k or 3·2^k
    left up to a third: 18 rows' worth trains on 20, not 24), a multiple of `multiple` (data shards ×
    micro-batches), at most `limit`."""
    top = 1 << max(needed - 1, 0).bit_length()
    step = max(top // 8, 1)
    rows = -(-needed // step) * step
    rows = -(-rows // multiple) * multiple
    return max(min(rows, -(-limit // multiple) * multiple), -(-needed // multiple) * multiple)


def bucket_columns(longest: int, seq_len: int) -> int:
    """Columns for rows whose longest holds `longest` tokens: the next power of two (at least
    MIN_COLUMNS), at most `seq_len`. Few distinct widths, so few compiles of the train step."""
    return min(seq_len, max(MIN_COLUMNS, 1 << max(longest - 1, 0).bit_length()))


def pack_rows(lengths: list[int], seq_len: int) -> tuple[list[list[int]], list[int]]:
    """(sample indices per row, tokens used per row): first-fit decreasing, each sequence (longest
    first) into the first row with room for it. Fewer rows than filling rows in sample order,
    where one long sequence after a short one opens a row half empty (4 groups of 428..528-token
    rollouts in 1,024-token rows: 16 rows, not 20)."""
    rows: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        room = next((r for r, u in enumerate(used) if u + lengths[i] <= seq_len), None)
        if room is None:
            rows.append([i])
            used.append(lengths[i])
        else:
            rows[room].append(i)
            used[room] += lengths[i]
    return rows, used


def prompt_units(samples: list[Sample], row_len: int, share: bool) -> list[list[int]]:
    """Sample indices per unit of the train batch: one sample each, or (`share`, rl.share_prompts) the
    members of a group with the same prompt after one copy of it. A group longer than `row_len` is cut
    into the fewest units that fit, its completions dealt longest first to the unit with the fewest
    tokens: units (and rows) of even length, so the rows' trained positions pad little
    (`trained_positions`)."""
    if not share:
        return [[i] for i in range(len(samples))]
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.group, tuple(s.prompt_ids)) if s.prompt_ids else ("alone", i), []).append(i)
    units: list[list[int]] = []
    for members in groups.values():
        prompt = len(samples[members[0]].prompt_ids)
        outputs = {i: len(samples[i].output_ids) for i in members}
        count = max(-(-sum(outputs.values()) // max(row_len - prompt, 1)), 1)
        while True:  # the fewest units the completions fit in (more when dealing leaves one too long)
            dealt, used = [[] for _ in range(count)], [prompt] * count
            for i in sorted(members, key=lambda i: -outputs[i]):
                k = min(range(count), key=used.__getitem__)
                dealt[k].append(i)
                used[k] += outputs[i]
            if max(used) <= row_len or count >= len(members):
                break
            count += 1
        units.extend(sorted(u) for u in dealt if u)
    return units


def build_batch(samples: list[Sample], seq_len: int, pad_id: int, aggregation: str = "token_mean",
                norm_len: int = 1, pack: bool = False, row_multiple: int = 1,
                min_rows: int = 0, vision=None, trim: bool = False,
                sampled_logits_only: bool = False, share_prompts: bool = False,
                row_len: int = 0) -> dict[str, np.ndarray]:
    """The train batch for `samples` (see the module docstring). Unpacked batches have at least
    `min_rows` rows (empty rows weigh nothing), so a batch the scheduler made smaller keeps the
    compiled shape. Raises ValueError when a sample does not fit `seq_len` (rl.seq_len must
    cover prompt + max_new_tokens). Packed rows are `row_len` wide (rl.row_len; 0 = `seq_len`).
    `trim` (rl.trim_columns): the rows are `bucket_columns` of the longest row wide instead of the full
    width (padding columns weigh nothing and attend to nothing, so the loss is the same; a batch of
    short rollouts costs what they hold). `vision` (a VLM policy's VisionConfig): the samples'
    images join the batch as `image_*` arrays (`image_arrays`). `sampled_logits_only`
    (rl.sampled_logits_only): the batch also says where the loss reads log-probs (`trained_positions`),
    and the output layer runs there only. `share_prompts` (rl.share_prompts, packed, with
    `sampled_logits_only`): a group's prompt is laid out once, followed by its completions, each a
    branch that attends to the prompt and to itself (`branch_ids`): the policy and reference passes
    run the prompt once per group, not once per completion, for the same loss."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"rl.aggregation={aggregation!r}: choose one of {AGGREGATIONS}")
    if share_prompts and not (pack and sampled_logits_only):
        raise ValueError("rl.share_prompts=True needs rl.pack=True and rl.sampled_logits_only=True (a group's "
                         "completions share one prompt in a packed row; the loss reads them at their positions)")
    row_len = row_len or seq_len
    if pack and row_len < seq_len:
        raise ValueError(f"rl.row_len={row_len} is narrower than rl.seq_len={seq_len}: a rollout must fit a row; "
                         "raise rl.row_len or set it to 0 (= rl.seq_len)")
    lengths = [len(s.prompt_ids) + len(s.output_ids) for s in samples]
    for length in lengths:
        if length > seq_len:
            raise ValueError(f"a rollout of {length} tokens does not fit rl.seq_len={seq_len}; raise rl.seq_len to "
                             f"at least the longest prompt + rl.max_new_tokens")
    units = prompt_units(samples, row_len if pack else seq_len, share_prompts)
    unit_lengths = [len(samples[u[0]].prompt_ids) + sum(len(samples[i].output_ids) for i in u) for u in units]
    rows, used = pack_rows(unit_lengths, row_len) if pack else ([[u] for u in range(len(units))], unit_lengths)
    num_rows = _bucket_rows(len(rows), row_multiple, len(samples)) if pack else max(len(rows), min_rows)
    if num_rows % row_multiple:
        raise ValueError(f"{num_rows} sequences per step is not a multiple of {row_multiple} (data shards × "
                         "micro-batches); change rl.prompts_per_step × rl.group_size or train.micro_batches")
    width = row_len if pack else seq_len
    shape = (num_rows, bucket_columns(max(used, default=0), width) if trim else width)
    out = {k: np.zeros(shape, np.int32) for k in ("tokens", "positions", "segment_ids", "loss_mask")}
    out["tokens"][:] = pad_id
    out["seq_index"] = np.full(shape, len(samples), np.int32)
    for k in ("advantages", "behaviour_logp", "token_weight"):
        out[k] = np.zeros(shape, np.float32)
    out["row_weight"] = np.zeros((num_rows,), np.float32)
    branch = np.zeros(shape, np.int32)
    # shared prompts: the position whose hidden state predicts each target (else the one before it)
    source = np.tile(np.arange(shape[1] - 1, dtype=np.int32), (num_rows, 1)) if share_prompts else None
    for r, row_units in enumerate(rows):
        col = 0
        for segment, u in enumerate(row_units, start=1):
            members = units[u]
            prompt = samples[members[0]].prompt_ids
            p = len(prompt)
            out["tokens"][r, col:col + p] = prompt
            out["positions"][r, col:col + p] = np.arange(p)
            out["segment_ids"][r, col:col + p] = segment
            out["seq_index"][r, col:col + p] = members[0]
            last_prompt_token, col = col + p - 1, col + p
            for b, i in enumerate(members, start=1):
                s = samples[i]
                n = len(s.output_ids)
                span = slice(col, col + n)
                out["tokens"][r, span] = s.output_ids
                out["positions"][r, span] = np.arange(p, p + n)
                out["segment_ids"][r, span] = segment
                branch[r, span] = b
                if b > 1 and n:  # (shared) its first token is predicted by the prompt's last, not the token before
                    source[r, col - 1] = last_prompt_token
                out["loss_mask"][r, span] = 1 if s.loss_mask is None else s.loss_mask
                out["seq_index"][r, span] = i
                out["advantages"][r, span] = s.advantage
                if s.token_advantage is not None:
                    out["advantages"][r, span] += s.token_advantage
                out["behaviour_logp"][r, span] = s.behaviour_logp
                length = s.sampled_tokens
                weight = 1.0 / max(length, 1) if aggregation == "seq_mean_token_mean" else 1.0
                out["token_weight"][r, span] = weight * out["loss_mask"][r, span]
                out["row_weight"][r] += _row_unit(aggregation, length, norm_len)
                col += n
    if sampled_logits_only:
        out.update(trained_positions(out["loss_mask"], out["segment_ids"], source))
    if share_prompts:
        out["branch_ids"] = branch
    if vision is not None:
        if share_prompts:
            raise ValueError("rl.share_prompts=True is for text policies: set it to False for a VLM (model.vision).")
        out.update(image_arrays(samples, [[i for u in row for i in units[u]] for row in rows], num_rows, out, vision))
    elif any(s.images for s in samples):
        raise ValueError("rollouts with images need a VLM policy (model.vision) to train on them.")
    return out


def trained_positions(loss_mask: np.ndarray, segment_ids: np.ndarray,
                      source: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Where the loss reads a log-prob: {"head_index" [R, P], "head_valid" [R, P]}, per row the predicting
    positions t (of the [R, T-1] target-aligned arrays) whose target t+1 is trained
    (`rlvr.losses.target_mask`), padded to P columns (the longest row's count, rounded up like `_bucket_rows`
    and at most T-1: few distinct shapes, so few compiles). The RL loss then runs the output layer and
    the log-softmax over the vocabulary on those P positions only: in a prompt-heavy batch most positions
    are prompt tokens, and the output layer is a large share of a small model's FLOPs (a 32k vocabulary
    at width 512 is half of a 35M-param model). `source` [R, T-1] (a shared-prompt batch): the position
    whose hidden state predicts target t+1, returned at the same entries as "head_source"."""
    trained = np.asarray(target_mask(loss_mask, segment_ids))
    longest = int(trained.sum(axis=1).max(initial=0))
    width = _bucket_rows(min(max(longest, MIN_TRAINED), trained.shape[1]), 1, trained.shape[1])
    index = np.zeros((trained.shape[0], width), np.int32)
    valid = np.zeros((trained.shape[0], width), np.float32)
    for r, row in enumerate(trained):
        at = np.flatnonzero(row)
        index[r, :len(at)] = at
        valid[r, :len(at)] = 1.0
    out = {"head_index": index, "head_valid": valid}
    if source is not None:
        out["head_source"] = np.take_along_axis(source, index, axis=1)
    return out


def image_arrays(samples: list[Sample], rows: list[list[int]], num_rows: int, out: dict[str, np.ndarray],
                 vision) -> dict[str, np.ndarray]:
    """`image_*` arrays (rlvr.models.vision.ImageInputs) of each row's samples' images, processed
    as the rollout engine did (rlvr.data.images.preprocess); the patch capacity per row is a power
    of two of merge units (few compiled shapes). A group's images are decoded once."""
    from rlvr.data.images import preprocess
    from rlvr.models.vision import IMAGE_KEYS, image_inputs

    cache: dict[str, tuple[np.ndarray, list]] = {}

    def processed(source: str):
        if source not in cache:
            cache[source] = preprocess([source], vision)
        return cache[source]

    patches = [np.zeros((0, vision.patch_dim), np.float32) for _ in range(num_rows)]
    grids: list[list] = [[] for _ in range(num_rows)]
    for r, members in enumerate(rows):
        parts = [processed(src) for i in members for src in samples[i].images or ()]
        if parts:
            patches[r] = np.concatenate([p for p, _ in parts])
            grids[r] = [g for _, gs in parts for g in gs]
    units = max(-(-max(len(p) for p in patches) // vision.merge_unit), 1)
    capacity = (1 << (units - 1).bit_length()) * vision.merge_unit
    inputs = image_inputs(vision, patches, grids, out["tokens"], out["segment_ids"], capacity)
    return {f"image_{k}": np.asarray(v) for k, v in zip(IMAGE_KEYS, inputs, strict=True)}
