"""Greedy answers of a policy to R1-style prompts, shared by the policy tests (tools/sft_policy.py's and the
bundled run's)."""
from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.data.templates import build_prompt
from mindrlhf.generation import Generator


def greedy_completions(model, tokenizer, problems, max_new_tokens):
    """`model`'s greedy completions (decoded, special tokens dropped) of `problems` in the `r1_think` prompt."""
    prompts = [tokenizer.encode(build_prompt(p.question, "r1_think")) for p in problems]
    generator = Generator(model, GenerationConfig(max_new_tokens=max_new_tokens, num_generations=1, do_sample=False,
                                                  eos_token_ids=tokenizer.stop_token_ids,
                                                  pad_token_id=tokenizer.pad_token_id, prompt_buckets=[160]))
    out = generator.generate(prompts)
    return tokenizer.batch_decode([ids[m.astype(bool)].tolist() for ids, m in
                                   zip(out.response_ids, out.response_mask)], skip_special_tokens=True)
