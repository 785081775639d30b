"""Texts and conversations the tokenizer tests encode with ours and with transformers' (tests/models/test_tokenizer.py
and test_hf_tokenizer.py)."""

PARITY_TEXTS = [
    "",
    "Hello world",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "日本語のテキストと한국어 텍스트",
    "def add(a, b):\n    if a > b:\n        return a + b\n\treturn None\n",
    "class Foo:\n\n    def __init__(self):\n        self.x = [1, 2, 3]  # comment\n",
    "The price is 12345.678 dollars, i.e. 1,000 or 1000000 items; -3.5e-10 and 0x1F.",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "Family: 👨‍👩‍👧‍👦, rainbow flag 🏳️‍🌈, thumbs 👍🏽, flag 🇨🇳🇺🇸, keycap 1️⃣",
    "   leading spaces and trailing spaces   ",
    "many     spaces\t\ttabs\n\n\nnewlines\r\n\r\nCRLF \n \n end",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><|im_start|>",
    "almost special <|im_end| and <|foo|> and <| im_end |>",
    "café naïve résumé Ångström",
    "e\u0301 (decomposed), \u212b (Angstrom sign), \u1100\u1161 (jamo), \ufb01 (fi ligature)",
    "I'M here, it's ok, THEY'LL go, we'd've, you 're",
    "Arabic: مرحبا بالعالم, Hindi: नमस्ते दुनिया, Thai: สวัสดีชาวโลก",
    "math: ∑_{i=1}^{n} i² = n(n+1)/2, ∞ ≠ ∅, √2 ≈ 1.414",
    "control \x00\x01\x7f bytes and \u200b zero width \ufeff BOM",
    "reason inside <answer>42</answer> tags",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are a math tutor."}, {"role": "user", "content": "What is 12345.678 + 1?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 你好"}, {"role": "user", "content": "Solve:\n  x + 1 = 3"}],
    [{"role": "user", "content": "Only a user turn, no system message"}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Let me check."},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "{\"rain\": false}"},
     {"role": "user", "content": "thanks"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}, {"role": "system", "content": "late sys"},
     {"role": "user", "content": "b"}],
]
