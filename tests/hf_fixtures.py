"""Random Hugging Face checkpoints as a user brings them: built and saved by transformers, with a
trained byte-level BPE tokenizer and the ChatML chat template (tests of the bring-your-own-model path).
"""

from __future__ import annotations

import functools
import glob
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[str, ...]:
    """Text the tokenizer is trained on: the math tasks' prompts and answers, the chat data, docs."""
    from rlvr import config_lib
    from rlvr.tasks import build_tasks

    rl = config_lib.rl_config()
    rl.task = "asdiv,champ,algebra_linear"
    tasks = build_tasks(rl, 0)
    texts = [f"{t.prompt}\n<answer>{t.answer}</answer>" for f in tasks.families.values() for t in f.tasks(0, 400)]
    docs = sorted(glob.glob(os.path.join(REPO, "docs", "*", "*.md")))  # the written pages (the README's old text)
    docs = [p for p in docs if not p.endswith(os.path.join("reference", "config.md"))]  # generated, long tables
    for path in [*glob.glob(os.path.join(REPO, "configs/data/*.jsonl")), os.path.join(REPO, "README.md"), *docs]:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    return tuple(texts)


@functools.lru_cache(maxsize=4)
def bpe(vocab_size: int):
    from rlvr.models.tokenizer import train_bpe

    return train_bpe(corpus(), vocab_size)


def write_random_hf(directory: str, family: str = "qwen3", vocab_size: int = 1024, hidden_size: int = 64,
                    intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    head_dim: int = 16, max_position_embeddings: int = 1024, seed: int = 0,
                    tie_word_embeddings: bool = False) -> str:
    """A random-init `family` ("qwen3" or "llama") model saved by transformers (float32) in
    `directory`, with a BPE tokenizer of up to `vocab_size` ids saved by transformers too."""
    import torch
    import transformers

    from rlvr.models.tokenizer import CHATML_TEMPLATE

    tokenizer = bpe(vocab_size)
    config_cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[family]
    config = config_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                        head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                        tie_word_embeddings=tie_word_embeddings, rope_theta=10000.0,
                        eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_id
    model.save_pretrained(directory)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE).save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["model_type"] == family
    return directory


def write_random_vlm(directory: str, bpe_vocab: int = 0, seed: int = 0) -> str:
    """A random-init Qwen2.5-VL model (tiny: 2 decoder and 2 ViT layers, one windowed and one full)
    saved by transformers (float32) with a tokenizer (BPE of `bpe_vocab` ids, 0: byte-level) whose
    image tokens (<|vision_start|>, <|vision_end|>, <|image_pad|>) are special tokens at the ids the
    model's config names."""
    import torch
    import transformers
    from tokenizers import AddedToken

    from rlvr.models.tokenizer import CHATML_TEMPLATE, byte_level_tokenizer

    tok = bpe(bpe_vocab).tok if bpe_vocab else byte_level_tokenizer().tok
    names = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    start, end, image, video = (tok.token_to_id(n) for n in names)
    vocab_size = -(-tok.get_vocab_size() // 8) * 8
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
                         rms_norm_eps=1e-6, eos_token_id=tok.token_to_id("<|im_end|>"),
                         pad_token_id=tok.token_to_id("<|endoftext|>"), bos_token_id=None),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1]),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    torch.manual_seed(seed)
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(directory)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE).save_pretrained(directory)
    return directory
