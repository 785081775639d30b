"""The accuracy reward's check by meaning (math-verify) of non-numeric gold answers: equal and unequal pairs, the
numeric path left as it was, malformed LaTeX, the per-answer time limit and its count, threads and processes."""
import json
import sys
import threading
import time
from functools import partial

import math_verify
import pytest
from support import paths
from support.msrun import run_command

from mindrlhf.data.answers import answers_match, extract_completion_answer, extract_gold_answer
from mindrlhf.reward.rules import accuracy_reward, take_answer_check_timeouts
from mindrlhf.utils.deadline import TimeLimitExceeded, call_with_time_limit

# (completion, solution, expected reward, kind)
MEANING_CASES = [
    # the three cases
    ("\\boxed{2\\sqrt{3}}", "\\boxed{\\sqrt{12}}", 1.0, "root: 2 sqrt 3 == sqrt 12"),
    ("\\boxed{\\frac{\\pi}{2}}", "\\boxed{\\pi/2}", 1.0, "pi: frac == slash"),
    ("\\boxed{(1, 2)}", "\\boxed{(1,2)}", 1.0, "tuple: spacing"),
    # roots
    ("<answer>2\\sqrt{3}</answer>", "\\boxed{\\sqrt{12}}", 1.0, "root in the answer tag, no $"),
    ("<answer>\\sqrt{13}</answer>", "\\boxed{\\sqrt{12}}", 0.0, "root: sqrt 13 != sqrt 12"),
    ("The answer is $\\frac{\\sqrt{3}}{2}$.", "so $\\boxed{\\dfrac{\\sqrt3}{2}}$", 1.0, "root: anchored $...$"),
    ("<answer>2\\sqrt{2}</answer>", "\\boxed{3\\sqrt{2}}", 0.0, "root: 2 sqrt 2 != 3 sqrt 2"),
    # pi
    ("<answer>$\\frac{\\pi}{2}$</answer>", "\\boxed{\\pi/2}", 1.0, "pi: $ inside the tag"),
    ("<answer>\\pi</answer>", "\\boxed{\\pi/2}", 0.0, "pi: pi != pi/2"),
    ("<answer>2\\pi r</answer>", "\\boxed{2 \\pi r}", 1.0, "pi: with a variable"),
    # fractions
    ("<answer>\\frac{x}{2}</answer>", "\\boxed{\\dfrac{x}{2}}", 1.0, "fraction: frac == dfrac"),
    ("<answer>\\frac{2}{x}</answer>", "\\boxed{\\dfrac{x}{2}}", 0.0, "fraction: inverted"),
    # tuples
    ("<answer>(2, 1)</answer>", "\\boxed{(1,2)}", 0.0, "tuple: order matters"),
    ("<answer>(3, -1, 2)</answer>", "\\boxed{(3,-1,2)}", 1.0, "tuple: three entries"),
    # intervals
    ("<answer>[1, 2)</answer>", "\\boxed{[1,2)}", 1.0, "interval: half open"),
    ("<answer>[1, 2]</answer>", "\\boxed{[1,2)}", 0.0, "interval: closed != half open"),
    ("<answer>(-\\infty, 0) \\cup (1, \\infty)</answer>", "\\boxed{(-\\infty,0)\\cup(1,\\infty)}", 1.0,
     "interval: union"),
    # sets
    ("<answer>\\{3, 2, 1\\}</answer>", "\\boxed{\\{1,2,3\\}}", 1.0, "set: order does not matter"),
    ("<answer>\\{1, 2\\}</answer>", "\\boxed{\\{1,2,3\\}}", 0.0, "set: missing element"),
    ("<answer>3, 1, 2</answer>", "\\boxed{1, 2, 3}", 1.0, "set: a list of solutions"),
    # polynomials and expressions
    ("<answer>x^2+2x+1</answer>", "\\boxed{(x+1)^2}", 1.0, "polynomial: expanded == factored"),
    ("<answer>x^2+2x</answer>", "\\boxed{(x+1)^2}", 0.0, "polynomial: different"),
    ("<answer>3+2x</answer>", "\\boxed{2x+3}", 1.0, "expression: commuted"),
    ("<answer>2y+3</answer>", "\\boxed{2x+3}", 0.0, "expression: another variable"),
    ("<answer>y = 2x+3</answer>", "\\boxed{2x+3}", 1.0, "expression: an assignment"),
    ("<answer>x + 1</answer>", "x + 1", 1.0, "expression: a bare gold"),
    ("<answer>1</answer>", "x + 1", 0.0, "expression: a number is not x + 1"),
    # where the answer is read
    ("#### \\frac{\\pi}{2}", "\\boxed{\\frac{\\pi}{2}}", 1.0, "the #### line of a completion"),
    ("\\boxed{\\sqrt{12}} so the tag says <answer>\\sqrt{13}</answer>", "\\boxed{\\sqrt{12}}", 0.0,
     "the answer tag is authoritative"),
    ("\\boxed{\\sqrt{13}} no, \\boxed{2\\sqrt{3}}", "\\boxed{\\sqrt{12}}", 1.0, "the last boxed"),
    ("no formula at all", "\\boxed{\\frac{\\pi}{2}}", 0.0, "no answer in the completion"),
    ("<answer>\\text{(C)}</answer>", "\\boxed{\\text{(C)}}", 1.0, "a multiple-choice letter"),
]

