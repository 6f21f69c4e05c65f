"""GPT-2-style and Llama-style tokenizers for comparing encodings with TRL (built locally, nothing from a hub).

GPT-2 style: no BOS added to a text, a chat template that renders no BOS. Llama style: the tokenizer adds BOS to a
text (a template post-processor) and the chat template starts with the BOS token."""

from __future__ import annotations

from conftest import build_tokenizer

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def gpt2_style():
    return build_tokenizer()


def llama_style():
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer(chat_template=LLAMA_TEMPLATE)
    backend = tok.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = LLAMA_TEMPLATE
    return fast
