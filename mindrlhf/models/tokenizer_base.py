"""What every tokenizer of the project shares: ids and text through a Hugging Face `tokenizers.Tokenizer`."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer


class TokenizersBackend:
    """Encoding and decoding through `self._tokenizer` (a `tokenizers.Tokenizer` set by the subclass).

    Subclasses add the special tokens (`eos_token_id`, `pad_token_id`, `stop_token_ids`), the chat template
    and `source` (the file errors about the tokenizer name).
    """

    _tokenizer: Tokenizer
    source: str

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of ids, including the added special tokens."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (byte-level form, e.g. 'Ġthe'), or None if unknown."""
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, or None if out of range."""
        return self._tokenizer.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised. `add_special_tokens`
        applies the tokenizer's post-processor (e.g. a BOS for Llama-style folders; nothing for Qwen)."""
        if not isinstance(text, str):
            raise TypeError(f"encode: expected str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def batch_encode(self, texts: Iterable[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` for many texts (in parallel inside `tokenizers`)."""
        texts = list(texts)
        for position, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"batch_encode: item {position} is {type(text).__name__}, expected str")
        return [enc.ids for enc in self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 byte sequences become U+FFFD (like transformers' errors='replace')."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch_ids: Iterable[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        """`decode` for many id lists."""
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch_ids]

    def decode_masked(self, token_ids, token_mask, skip_special_tokens: bool) -> list[str]:
        """The text of each row of `token_ids` [N, L], its tokens where `token_mask` is set only."""
        return self.batch_decode([ids[mask.astype(bool)].tolist() for ids, mask in zip(token_ids, token_mask)],
                                 skip_special_tokens=skip_special_tokens)

    def completion(self, ids: Sequence[int]) -> str:
        """The text rewards, evaluations and stop strings read of a response's token ids: special tokens skipped."""
        return self.decode(ids, skip_special_tokens=True)

    def completions(self, token_ids, token_mask) -> list[str]:
        """`completion` of each row of `token_ids` [N, L], its tokens where `token_mask` is set only."""
        return self.decode_masked(token_ids, token_mask, skip_special_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size
