"""A real tokenizer with a chat template, built locally in a second (no hub, no downloads): byte-level BPE
trained on the demo conversations, wrapped in PreTrainedTokenizerFast and saved like a model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "remote_payload" / "data" / "demo_chat.jsonl"
SPECIAL = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-style turns. PLAIN has no generation markers (spans come from diffing renders); TAGGED marks the
# assistant text with {% generation %} (transformers' assistant mask).
PLAIN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TAGGED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
          "{{ m['content'] }}{% endgeneration %}<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def corpus_lines() -> list[str]:
    out = []
    for line in DEMO.read_text().splitlines():
        for m in json.loads(line)["messages"]:
            out.append(f"{m['role']}\n{m['content']}")
    return out


def make_chat_tokenizer(out_dir: Path, template: str = PLAIN, vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(corpus_lines(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = template
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return tok
