"""The built-in `calculator` tool: an arithmetic expression evaluated from its syntax tree (numbers, + - * / // %
**, unary signs, parentheses), never by `eval`; powers and results are bounded so that no call runs away."""
from __future__ import annotations

import ast
import operator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10 ** 30
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of `expression`; ValueError (a message for the model) for anything else than bounded arithmetic."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _bounded(value):
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if not abs(value) <= MAX_MAGNITUDE:  # `not <=` catches nan
        raise ValueError("the result is out of range")
    return value


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is out of range") from None
        return _bounded(result)
    raise ValueError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns its value.

    Args:
        expression: An arithmetic expression of numbers with + - * / // % ** and parentheses, e.g. "(37 + 5) * 12".

    Returns:
        The value, or an error message.
    """
    try:
        value = evaluate_arithmetic(expression)
    except ValueError as err:
        return f"error: {err}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
