"""The project's own demo tokenizer: a 512-token byte-level BPE trained offline on the toy corpus.

The demo must run without downloads, so it cannot use a published tokenizer. This one is built
from `target_server.toy_corpus` text and is small on purpose (the tiny target's embedding and
lm_head are vocab x hidden):

    id 0..3    special tokens  <|endoftext|> (pad and eos), <|im_start|>, <|im_end|>, <|mask|>
    id 4..259  the 256 byte symbols (any UTF-8 text encodes, nothing becomes <unk>)
    id 260..   252 BPE merges learned on the toy corpus

Pre-tokenization is GPT-2's split except that a number is split into single digits (the leading
space stays on the first), so counting and arithmetic answers are learnable digit by digit.

`<|mask|>` is the DFlash mask token: a real row of the vocabulary, so the target's embedding has
an entry for it. The chat template is Qwen's ChatML shape; each assistant turn's content and the
`<|im_end|>` that closes it are wrapped in `{% generation %}` so that
`apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)` yields the loss
mask (the `<|im_end|>` is in the mask: the drafter learns where an answer stops; the
`<|im_start|>assistant\\n` header before it and the newline after it are not). prepare-data does
not need the markers (it derives the mask by rendering, target_server/data/chats.py); on this template
both give the same mask (tests/test_chat_formats.py).

Building is deterministic: the same code gives byte-identical files.

    python -m target_server.tokenizer --out configs/demo/tokenizer
"""
from __future__ import annotations

import argparse
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from target_server import toy_corpus

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END, MASK_TOKEN]
VOCAB_SIZE = 512

# ChatML as Qwen writes it; `generation` marks what the loss mask covers (content + <|im_end|>).
# Every tag trims the whitespace around it, so the layout below renders nothing of its own.
CHAT_TEMPLATE = """\
{%- for message in messages -%}
  {{- '<|im_start|>' + message['role'] + '\\n' -}}
  {%- if message['role'] == 'assistant' -%}
    {%- generation -%}
      {{- message['content'] + '<|im_end|>' -}}
    {%- endgeneration -%}
  {%- else -%}
    {{- message['content'] + '<|im_end|>' -}}
  {%- endif -%}
  {{- '\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# GPT-2's pre-tokenizer regex with `\p{N}+` narrowed to one digit (keeping its optional space).
_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Training text: a fixed slice of the corpus, independent of the seed any dataset is generated with.
_TRAIN_SAMPLES = 3000
_TRAIN_SEED = 1_000_003


def _training_text() -> list[str]:
    """Role header + content of every message, as the chat template lays them out between specials."""
    return [f"{m['role']}\n{m['content']}\n" for s in toy_corpus.generate(_TRAIN_SAMPLES, _TRAIN_SEED)
            for m in s["messages"]]


def train_backend() -> Tokenizer:
    """The `tokenizers` object: byte-level BPE with the special tokens at ids 0..3."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(), trainer)
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"trained vocabulary has {tok.get_vocab_size()} tokens, more than {VOCAB_SIZE}")
    return tok


def build_tokenizer(out_dir: str) -> PreTrainedTokenizerFast:
    """Train the demo tokenizer and `save_pretrained` it into out_dir (created if needed)."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_backend(),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        # decode() must give back the exact text (the default would drop spaces before punctuation).
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the dfpipe demo tokenizer (offline, deterministic).")
    parser.add_argument("--out", required=True, help="output folder (save_pretrained layout)")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer(args.out)
    print(f"wrote a {len(tokenizer)}-token tokenizer to {args.out}: {sorted(os.listdir(args.out))}")


if __name__ == "__main__":
    main()