# (completion, solution, today's reward): numeric golds (GSM8K, numeric \boxed{}) keep the numeric path
NUMERIC_CASES = [
    ("<answer>72</answer>", "48 + 24 = 72\n#### 72", 1.0),
    ("<answer>71</answer>", "48 + 24 = 72\n#### 72", 0.0),
    ("The total is 72.", "#### 72", 1.0),
    ("<answer>1,000</answer>", "#### 1000", 1.0),
    ("<answer>0.5</answer>", "\\boxed{\\dfrac{1}{2}}", 1.0),
    ("<answer>\\frac{2}{4}</answer>", "\\boxed{\\frac{1}{2}}", 1.0),
    ("<answer>\\boxed{2 \\cdot 3}</answer>", "#### 6", 0.0),  # a formula is not evaluated on the numeric path
    ("#### 2\n#### 72", "#### 72", 0.0),
    ("<answer>25%</answer>", "#### 0.25", 0.0),
]

MALFORMED = ["<answer>\\frac{1}{2</answer>", "\\boxed{2\\sqrt{3}", "<answer>}{$$\\\\</answer>", "<answer>$</answer>",
             "<answer>\\left( x + 1</answer>", "<answer>\\sqrt</answer>", "<answer>^^_</answer>"]


@pytest.fixture(autouse=True)
def no_timeouts_left_over():
    take_answer_check_timeouts()
    yield
    take_answer_check_timeouts()


@pytest.mark.parametrize("completion,solution,expected,kind", MEANING_CASES, ids=[c[3] for c in MEANING_CASES])
def test_answer_by_meaning(completion, solution, expected, kind):
    assert accuracy_reward([completion], [solution]) == [expected], kind


def test_the_table_has_both_verdicts_for_each_kind():
    kinds = {}
    for _, _, expected, kind in MEANING_CASES:
        kinds.setdefault(kind.split(":")[0], set()).add(expected)
    for kind in ("root", "pi", "fraction", "tuple", "interval", "set", "polynomial", "expression"):
        assert kinds[kind] == {0.0, 1.0}, kind
    assert len(MEANING_CASES) >= 22


@pytest.mark.parametrize("completion,solution,expected", NUMERIC_CASES)
def test_numeric_golds_keep_the_numeric_path(monkeypatch, completion, solution, expected):
    def no_math_verify(*args, **kwargs):
        raise AssertionError("a numeric gold reached math-verify")

    monkeypatch.setattr(math_verify, "parse", no_math_verify)
    assert extract_gold_answer(solution) is not None
    assert accuracy_reward([completion], [solution]) == [expected]
    assert expected == float(answers_match(extract_completion_answer(completion), extract_gold_answer(solution)))


def test_one_call_mixes_numeric_and_latex_golds():
    completions = ["<answer>72</answer>", "<answer>2\\sqrt{3}</answer>", "<answer>71</answer>", "\\boxed{(2, 1)}"]
    solutions = ["#### 72", "\\boxed{\\sqrt{12}}", "#### 72", "$\\boxed{(1, 2)}$"]
    assert accuracy_reward(completions, solutions) == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("completion", MALFORMED)
