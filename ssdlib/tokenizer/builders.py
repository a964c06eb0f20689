"""Build a ``tokenizers.Tokenizer`` from a bare vocabulary: byte-level BPE or sentencepiece BPE.

A GGUF file (and a sentencepiece ``tokenizer.model``) stores a token list, merges or scores and
token types, but no ``tokenizer.json``. These builders rebuild the same pipeline Hugging Face
transformers builds for those files (``transformers/integrations/gguf``), so that ids agree with
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (same numbering as sentencepiece's piece types).
(TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED,
 TOKEN_BYTE) = range(1, 7)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ``tokenizer.ggml.pre`` -> split regex, for the Llama-architecture vocabularies whose merges were
# learned on a split other than GPT-2's. Any other value (``default``, ``smollm``, ...) gets the
# GPT-2 split built into ``ByteLevel``, which is what transformers does. Note llama.cpp splits
# ``smollm`` digits one by one first; that only changes whitespace runs right before a digit, and
# we follow transformers so ids match the HF reference.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def bos_post_processor(bos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """The post-processor transformers installs: optionally a BOS before each sequence."""
    prefix = f"{bos[0]}:0 " if bos else ""
    pair_prefix = f" {bos[0]}:1" if bos else ""
    return processors.TemplateProcessing(
        single=f"{prefix}$A:0", pair=f"{prefix}$A:0{pair_prefix} $B:1",
        special_tokens=[bos] if bos else [])


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _add_typed_tokens(tok: Tokenizer, tokens: Sequence[str], token_types: Sequence[int] | None,
                      keep_control) -> None:
    """Control (and unknown) tokens become special added tokens, user-defined ones plain added
    tokens, so both are matched whole in text instead of being cut into pieces (as llama.cpp
    does)."""
    if not token_types:
        return
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, token_types)
               if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN) and keep_control(t)]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, token_types) if ty == TOKEN_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str],
                   token_types: Sequence[int] | None = None, pre: str | None = None,
                   bos: tuple[str, int] | None = None) -> Tokenizer:
    """GPT-2 style byte-level BPE (``tokenizer.ggml.model == "gpt2"``)."""
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # A token written with characters outside the byte alphabet is stored as raw text; respell it.
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[_split_merge(m) for m in merges], dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = bos_post_processor(bos)
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel; adding it
    # would grow the vocabulary past the model's embedding, so it is skipped (as transformers does).
    _add_typed_tokens(tok, tokens, token_types, keep_control=lambda t: set(t) <= spelled)
    return tok


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a sentencepiece vocabulary: every split of a piece into two pieces
    of the vocabulary is a merge, ranked by the merged piece's score (best first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    piece_scores = dict(zip(tokens, scores))
    ranked = []
    for piece, score in piece_scores.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked.extend(local)
    # Same tie-breaking as transformers' generate_merges (a stable sort, reversed keys).
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float] | None,
                      token_types: Sequence[int] | None = None,
                      merges: Sequence[str] | None = None, add_prefix_space: bool = True,
                      bos: tuple[str, int] | None = None) -> Tokenizer:
    """Sentencepiece-style BPE with byte fallback (``tokenizer.ggml.model == "llama"``)."""
    if merges:
        pairs = [_split_merge(m) for m in merges]
    else:
        pairs = merges_from_scores(tokens, scores if scores is not None else [0.0] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                               dropout=None))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix_space else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    tok.post_processor = bos_post_processor(bos)
    _add_typed_tokens(tok, tokens, token_types, keep_control=lambda t: True)
    return tok
