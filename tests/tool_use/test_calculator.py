"""The built-in calculator: arithmetic from the syntax tree, anything else an error text for the model."""
import pytest

from mindrlhf.tool_use import calculator, evaluate_arithmetic


@pytest.mark.parametrize("expression, value", [
    ("(37 + 5) * 12", "504"), ("7 / 2", "3.5"), ("8 / 4", "2"), ("17 // 5", "3"), ("17 % 5", "2"),
    ("-(3 - 5)", "2"), ("2 ** 10", "1024"), ("2 ** -2", "0.25"), (" 1234 * 5678 ", "7006652"), ("1.5e3 + 1", "1501"),
])
def test_arithmetic_gives_its_value(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "unsupported in an arithmetic expression: \"__import__('os').system('true')\""),
    ("a + 1", "unsupported in an arithmetic expression: 'a'"), ("True + 1", "unsupported in an arithmetic "
                                                                        "expression: 'True'"),
    ("[1, 2]", "unsupported in an arithmetic expression: '[1, 2]'"), ("3 +", "not an arithmetic expression: '3 +'"),
    ("1 / 0", "division by zero"), ("2 ** 1000", "exponent 1000 is larger than 64"),
    ("1e308 ** 2", "the result is out of range"), ("1e400", "the result is out of range"),
    ("(-8) ** 0.5", "the result is not a real number"), ("9" * 201, "the expression is longer than 200 characters"),
])
def test_anything_else_is_an_error_text_not_an_exception(expression, message):
    assert calculator(expression) == f"error: {message}"
    with pytest.raises(ValueError):
        evaluate_arithmetic(expression)
