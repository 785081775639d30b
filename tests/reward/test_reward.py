"""Rule rewards (accuracy, format), answer extraction, the registry and user functions by import path."""
import logging
import textwrap
import time

import numpy as np
import pytest

from mindrlhf.reward import (
    REWARD_FUNCTIONS,
    RewardError,
    accuracy_reward,
    build_reward_fn,
    extract_completion_answer,
    extract_gold_answer,
    format_reward,
    get_reward_function,
    hash_format_reward,
    last_boxed_content,
    parse_number,
    rules,
)

GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")

# (completion, solution, expected reward, why)
ACCURACY_CASES = [
    ("<answer>72</answer>", GSM8K_SOLUTION, 1.0, "plain answer tag vs GSM8K gold"),
    ("<answer>71</answer>", GSM8K_SOLUTION, 0.0, "wrong answer"),
    ("The total is 72.", GSM8K_SOLUTION, 1.0, "no tag: last number, trailing period"),
    ("<answer>72 dollars</answer>", "72", 1.0, "trailing unit word"),
    ("<answer>72.0</answer>", "#### 72", 1.0, "72.0 == 72"),
    ("<answer>72.5</answer>", "#### 72", 0.0, "decimals are not truncated"),
    ("<answer>1,000</answer>", "#### 1000", 1.0, "thousands comma in the completion"),
    ("<answer>1000</answer>", "#### 1,000", 1.0, "thousands comma in the gold"),
    ("<answer>$1,234.50</answer>", "1234.5", 1.0, "dollar sign, comma and decimals"),
    ("The cost is \\$1{,}234.50 in total", "#### 1234.50", 1.0, "LaTeX dollar and {,} separator"),
    ("<answer>-3</answer>", "#### -3", 1.0, "negative"),
    ("<answer>3</answer>", "#### -3", 0.0, "sign matters"),
    ("It drops by 10 - 3 = 7 degrees", "#### 7", 1.0, "a minus between numbers is not a sign"),
    ("<answer>25%</answer>", "#### 25", 1.0, "percent sign dropped, value kept"),
    ("<answer>25%</answer>", "#### 0.25", 0.0, "25% is not read as 0.25"),
    ("so the answer is \\boxed{{72}}", "#### 72", 1.0, "nested braces in boxed"),
    ("\\boxed{72} ... wait, no: \\boxed{\\text{74}}", "#### 74", 1.0, "last boxed wins"),
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\boxed{\\frac{1}{2}}", 1.0, "LaTeX fractions on both sides"),
    ("<answer>0.5</answer>", "\\boxed{\\dfrac{1}{2}}", 1.0, "fraction == decimal"),
    ("<answer>3/4</answer>", "#### 0.75", 1.0, "slash fraction"),
    ("<answer>x = 5</answer>", "\\boxed{5}", 1.0, "variable assignment"),
    ("<answer>72</answer> but 12 people left, so 60", "#### 72", 1.0, "answer tag beats the last number"),
    ("<answer>70</answer> hmm <answer>72</answer>", "#### 72", 1.0, "last of several answer tags"),
    ("<answer>72</answer> hmm <answer>70</answer>", "#### 72", 0.0, "last of several answer tags (wrong)"),
    ("<answer>seventy-two</answer> 72", "#### 72", 0.0, "an answer tag is authoritative"),
    ("<answer>I think \\boxed{72}, not 70</answer>", "#### 72", 1.0, "boxed inside the answer tag"),
    ("<answer>72</answer>", "#### 72\n\nThe answer above is the total of 3 days.", 1.0, "#### gold with text after"),
    ("<answer>72</answer>", "#### 72 clips", 1.0, "#### gold with a unit"),
    ("<answer>72</answer>", "The answer is \\boxed{72}.", 1.0, "boxed gold"),
    ("<answer>0.333333333</answer>", "\\boxed{\\frac{1}{3}}", 1.0, "relative tolerance 1e-6"),
    ("<answer>0.3333</answer>", "\\boxed{\\frac{1}{3}}", 0.0, "outside the tolerance"),
    ("<answer>0</answer>", "#### 0", 1.0, "zero"),
    ("<answer>1</answer>", "x + 1", 0.0, "unparseable gold never rewards"),
    ("<answer>2</answer>", "\\boxed{\\sqrt{2}}", 0.0, "radical gold is unparseable"),
    ("2 + 6 = 8\n#### 72\nQuinn has 72 pencils in all, 8 more", "#### 72", 1.0, "#### line beats the last number"),
    ("#### 2\n#### 3\n#### 72", "#### 72", 0.0, "the first #### line is the answer"),
    ("so #### $1,000.", "#### 1000", 1.0, "#### line normalised like an answer tag"),
    ("#### 70 + 2 = 72", "#### 72", 1.0, "#### line that is not one number: its last number"),
    ("\\boxed{72} #### 70", "#### 72", 1.0, "boxed beats the #### line"),
    ("<answer>70</answer> #### 72", "#### 72", 0.0, "the answer tag beats the #### line"),
    ("", "#### 72", 0.0, "empty completion"),
    ("no numbers here", "#### 72", 0.0, "no number in the completion"),
]


