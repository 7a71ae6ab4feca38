"""The deploy -> feedback -> retrain flywheel, built from existing parts.

    python -m rlvr.rollout.server --hf_dir=MODEL --traffic_dir=FLY/traffic     # serve and capture
    curl -X POST URL/v1/feedback -d '{"response_id": "...", "rating": 1}'      # feedback on an answer
    python -m rlvr.flywheel build --traffic=FLY/traffic --out=FLY/data          # training data + card
    python -m rlvr.main --config=... --config.data.path=FLY/data/train/sft.jsonl  # SFT / DPO / RL jobs
    python -m rlvr.flywheel promote --candidate=RUN --server=URL --fly=FLY --suite=FLY/data/heldout/rl.jsonl,add
    python -m rlvr.flywheel rollback --server=URL --fly=FLY

Reading order: `log` (append-only framed JSONL), `capture` (the server's recorder and POST /v1/feedback),
`build` (traffic -> SFT / DPO / RL data), `promote` (the regression gate and the weight swap), `__main__`.
Files may live on a local path or on object storage (`rlvr.storage`), except the traffic log, which a
server writes locally (appends with fsync; ship finished part files to a bucket with `rlvr.storage`).
"""