def test_a_malformed_answer_scores_zero(completion):
    assert accuracy_reward([completion], ["\\boxed{\\sqrt{12}}"]) == [0.0]
    assert take_answer_check_timeouts() == 0


MALFORMED_GOLDS = ["\\boxed{\\frac{1}{}", "\\boxed{\\sqrt{}}", "\\boxed{)(}", "\\boxed{\\frac{1}{2}"]


@pytest.mark.parametrize("solution", MALFORMED_GOLDS)
def test_a_malformed_gold_scores_zero(solution):
    assert accuracy_reward(["<answer>2\\sqrt{3}</answer>", "\\boxed{\\frac12}"], [solution] * 2) == [0.0, 0.0]


def slow(seconds, real):
    def call(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)
    return call


def test_a_slow_check_times_out_scores_zero_and_is_counted(monkeypatch):
    monkeypatch.setattr(math_verify, "verify", slow(30, math_verify.verify))
    started = time.monotonic()
    rewards = accuracy_reward(["\\boxed{2\\sqrt{3}}", "<answer>72</answer>", "\\boxed{\\sqrt{12}}"],
                              ["\\boxed{\\sqrt{12}}", "#### 72", "\\boxed{\\sqrt{12}}"], answer_time_limit=0.2)
    assert rewards == [0.0, 1.0, 0.0]  # the numeric gold never reaches math-verify
    assert time.monotonic() - started < 3
    assert take_answer_check_timeouts() == 2
    assert take_answer_check_timeouts() == 0  # taken: reset


def test_a_gold_whose_parse_times_out_fails_its_answers_at_once(monkeypatch):
    real_parse = math_verify.parse

    def parse_slow_gold(text, **kwargs):
        if "12" in text:
            time.sleep(30)
        return real_parse(text, **kwargs)

    monkeypatch.setattr(math_verify, "parse", parse_slow_gold)
    started = time.monotonic()
    assert accuracy_reward(["\\boxed{2\\sqrt{3}}"] * 3, ["\\boxed{\\sqrt{12}}"] * 3, answer_time_limit=0.3) == [0.0] * 3
    assert time.monotonic() - started < 1.5  # one limit, not three
    assert take_answer_check_timeouts() == 3


def test_an_outer_limit_reaches_its_caller_uncounted(monkeypatch):
    """The reward function's own limit (the registry's) passing inside an answer's check is not that answer's."""
    monkeypatch.setattr(math_verify, "verify", slow(30, math_verify.verify))
    call = partial(accuracy_reward, ["\\boxed{2\\sqrt{3}}"], ["\\boxed{\\sqrt{12}}"], answer_time_limit=10)
    with pytest.raises(TimeLimitExceeded):
        call_with_time_limit(call, 0.2)
    assert take_answer_check_timeouts() == 0


def run_in_thread(fn, *args, **kwargs):
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=fn(*args, **kwargs)))
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    return result.get("value")


def test_checks_work_in_another_thread_unbounded_there(monkeypatch):
    completions = [case[0] for case in MEANING_CASES]
    solutions = [case[1] for case in MEANING_CASES]
    assert run_in_thread(accuracy_reward, completions, solutions) == [case[2] for case in MEANING_CASES]
    # no signal reaches the thread: its checks run to the end, past the limit, and none is counted
    monkeypatch.setattr(math_verify, "verify", slow(0.3, math_verify.verify))
    assert run_in_thread(accuracy_reward, ["\\boxed{2\\sqrt{3}}"], ["\\boxed{\\sqrt{12}}"],
                         answer_time_limit=0.05) == [1.0]
    assert take_answer_check_timeouts() == 0


SPAWNED_POOL = """
import json, multiprocessing, sys
from mindrlhf.reward.rules import accuracy_reward
if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(json.dumps(pool.starmap(accuracy_reward, json.loads(sys.argv[1]))))
"""


def test_checks_work_in_a_spawned_pool_worker():
    """In a process of its own (the pool's resource tracker ends with it): a spawn pool worker imports and checks."""
    cases = MEANING_CASES[:6]
    calls = [[[c[0] for c in cases], [c[1] for c in cases]]]
    done = run_command([sys.executable, "-c", SPAWNED_POOL, json.dumps(calls)], cwd=str(paths.ROOT), timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[c[2] for c in cases]]
