"""Data sources: synthetic text, JSONL conversations, packing."""