@pytest.mark.parametrize("completion,solution,expected,why", ACCURACY_CASES, ids=[c[3] for c in ACCURACY_CASES])
def test_accuracy_reward(completion, solution, expected, why):
    assert accuracy_reward([completion], [solution]) == [expected], why


@pytest.mark.parametrize("text,expected", [
    ("72", 72.0), ("-3", -3.0), (" 1,234,567 ", 1234567.0), ("$1,234.50", 1234.5), ("72.", 72.0), (".5", 0.5),
    ("{{72}}", 72.0), ("\\dfrac34", 0.75), ("-\\frac{1}{2}", -0.5), ("72 \\text{ cm}", 72.0), ("1/0", None),
    ("x+1", None), ("2\\pi", None), ("1 2", None), ("", None), ("\u22124", -4.0), ("90^\\circ", 90.0),
])
def test_parse_number(text, expected):
    assert parse_number(text) == expected


def test_extraction_helpers():
    assert last_boxed_content("a \\boxed{x^{2}} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed_content("\\boxed{7} then \\boxed{8") == "7"  # an unclosed boxed is skipped
    assert last_boxed_content("none") is None
    assert extract_gold_answer("#### ") is None
    assert extract_completion_answer("<answer></answer> 5") is None


def test_unparseable_gold_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(rules, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="mindrlhf.reward.rules"):
        assert accuracy_reward(["1", "2", "x"], ["x+1", "y", "z"]) == [0.0, 0.0, 0.0]
    assert len([r for r in caplog.records if "no numeric gold answer" in r.getMessage()]) == 1


# (completion, expected format reward, why)
FORMAT_CASES = [
    ("<think>reasoning</think><answer>72</answer>", 1.0, "minimal"),
    ("  <think>\nreasoning\n</think>\n\n<answer>\n72\n</answer>\n", 1.0, "whitespace around and between"),
    ("<think></think><answer>72</answer>", 1.0, "empty think is allowed"),
    ("<answer>72</answer>", 0.0, "missing think"),
    ("<think>reasoning</think>", 0.0, "missing answer"),
    ("<answer>72</answer><think>reasoning</think>", 0.0, "answer before think"),
    ("<think>reasoning</think><answer>72</answer> Hope this helps!", 0.0, "text after answer"),
    ("Sure! <think>reasoning</think><answer>72</answer>", 0.0, "text before think"),
    ("<think>r</think> so <answer>72</answer>", 0.0, "text between the blocks"),
    ("<think>r</think><answer>7</answer><answer>72</answer>", 0.0, "two answers"),
    ("<think>a <think>b</think> c</think><answer>72</answer>", 0.0, "nested think"),
    ("<think>r <answer>1</answer></think><answer>72</answer>", 0.0, "answer nested in think"),
    ("<think>reasoning<answer>72</answer>", 0.0, "unclosed think"),
    ("<THINK>r</THINK><ANSWER>72</ANSWER>", 0.0, "tags are case-sensitive"),
    ("", 0.0, "empty"),
]


HASH_FORMAT_CASES = [
    ("2 * 3 = 6\n#### 6", 1.0, "steps then the answer line"),
    ("#### 6", 1.0, "the answer line alone"),
    ("2 * 3 = 6\n####6\n\n", 1.0, "no space, trailing blank lines"),
    ("2 * 3 = 6\n#### 6 pencils", 1.0, "a unit word"),
    ("#### 6\nSo Quinn has 6 pencils.", 0.0, "text after the answer line"),
    ("#### 2\n#### 6", 0.0, "two answer lines"),
    ("2 * 3 = 6\n#### six", 0.0, "not a number"),
    ("2 * 3 = 6 #### 6", 1.0, "the answer on the last line, after text"),
    ("2 * 3 = 6", 0.0, "no answer line"),
    ("", 0.0, "empty"),
]


FORMAT_RULE_CASES = ([(format_reward, *case) for case in FORMAT_CASES]
                     + [(hash_format_reward, *case) for case in HASH_FORMAT_CASES])


@pytest.mark.parametrize("fn,completion,expected,why", FORMAT_RULE_CASES,
                         ids=[f"{c[0].__name__}: {c[3]}" for c in FORMAT_RULE_CASES])
def test_format_rewards(fn, completion, expected, why):
    assert fn([completion], ["#### 72"]) == [expected], why


@pytest.mark.parametrize("fn", [accuracy_reward, format_reward, hash_format_reward])
def test_input_validation(fn):
    with pytest.raises(TypeError, match=r"completions\[1\] must be a str, got int"):
        fn(["a", 3], ["1", "2"])
    with pytest.raises(TypeError, match=r"solutions\[0\] must be a str, got NoneType"):
        fn(["a"], [None])
    with pytest.raises(TypeError, match="completions must be a list of str, got str"):
        fn("abc", ["1", "2", "3"])
    with pytest.raises(ValueError, match="same length, got 2 completions and 1 solutions"):
        fn(["a", "b"], ["1"])


# ----------------------------------------------------------------------------------------------- registry

def test_registry_and_weighted_sum():
    assert {"accuracy", "format", "hash_format"} <= set(REWARD_FUNCTIONS.names())
    assert get_reward_function("accuracy") is accuracy_reward
    assert get_reward_function("hash_format") is hash_format_reward
    reward_fn = build_reward_fn(["accuracy", "format"], [1.0, 0.5])
    completions = ["<think>t</think><answer>72</answer>", "<answer>72</answer>", "<think>t</think><answer>1</answer>"]
    total, per_function = reward_fn(completions, ["#### 72"] * 3)
    assert total.dtype == np.float32 and total.shape == (3,)
    np.testing.assert_allclose(total, [1.5, 1.0, 0.5])
    np.testing.assert_array_equal(per_function["accuracy"], [1.0, 1.0, 0.0])
    np.testing.assert_array_equal(per_function["format"], [1.0, 0.0, 1.0])
    assert list(per_function) == ["accuracy", "format"]
    total, _ = build_reward_fn(["accuracy", "format"])(completions, ["#### 72"] * 3)
    np.testing.assert_allclose(total, [2.0, 1.0, 1.0])  # weights default to 1
    empty_total, empty_parts = reward_fn([], [])
    assert empty_total.shape == (0,) and empty_parts["format"].shape == (0,)


def test_build_reward_fn_errors():
    with pytest.raises(ValueError, match="unknown reward function 'acuracy'"):
        build_reward_fn(["acuracy"])
    with pytest.raises(ValueError, match="weights has 1 entries but 2 reward functions"):
        build_reward_fn(["accuracy", "format"], [1.0])
    with pytest.raises(ValueError, match="weight of reward function 'format' must be a finite number"):
        build_reward_fn(["accuracy", "format"], [1.0, float("nan")])
    with pytest.raises(ValueError, match="more than once"):
        build_reward_fn(["accuracy", "accuracy"])
    with pytest.raises(TypeError, match="non-empty list"):
        build_reward_fn("accuracy")
    with pytest.raises(TypeError, match=r"completions\[0\] must be a str"):
        build_reward_fn(["format"])([b"bytes"], ["1"])


USER_MODULE = textwrap.dedent("""
    def length_reward(completions, solutions):
        return [len(c) / 10 for c in completions]

    def nan_reward(completions, solutions):
        return [0.0, float("nan")][: len(completions)]

    def short_reward(completions, solutions):
        return [1.0]

    def none_reward(completions, solutions):
        return [None for _ in completions]

    def string_reward(completions, solutions):
        return ["1" for _ in completions]

    SEEN = {}

    def trl_reward(prompts, completions, solution, **kwargs):
        SEEN.update(prompts=prompts, completions=completions, solution=solution, **kwargs)
        return [None if c == "skip" else float(len(c)) for c in completions]

    def trl_kwargs_only(completions, **kwargs):
        return [1.0 if s in c else 0.0 for c, s in zip(completions, kwargs["solution"])]

    def scalar_reward(completions, solutions):
        return 1.0

    def failing_reward(completions, solutions):
        raise KeyError("solution_key")

    def slow_reward(completions, solutions):
        import time
        try:
            time.sleep(30)
        except Exception:  # the time limit is not an Exception a user's handler swallows
            return [0.0 for _ in completions]
        return [1.0 for _ in completions]

    class Scorer:
        @staticmethod
        def score(completions, solutions):
            return [2.0 for _ in completions]

    NOT_A_FUNCTION = 3
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "mindrlhf_test_user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mindrlhf_test_user_rewards"


def test_user_function_by_import_path(user_module):
    reward_fn = build_reward_fn(["format", f"{user_module}:length_reward", f"{user_module}:Scorer.score"],
                                [1.0, 2.0, 0.5])
    total, per_function = reward_fn(["<think></think><answer>1</answer>", "abcde"], ["1", "2"])
    np.testing.assert_allclose(per_function[f"{user_module}:length_reward"], [3.3, 0.5], rtol=1e-6)
    np.testing.assert_allclose(total, [1.0 + 6.6 + 1.0, 1.0 + 1.0], rtol=1e-6)


@pytest.mark.parametrize("attribute,message", [
    ("nan_reward", r"^reward function '.*:nan_reward' returned nan at index 1, expected a finite number"),
    ("short_reward", r"^reward function '.*:short_reward' returned 1 values for 2 completions$"),
    ("string_reward", r"^reward function '.*:string_reward' returned str '1' at index 0, expected a number or None$"),
    ("scalar_reward", r"^reward function '.*:scalar_reward' must return a list of numbers, got float$"),
    ("failing_reward", r"^reward function '.*:failing_reward' raised KeyError: 'solution_key' at "
                       r".*mindrlhf_test_user_rewards.py:\d+$"),
])
def test_user_function_bad_output(user_module, attribute, message):
    """Whatever a function does wrong is one RewardError naming it and what it did (a raise: the type, the message
    and the user's own line)."""
    reward_fn = build_reward_fn([f"{user_module}:{attribute}"])
    with pytest.raises(RewardError, match=message) as info:
        reward_fn(["a", "b"], ["1", "2"])
    assert len(str(info.value).splitlines()) == 1
    if attribute == "failing_reward":
        assert isinstance(info.value.__cause__, KeyError)  # the traceback the job writes to a file


def test_a_reward_function_past_its_time_limit_is_one_error(user_module):
    """`reward.reward_timeout` bounds each call, even of a function that catches every Exception around its wait."""
    reward_fn = build_reward_fn([f"{user_module}:slow_reward"], timeout=0.3)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"^reward function '.*:slow_reward' did not return within 0.3 s for 2 "
                                          r"completions \(reward.reward_timeout\)$"):
        reward_fn(["a", "b"], ["1", "2"])
    assert time.monotonic() - start < 5
    assert build_reward_fn(["format"], timeout=0.3)(["a"], ["1"])[0].tolist() == [0.0]  # a quick one is unaffected


def test_trl_signature_functions_get_keywords_and_none_means_no_opinion(user_module):
    import importlib

    module = importlib.import_module(user_module)
    reward_fn = build_reward_fn(["format", f"{user_module}:trl_reward", f"{user_module}:trl_kwargs_only",
                                 f"{user_module}:none_reward"], [1.0, 0.5, 2.0, 3.0])
    assert reward_fn.trl_form == (False, True, True, False) and reward_fn.needs_prompts
    completions = ["<think></think><answer>7</answer>", "skip", "7x"]
    total, terms = reward_fn(completions, ["7", "8", "7"], prompts=["p0", "p1", "p2"],
                             completion_ids=[[1], [2], [3]], difficulty=[1, 2, 3])
    assert module.SEEN == {"prompts": ["p0", "p1", "p2"], "completions": completions, "solution": ["7", "8", "7"],
                           "completion_ids": [[1], [2], [3]], "difficulty": [1, 2, 3]}
    # format: 1, 0, 0; trl_reward: len or None; kwargs_only: solution in completion; none_reward: no opinion at all
    np.testing.assert_allclose(total, [1 + 0.5 * len(completions[0]) + 2, 0 + 0 + 0, 0 + 0.5 * 2 + 2], rtol=1e-6)
    assert np.isnan(terms[f"{user_module}:trl_reward"][1]) and np.isnan(terms[f"{user_module}:none_reward"]).all()
    # a sample no function has an opinion on gets 0 (TRL's nansum)
    only_none = build_reward_fn([f"{user_module}:none_reward"])
    np.testing.assert_array_equal(only_none(["a"], ["1"])[0], [0.0])


def test_user_function_resolution_errors(user_module, tmp_path):
    """Every way a function can fail to load is one RewardError line, whatever its module raises on import."""
    (tmp_path / "mindrlhf_test_syntax.py").write_text("def fn(completions, solutions)\n    return []\n")
    (tmp_path / "mindrlhf_test_raises.py").write_text("import os\nos.environ['MINDRLHF_NO_SUCH_KEY']\n")
    cases = [
        ("no_such_pkg_xyz.rewards:fn", r"cannot import module 'no_such_pkg_xyz.rewards'"),
        (f"{user_module}:missing", f"'{user_module}:missing'.*has no attribute 'missing'"),
        (f"{user_module}:NOT_A_FUNCTION", f"'{user_module}:NOT_A_FUNCTION' is not callable"),
        (f"{user_module}:", "must look like 'package.module:function'"),
        ("mindrlhf_test_syntax:fn", r"importing module 'mindrlhf_test_syntax': .*mindrlhf_test_syntax.py:1: "
                                    r"SyntaxError: expected ':'$"),
        ("mindrlhf_test_raises:fn", r"importing module 'mindrlhf_test_raises' raised KeyError: "
                                    r"'MINDRLHF_NO_SUCH_KEY' at .*mindrlhf_test_raises.py:2$"),
    ]
    for path, message in cases:
        with pytest.raises(RewardError, match=message) as info:
            build_reward_fn([path])
        assert len(str(info.value).splitlines()) == 1, info.value
