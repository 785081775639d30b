"""`GenerationConfig`: how the infer net samples responses (lengths, group size, sampling, buckets), and
`bucket_length`, the padding rule of its prompt buckets (shared with the prompt reader)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from mindrlhf.configs.base import ConfigError, Validated, help_field

# Qwen2/Qwen2.5 chat models end a turn with <|im_end|> and a document with <|endoftext|>.
QWEN_IM_END_ID = 151645
QWEN_ENDOFTEXT_ID = 151643


def bucket_length(length: int, buckets: Sequence[int] | None) -> int:
    """The smallest bucket >= `length` (or `length` itself when there are no buckets).

    Padding to a few fixed lengths keeps the number of compiled graph shapes small.
    """
    if length < 0:
        raise ValueError(f"length must be non-negative, got {length}")
    if not buckets:
        return length
    for bucket in buckets:
        if bucket >= length:
            return bucket
    raise ValueError(f"length {length} is longer than the largest length bucket {buckets[-1]}")


def shown_as(field: dataclasses.Field, text: str) -> dataclasses.Field:
    """`field` (a `help_field`) whose flag's --help shows `(default: <text>)`: a default resolved later (from the
    tokenizer, from another field) rather than the dataclass default."""
    field.metadata = {**field.metadata, "shown_default": text}
    return field


@dataclass(frozen=True)
class GenerationConfig(Validated):
    """Sampling settings of the rollout phase (the YAML section a GRPO config nests as `generation`).

    Frozen and validated as it is made (`Validated`): a changed config is a new one, `dataclasses.replace(config,
    field=value)`, checked then. What depends on the network (`check_model`: the vocabulary, the cache length
    against seq_length) is checked by the job plan and by a `Generator` given the config, against its model.

    In a training job `eos_token_ids` and `pad_token_id` come from the tokenizer unless the YAML or a flag sets
    them (`mindrlhf.trainer.plan.resolve_token_ids`); the Qwen defaults here serve a config built in code.

    Sampling order follows Hugging Face `generate` (and vLLM but for min-p, which vLLM applies before top-p):
    logits / temperature, then top-k, then top-p, then min-p, then a categorical draw, on the device
    (`mindrlhf.generation.selection`), at a uniform a row from the host's seeded stream. `do_sample`, `temperature`,
    `top_k`, `top_p` and `min_p` are constants of that small token-selection graph (one compiled per setting); the
    fields that fix the shapes of the model's graphs are `max_new_tokens`,
    `prompt_buckets`, `use_kv_cache`, and the batch size `num_generations` contributes to.
    """

    max_new_tokens: int = help_field(
        512, "Response length budget; responses are padded to exactly this many tokens, so it is also the static "
             "width of everything the trainer sees per response. DeepSeekMath's GRPO used 1024.")
    num_generations: int = help_field(
        8, "Responses sampled per prompt: GRPO's group size G (advantages are normalised within the group). "
           "DeepSeekMath used 64; TRL's default num_generations is 8. Sample i of prompt j is row j*G+i.")
    do_sample: bool = help_field(
        True, "Sample from the distribution; false = greedy (argmax), as does temperature 0. GRPO needs sampling: "
              "with greedy decoding every member of a group is identical and all advantages are zero.")
    temperature: float = help_field(
        1.0, "Logits are divided by this before sampling and before computing the returned log-probs "
             "(TRL/verl convention: the trainer must divide by the same value). 0 = greedy. Must be >= 0.")
    top_k: int = help_field(
        0, "Keep only the k most likely tokens before sampling; 0 = off. RL usually leaves it off so that the "
           "sampled distribution stays the policy being optimised.")
    top_p: float = help_field(
        1.0, "Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p (the most "
             "likely token always kept); 1.0 = off. In (0, 1].")
    min_p: float = help_field(
        0.0, "Min-p sampling (Nguyen et al. 2024; vLLM's and transformers' min_p): after top-k and top-p, drop the "
             "tokens whose probability is below min_p times the most likely one's, so the cut follows the model's "
             "confidence. 0.0 = off. In [0, 1].")
    eos_token_ids: list[int] = shown_as(help_field(
        [QWEN_IM_END_ID, QWEN_ENDOFTEXT_ID],
        "A response ends at the first of these tokens (kept in the response and its mask). A training job takes "
        "the tokenizer's stop tokens (its eos_token and generation_config.json's eos_token_id) unless this is set "
        "in the YAML or by flag: a value set there is used instead (logged). Empty = always generate "
        "max_new_tokens."), "the tokenizer's")
    stop_strings: list[str] = help_field(
        [], "A response also ends at the token that completes one of these strings in its text (vLLM's `stop`, "
            "transformers' `stop_strings`; e.g. '</answer>'); the token is kept in the response and its mask, as an "
            "EOS is. The text is the rewards' (special tokens skipped). Empty = off. Each decode step decodes the "
            "tail of every running response on the host.")
    pad_token_id: int = shown_as(help_field(
        QWEN_ENDOFTEXT_ID, "Fills prompts on the left and responses after their EOS. A training job takes the "
                           "tokenizer's pad_token (else its eos_token) unless this is set in the YAML or by flag: a "
                           "value set there is used instead (logged)."), "the tokenizer's")
    prompt_buckets: list[int] = help_field(
        [64, 128, 256, 512, 1024],
        "Lengths prompts are left-padded up to (the smallest that fits the longest prompt of the batch): each "
        "bucket is one static prefill shape, compiled once. A prompt longer than the largest bucket is an error; "
        "largest bucket + max_new_tokens is the KV-cache length and must be <= model seq_length.")
    seed: int = help_field(
        0, "Seed of the host random stream used for sampling. The stream advances across generate() calls, so "
           "successive batches differ; the same seed and the same call sequence give the same samples.")
    max_num_seqs: int = help_field(
        0, "Decode slots of an inference rank (vLLM's max_num_seqs): at most this many responses are decoded at once, "
           "and a slot whose response has ended takes the next waiting sample (its prompt prefilled into the slot) "
           "until every sample of the rank's batch is done. The KV cache holds this many rows instead of the whole "
           "batch. 0 = every row of the batch at once (one fixed batch: a row that ended waits for the longest). "
           "Samples are the same for any value (a sample's random numbers follow the sample, not the slot) up to "
           "the float rounding of another batch shape.")
    max_num_batched_tokens: int = help_field(
        0, "Prefill budget (vLLM's max_num_batched_tokens): at most this many prompt positions (prompts x their "
           "bucket) go through one prefill call, so a rank's prompts are prefilled in chunks of the largest count "
           "that divides them and fits (one compiled shape a bucket); the memory plan counts that many. 0 = all of "
           "a rank's prompts in one call. With max_num_seqs a call reads one prompt. At least the largest prompt "
           "bucket (a prompt is prefilled in one call).")
    max_model_len: int = help_field(
        0, "vLLM's context limit: when set, the largest prompt bucket + max_new_tokens (the KV cache's positions) "
           "must be at most this. 0 = the model's seq_length is the only limit.")
    min_decode_rows: int = help_field(
        0, "Stepping down for a rollout's tail: 0 = off (every decode call computes all of the batch's rows, or all "
           "max_num_seqs slots, until the last response ends). N > 0: once no sample waits for a slot and the "
           "responses still running fit in a smaller row count of the ladder rows, rows / 2, rows / 4, ... (rounded "
           "up, down to N), their KV-cache rows move into that count's cache and decoding goes on there, so rows "
           "whose response ended stop being computed. Each count compiles its own decode graph and holds its own KV "
           "cache (the memory plan counts them). Samples are the same for any value up to the float rounding of "
           "another batch shape.")
    step_down_ratio: float = help_field(
        0.5, "The step-down ladder's ratio (with min_decode_rows): each smaller row count is this fraction of the one "
             "above, rounded up and at least one row fewer. 0.5 halves (rows, rows / 2, ...: the fewest decode graphs "
             "and KV caches; up to half of a count's rows idle); 0.67 leaves at most a third of them idle for about "
             "twice the caches' rows and twice the decode graphs (measured in docs/performance.md).")
    max_tool_calling_iterations: int = help_field(
        0, "Tool turns a response may take (TRL's max_tool_calling_iterations; verl's max_assistant_turns is this "
           "+ 1): a turn of the model that calls a tool (tools.tools) pauses its row, the calls run, their answers "
           "go back as the chat template's tool turn and decoding resumes. 0 = no tools. A response that would call "
           "once more ends there, as a clipped response does.")
    max_tool_response_tokens: int = help_field(
        256, "Tokens of one tool turn as the model reads it (the template's framing included); a longer answer is "
             "cut to fit and counted as truncated. With max_tool_calling_iterations a response row is "
             "max_new_tokens + iterations x this wide.")
    use_kv_cache: bool = help_field(
        True, "Prefill once, then decode one token per step against the static KV cache. False recomputes the "
              "full forward over a fixed [prompt bucket + max_new_tokens] buffer each step (for comparison).")

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (do_sample false or temperature 0)."""
        return not self.do_sample or self.temperature == 0

    @property
    def response_width(self) -> int:
        """Positions of a response row: the model's max_new_tokens, plus each tool turn's when tools are on."""
        return self.max_new_tokens + self.max_tool_calling_iterations * self.max_tool_response_tokens

    @property
    def cache_length(self) -> int:
        """Slots of the static KV cache: the largest prompt bucket plus a response row (`response_width`)."""
        return max(self.prompt_buckets) + self.response_width

    @property
    def extend_widths(self) -> list[int]:
        """The widths the extend graph compiles for (a tool turn and the token before it): 8, 16, 32, ... below
        max_tool_response_tokens + 1, then that."""
        widest = self.max_tool_response_tokens + 1
        widths = [8]
        while widths[-1] * 2 < widest:
            widths.append(widths[-1] * 2)
        return widths + [widest] if widths[-1] < widest else widths

    def decode_rows(self, rows: int) -> int:
        """The KV-cache rows a batch of `rows` samples decodes in: `max_num_seqs` slots when fewer (continuous
        batching), else the whole batch."""
        return min(rows, self.max_num_seqs) if self.max_num_seqs else rows

    def decode_row_counts(self, rows: int) -> list[int]:
        """The row counts a rollout that starts decoding `rows` rows steps down through (`min_decode_rows`), largest
        first: rows, then each the one above times `step_down_ratio` (rounded up, at least one fewer) down to
        min_decode_rows; [rows] when off."""
        counts = [rows]
        while self.min_decode_rows and counts[-1] > self.min_decode_rows:
            smaller = min(counts[-1] - 1, math.ceil(counts[-1] * self.step_down_ratio - 1e-9))
            counts.append(max(self.min_decode_rows, smaller))
        return counts

    def prefill_prompts(self, prompts: int, bucket: int) -> int:
        """Prompts of `bucket` positions a prefill call reads out of `prompts`: all of them, or with
        `max_num_batched_tokens` the largest count that divides them and fits the budget (at least 1)."""
        if not self.max_num_batched_tokens:
            return prompts
        fit = max(1, self.max_num_batched_tokens // bucket)
        return max(d for d in range(1, min(prompts, fit) + 1) if prompts % d == 0)

    def bucket_for(self, prompt_length: int) -> int:
        """The smallest bucket >= prompt_length; a ConfigError when none is long enough."""
        try:
            return bucket_length(prompt_length, sorted(self.prompt_buckets))
        except ValueError:
            pass
        raise ConfigError(f"generation.prompt_buckets: a prompt of {prompt_length} tokens is longer than the largest "
                          f"bucket {max(self.prompt_buckets)}; add a larger bucket or truncate the prompts")

    def validate(self) -> None:
        """Raises ConfigError naming the field when a value is out of range (run once, as the config is made)."""
        def check(ok: bool, name: str, requirement: str) -> None:
            if not ok:
                raise ConfigError(f"generation.{name} {requirement}, got {getattr(self, name)!r}")

        check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens", "must be an integer >= 1")
        check(_is_int(self.num_generations) and self.num_generations >= 1, "num_generations", "must be an integer >= 1")
        check(isinstance(self.do_sample, bool), "do_sample", "must be true or false")
        check(isinstance(self.use_kv_cache, bool), "use_kv_cache", "must be true or false")
        check(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
              "temperature", "must be a finite number >= 0 (0 = greedy)")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 = off)")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1] (1.0 = off)")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1] (0.0 = off)")
        check(isinstance(self.eos_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in self.eos_token_ids),
              "eos_token_ids", "must be a list of token ids >= 0")
        check(_is_int(self.pad_token_id) and self.pad_token_id >= 0, "pad_token_id", "must be a token id >= 0")
        check(isinstance(self.stop_strings, (list, tuple)) and all(isinstance(x, str) and x for x in self.stop_strings),
              "stop_strings", "must be a list of non-empty strings")
        buckets = self.prompt_buckets
        check(isinstance(buckets, (list, tuple)) and len(buckets) > 0 and all(_is_int(b) and b >= 1 for b in buckets),
              "prompt_buckets", "must be a non-empty list of positive lengths")
        check(all(a < b for a, b in zip(buckets, buckets[1:])), "prompt_buckets", "must be strictly increasing")
        check(_is_int(self.seed) and self.seed >= 0, "seed", "must be an integer >= 0")
        check(_is_int(self.max_num_seqs) and self.max_num_seqs >= 0, "max_num_seqs",
              "must be an integer >= 0 (0 = the whole batch at once)")
        check(self.use_kv_cache or not self.max_num_seqs, "max_num_seqs",
              "needs use_kv_cache (the slots are KV-cache rows)")
        check(_is_int(self.min_decode_rows) and self.min_decode_rows >= 0, "min_decode_rows",
              "must be an integer >= 0 (0 = never step down)")
        check(self.use_kv_cache or not self.min_decode_rows, "min_decode_rows",
              "needs use_kv_cache (stepping down moves KV-cache rows)")
        check(_is_number(self.step_down_ratio) and 0 < self.step_down_ratio < 1, "step_down_ratio",
              "must be in (0, 1) (0.5 = halve the rows at each step down)")
        check(_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 0, "max_num_batched_tokens",
              "must be an integer >= 0 (0 = every prompt of a rank in one prefill call)")
        check(not self.max_num_batched_tokens or self.max_num_batched_tokens >= max(buckets), "max_num_batched_tokens",
              f"must be at least the largest prompt bucket {max(buckets)} (a prompt is prefilled in one call)")
        check(_is_int(self.max_tool_calling_iterations) and self.max_tool_calling_iterations >= 0,
              "max_tool_calling_iterations", "must be an integer >= 0 (0 = no tools)")
        check(_is_int(self.max_tool_response_tokens) and self.max_tool_response_tokens >= 1,
              "max_tool_response_tokens", "must be an integer >= 1")
        check(self.use_kv_cache or not self.max_tool_calling_iterations, "max_tool_calling_iterations",
              "needs use_kv_cache (a tool's answer is appended to the KV cache)")
        check(_is_int(self.max_model_len) and self.max_model_len >= 0, "max_model_len", "must be an integer >= 0")
        check(not self.max_model_len or self.cache_length <= self.max_model_len, "max_model_len",
              f"must hold the largest prompt bucket {max(buckets)} + a response row {self.response_width} = "
              f"{self.cache_length} positions")

    def check_model(self, vocab_size: int, seq_length: int, model_yaml: str = "") -> None:
        """Checks the fields that depend on the network (`model_yaml`, named in the error when given): token ids in
        the vocabulary (`check_token_ids`), cache within seq_length (`check_cache_length`)."""
        self.check_token_ids(vocab_size, model_yaml)
        self.check_cache_length(seq_length, model_yaml)

    def check_token_ids(self, vocab_size: int, model_yaml: str = "") -> None:
        """The stop and pad ids are in the vocabulary of the net `model_yaml` describes."""
        of = f" of {model_yaml}" if model_yaml else ""
        for name, ids in (("eos_token_ids", list(self.eos_token_ids)), ("pad_token_id", [self.pad_token_id])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ConfigError(f"generation.{name}: token id(s) {bad} outside the model vocabulary "
                                  f"(vocab_size={vocab_size}{of})")

    def check_cache_length(self, seq_length: int, model_yaml: str = "") -> None:
        """The largest prompt bucket + max_new_tokens fit the seq_length of the net `model_yaml` describes."""
        if self.cache_length > seq_length:
            of = f" of {model_yaml}" if model_yaml else ""
            tools = (f" + max_tool_calling_iterations={self.max_tool_calling_iterations} x "
                     f"max_tool_response_tokens={self.max_tool_response_tokens}") if self.max_tool_calling_iterations \
                else ""
            raise ConfigError(
                f"generation.max_new_tokens={self.max_new_tokens}{tools} + largest of generation.prompt_buckets="
                f"{max(self.prompt_buckets)} = {self.cache_length} exceeds model_config.seq_length={seq_length}{of} "
                f"(the KV cache / generation buffer length)")

    def check_min_decode_rows(self, rows: int, counted: str) -> None:
        """`min_decode_rows` must be able to step down from the `rows` an inference rank decodes at most (`counted`
        says how they are counted): a value >= rows leaves every row count at `rows`, so it would do nothing."""
        if self.min_decode_rows >= rows > 0:
            useful = f"the largest useful value is {rows - 1} (0 = off)" if rows > 1 else "set 0 (off)"
            raise ConfigError(f"generation.min_decode_rows={self.min_decode_rows} has no effect: an inference rank "
                              f"decodes at most {rows} row{'s' if rows > 1 else ''} ({counted}); {useful}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
