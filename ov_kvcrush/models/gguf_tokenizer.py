"""A faithful Hugging Face tokenizer for a GGUF whose vocabulary is SentencePiece BPE (``llama``).

Why: transformers 5.x converts such a GGUF (Gemma 3's, seen here) into a *Unigram* model over the
BPE pieces' scores. Those scores are merge priorities (minus the piece's rank), not log
probabilities, so Viterbi segments per syllable ("▁c ap it al" for "▁capital", 24 ids for "The
capital of France is"); the conversion also drops the BOS the GGUF asks for and the chat template
the model card documents. A model fed those ids talks nonsense without any error.

What llama.cpp (the GGUF's own tokenizer) does, and what this rebuilds with ``tokenizers``:

* control tokens (type 3: ``<bos>``, ``<start_of_turn>`` …) and user-defined ones (type 4: runs
  of newlines, spaces and tabs, HTML tags) are matched in the raw text first and never split;
* spaces become ``▁`` (and a leading ``▁`` is added only when ``add_space_prefix`` says so);
* the rest is SentencePiece BPE: adjacent symbols merge, highest-scoring result first, while
  the merged text is a piece; what is left unmatched falls back to ``<0xNN>`` byte pieces;
* ``<bos>`` is prepended when ``add_bos_token`` says so.

BPE merges are derived from the pieces and scores the way SentencePiece's trainer orders them
(every split of a piece into two pieces, ranked by the piece's score), so the fast BPE applies
the same merges in the same order as llama.cpp's bigram queue. ``tests/test_gemma3.py`` checks
the ids against a direct port of llama.cpp's algorithm on text with spaces, newlines, tabs,
digits, accents, CJK, emoji, HTML and the chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ov_kvcrush.models.gguf_metadata import read_metadata

# Imported where used, inside functions: what pulls in tokenizers, transformers, heavy to import, so
# that importing this module stays light.

#: llama.cpp's token types (``llama_token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

#: Gemma 3's chat template (google/gemma-3-*'s ``chat_template.jinja``), for GGUFs that omit it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    '{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}'
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    '{%- set role = "model" -%}'
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    '{{ raise_exception("Invalid content type") }}'
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

#: Chat templates by GGUF architecture, used when the GGUF carries none.
DEFAULT_CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}
#: Tokens that end a chat turn, by architecture (generation stops on them besides EOS).
TURN_END_TOKENS = {"gemma3": ("<end_of_turn>",)}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer a GGUF describes (``tokenizer.ggml.*``), as llama.cpp reads it."""

    model: str
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    architecture: str
    chat_template: str | None

    def special_ids(self) -> list[int]:
        """Ids matched whole in raw text (control and user-defined pieces), as llama.cpp does."""
        return [i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED) and self.tokens[i]]


def read_gguf_vocab(path: str | Path) -> GGUFVocab:
    """Read the tokenizer fields of a GGUF file (no weights are loaded)."""
    fields = read_metadata(path)
    value = fields.get

    tokens = fields["tokenizer.ggml.tokens"]
    scores = [float(s) for s in fields.get("tokenizer.ggml.scores", [])]
    types = [int(t) for t in fields.get("tokenizer.ggml.token_type", [])]
    return GGUFVocab(
        model=str(value("tokenizer.ggml.model", "")),
        tokens=tokens,
        scores=scores or [0.0] * len(tokens),
        types=types or [NORMAL] * len(tokens),
        bos_id=value("tokenizer.ggml.bos_token_id"),
        eos_id=value("tokenizer.ggml.eos_token_id"),
        unk_id=value("tokenizer.ggml.unknown_token_id"),
        pad_id=value("tokenizer.ggml.padding_token_id"),
        add_bos=bool(value("tokenizer.ggml.add_bos_token", True)),
        add_eos=bool(value("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(value("tokenizer.ggml.add_space_prefix", True)),
        architecture=str(value("general.architecture", "")),
        chat_template=value("tokenizer.chat_template"),
    )


def spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """BPE merges implied by SentencePiece pieces and scores, best first.

    Every split of a normal piece into two pieces is a merge ranked by the piece's score (ties:
    shorter left part first, then ids), which is the order llama.cpp's bigram queue merges in.
    """
    index = {t: i for i, t in enumerate(vocab.tokens) if vocab.types[i] in (NORMAL, UNUSED, BYTE)}
    ranked = []
    for piece, i in index.items():
        if vocab.types[i] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append((-vocab.scores[i], cut, index[left], index[right], left, right))
    ranked.sort()
    return [(r[4], r[5]) for r in ranked]


def spm_tokenizer(vocab: GGUFVocab):
    """A ``PreTrainedTokenizerFast`` that encodes as llama.cpp does for this SentencePiece GGUF."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    if vocab.model != "llama":
        raise ValueError(f"not a SentencePiece GGUF vocabulary (tokenizer.ggml.model={vocab.model!r})")
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tok = Tokenizer(BPE(vocab=ids, merges=spm_merges(vocab), unk_token=unk, byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Replace(" ", "▁")]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens(
        [AddedToken(vocab.tokens[i], special=vocab.types[i] == CONTROL, normalized=False) for i in vocab.special_ids()]
    )

    def name(i: int | None) -> str | None:
        return vocab.tokens[i] if i is not None and 0 <= i < len(vocab.tokens) else None

    bos, eos = name(vocab.bos_id), name(vocab.eos_id)
    single, pair, specials = ["$A"], ["$A", "$B"], []
    if vocab.add_bos and bos:
        single, pair = [bos, *single], [bos, "$A", bos, "$B"]
        specials.append((bos, vocab.bos_id))
    if vocab.add_eos and eos:
        single, pair = [*single, eos], [*pair, eos]
        specials.append((eos, vocab.eos_id))
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    template = vocab.chat_template or DEFAULT_CHAT_TEMPLATES.get(vocab.architecture)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=name(vocab.pad_id),
        chat_template=template,
        clean_up_tokenization_spaces=False,
        add_bos_token=vocab.add_bos,
    )


def turn_end_ids(vocab: GGUFVocab) -> list[int]:
    """EOS plus the architecture's end-of-turn tokens: where generation stops."""
    ids = [vocab.eos_id] if vocab.eos_id is not None else []
    index = {t: i for i, t in enumerate(vocab.tokens)}
    ids += [index[t] for t in TURN_END_TOKENS.get(vocab.architecture, ()) if t in index]
    return ids
