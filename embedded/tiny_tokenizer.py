"""An offline stand-in for the target's tokenizer, for tests and the embedded demo.

No network is reachable where tests run, so a small byte-level BPE is trained on a built-in
corpus and given a Qwen3-style ChatML template; byte-level means any text can be encoded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Qwen3's template without tools: the parts that shape the token stream (history turns lose
# their reasoning, the last one keeps a <think> block, enable_thinking=False pre-fills an
# empty one in the generation prompt) are kept so that loss-mask code meets the real quirks.
QWEN3_STYLE_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Qwen2/Qwen3's pre-tokenizer split: digits one by one, and a newline run is one piece whatever
# follows it, so a prompt ending in "\n\n" tokenizes the same alone as in front of the reply.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A drafter learns to guess the next tokens of a frozen target model.",
    "Hidden states flow from the producer to the trainer through a shared-memory ring.",
    "What is the capital of France? The capital of France is Paris.",
    "Explain speculative decoding in one sentence, please.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 3072.",
    "system user assistant think hello world thanks sure okay yes no",
)


def tiny_chat_tokenizer(
    path: str | Path,
    chat_template: str = QWEN3_STYLE_CHAT_TEMPLATE,
    vocab_size: int = 400,
    *,
    corpus: Iterable[str] = (),
    split_pattern: str | None = None,
) -> PreTrainedTokenizerBase:
    """Build, save to `path` and load back through `AutoTokenizer`, the same path a real target takes.

    `corpus` adds training text so the vocabulary fits a data set (the tiny target's); `split_pattern`
    replaces GPT-2's byte-level split with a regex split first (QWEN_SPLIT_PATTERN: Qwen's).
    """
    backend = Tokenizer(models.BPE())
    if split_pattern is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # trim_offsets=False, as in Qwen's tokenizer: loss masks come from exact character offsets.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([*_CORPUS, *corpus], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=131072,
    )
    tokenizer.add_tokens(list(THINK_TOKENS))
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))
