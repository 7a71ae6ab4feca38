"""Decoder models (Llama, Qwen2, Qwen3, Mistral) and Hugging Face interop."""
