"""prepare-data: chat rows (JSONL or Parquet) -> a tokenized, memory-mappable folder; and its reader.

Input: one conversation per JSONL line or Parquet row, in one of two formats, detected per file
(the first row holding either key decides) or named (`format=`):

    openai    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...],
               "tools": [...]?}   "content" a string (or a list of {"type": "text", "text"} parts);
                                  an assistant message may carry "reasoning_content" (or "reasoning")
                                  and "tool_calls" (then "content" may be null); a tool message
                                  "tool_call_id" / "name". The template renders them all.
    sharegpt  {"conversations": [{"from": "human"|"gpt"|"system"|"tool", "value": "..."}, ...],
               "system": "..."?, "tools": [...]?}   (also user/assistant/observation as `from`)

What the drafter learns (loss mask 1) comes from rendering the conversation with the chat template
itself, so any template works, with or without `{% generation %}` markers. For assistant message k:

    prompt_k = render(messages[:k], add_generation_prompt=True)   what the server renders before turn k
    turn_k   = render(messages[:k+1])                             must begin with prompt_k
    generated text of turn k = turn_k[len(prompt_k):], less the whitespace after its final special token

so the template's assistant header (`<|im_start|>assistant\\n`, and an empty `<think>\\n\\n</think>\\n\\n`
where the generation prompt holds it, as with enable_thinking=false) is context, while the reasoning
block, the content, the tool calls and the end-of-turn token (`<|im_end|>`: the drafter learns
where a turn stops) are generated; the newline the template writes after `<|im_end|>` is context.
A token is 1 when its characters overlap generated text (as transformers' `{% generation %}` mask).
The document is turn_K of the last assistant message (later messages hold nothing to learn).
Some templates re-render history once later turns exist (Qwen3's drop the reasoning of turns
before the last user message): a turn is trained where its own context and text are what the
server sees, so such a row becomes several documents (views), each the rendering up to the last
turn it is trained on; `PrepareReport.multi_view` counts those rows.

Prepared folder (one per dataset; every array is a plain `.npy`, so `np.load(mmap_mode="r")` opens
it in microseconds and the OS page cache shares it between processes):

    <out_dir>/
      input_ids.npy    int32  [T]    the documents' tokens, back to back
      loss_mask.npy    uint8  [T]    1 on tokens the drafter learns (the assistant's generated tokens, above)
      offsets.npy      int64  [N+1]  document i is tokens [offsets[i], offsets[i+1]); offsets[0] = 0
      sample_ids.npy   int64  [N]    0-based row of the source (a split or multi-view row repeats its id)
      meta.json                      format/version, source (path, digest, row format), tokenizer (path,
                                     digest), chat template (text, digest, kwargs), counts, max_len,
                                     overlong policy, the PrepareReport
      bad_rows.jsonl                 one {"line", "sample_id", "reason"} per rejected row

    input_ids   | doc 0 ........ | doc 1 .... | doc 2 ............ |
    offsets     0                a            b                    T

Source rows are numbered two ways, both written down: `sample_id` is the 0-based line (Parquet:
row) index (stable across re-preparation, whatever else changes in the file below it); report
`line` numbers are 1-based, as an editor or `sed -n 'Lp'` shows them, so `line == sample_id + 1`.

No row is dropped without a trace: each is kept (perhaps truncated or split, both counted) or
listed in the report with its line number and reason (larger than max_row_bytes, never parsed;
nested deeper than MAX_ROW_DEPTH; a number past Python's int-string limit; a Parquet row or row
group pyarrow cannot read; a word longer than `word_cap`, whose tokenization alone would cost
gigabytes), and the file goes on. A source without one usable row is an error that first says what
is wrong with the file when its first bytes show it (a JSON array, Latin-1 or UTF-16 text, gzip)
and the command that fixes it, then the first rows' own reasons. A UTF-8 byte-order mark at the
start of a file is accepted. `dfpipe eval` reads its prompts with the same `ChatRows`.
"""
# The names other modules and the tests import from target_server.data (each module says its idea).
from target_server.data.chats import (_CHARS_PER_TOKEN, ChatRows, Conversation, _encode_views, _Renderer,
                                      _special_tokens, _unchanged_by_cut, _WordTooLong, control_tokens, parse_row,
                                      word_cap)
from target_server.data.cli import add_arguments, main, run
from target_server.data.prepare import ensure_prepared, file_sha256, prepare_data
from target_server.data.prepared import PreparedDataset
from target_server.data.rows import (MAX_ROW_DEPTH, ROW_FORMATS, DataError, detect_format, read_lines,
                                     source_row_count, unusable_file_fix)
