"""Tiny random checkpoints for the prefill-only tasks (issue 37), with a tiny word-level tokenizer of their own
(no downloads): a Qwen3 embedding model saved by sentence-transformers (Transformer + last-token Pooling +
Normalize, the Qwen3-Embedding layout), and sequence classification models (classify, reward, cross-encoder)."""
from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(300)]
VOCAB = 320  # ids 0..3 special, 4..303 words, a few spare
EMBED_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                  initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def make_tokenizer(path: Path, append_eos: bool = True, chat: bool = False):
    """A word-level fast tokenizer: "w0 w1 ..." -> ids 4.. ; `append_eos`: a post-processor appends <eos> (id 2)
    to every text, as Qwen3-Embedding's does; a pair is `a <eos> b <eos>`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{w: 4 + i for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if append_eos:
        tok.post_processor = processors.TemplateProcessing(single="$A <eos>", pair="$A <eos> $B:1 <eos>:1",
                                                           special_tokens=[("<eos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", padding_side="right")
    if chat:  # a chat template (roles become <unk>): reward models read chats (sentence-transformers 6 would use it)
        fast.chat_template = ("{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
                              "{% if add_generation_prompt %}<bos> assistant {% endif %}")
    fast.save_pretrained(path)
    return fast


def random_texts(n: int, seed: int, min_words: int = 2, max_words: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def make_st_embedding(path: Path, pooling: str = "lasttoken", seed: int = 0, normalize: bool = True) -> Path:
    """A Qwen3 bare decoder with random weights (a wide init: decisive), saved as a sentence-transformers model
    whose pooling is `pooling` (lasttoken | mean | cls), with a Normalize module when `normalize`."""
    import warnings

    import transformers
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():  # (sentence-transformers 6 moved the modules; 3-5 have them here only)
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers.models import Normalize, Pooling, Transformer

    base = path.parent / f"{path.name}-base"
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(transformers.Qwen3Config(**EMBED_BASE), dtype=torch.float32)
    model.save_pretrained(base)
    make_tokenizer(base)
    body = Transformer(str(base), max_seq_length=512)
    modes = {"lasttoken": "lasttoken", "mean": "mean", "cls": "cls"}
    dim = body.get_embedding_dimension() if hasattr(body, "get_embedding_dimension") else body.get_word_embedding_dimension()
    modules = [body, Pooling(dim, pooling_mode=modes[pooling])]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def make_classifier(path: Path, num_labels: int, arch: str = "qwen3", seed: int = 1) -> Path:
    """A `*ForSequenceClassification` checkpoint (Qwen3, Llama, Qwen2, Mistral, Gemma 2) with `num_labels` outputs
    and named labels."""
    import transformers

    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig, "gemma2": transformers.Gemma2Config}[arch]
    labels = {i: f"class_{i}" for i in range(num_labels)}
    config = cls(**EMBED_BASE, num_labels=num_labels, id2label=labels, label2id={v: k for k, v in labels.items()})
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a decisive head: the default init (std 0.3) is already wide; scale up for spread
        model.score.weight.mul_(3.0)
    model.save_pretrained(path)
    make_tokenizer(path, chat=True)
    return path


def hf_classifier_logits(path: Path, texts: list[str] | list[tuple[str, str]],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HF's logits of each text (or pair), one at a time (no padding), computed in `dtype` (float64: the model's
    exact value, to which float32 results of any summation order are compared): [N, num_labels] float32."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    # eager attention: transformers 5.17's default (SDPA) drops Gemma 2's attention soft-capping
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype,
                                                                            attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for text in texts:
            enc = tok(*text, return_tensors="pt") if isinstance(text, tuple) else tok(text, return_tensors="pt")
            out.append(model(**enc).logits[0])
    return torch.stack(out).float()
