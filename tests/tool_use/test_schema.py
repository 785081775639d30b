"""A tool's JSON schema from its type hints and docstring equals transformers' get_json_schema; what cannot be
described is refused naming the tool and the parameter."""
import enum
from typing import Any, Literal, Optional, Union

import pytest

from mindrlhf.tool_use import ToolDefinitionError, calculator, function_schema


class Unit(enum.Enum):
    CELSIUS = "celsius"
    KELVIN = "kelvin"


def get_weather(city: str, days: int = 1, unit: Unit = Unit.CELSIUS, hourly: bool = False) -> dict[str, float]:
    """Gets the weather forecast of a city.

    Longer text that stays in the description.

    Args:
        city: The city, e.g. "Paris".
        days: How many days ahead,
            counted from today.
        unit: The temperature unit.
        hourly: Whether to give every hour.

    Returns:
        The forecast by day.
    """
    return {}


# typing's spellings on purpose: the schema reads them as it reads `X | None`
def search(query: str, filters: Optional[list[str]] = None, limit: Union[int, float] = 10,  # noqa: UP007, UP045
           mode: Literal["fast", "exact"] = "fast", extra: Any = None, pair: tuple[int, str] = (1, "a"),
           weights: dict[str, int] | None = None, either: list[int] | str = "") -> None:
    """Searches the index.

    Args:
        query: What to look for.
        filters: Tags the results must carry.
        limit: The most results.
        mode: How to match (choices: ["fast", "exact"])
        extra: Anything else.
        pair: A pair.
        weights: Field weights.
        either: Ids or a name.
    """


class Index:
    def lookup(self, key: str) -> str:
        """Looks a key up.

        Args:
            key: The key.
        """
        return key


@pytest.mark.parametrize("fn", [get_weather, search, calculator, Index().lookup, Index.lookup],
                         ids=["hints-and-enum", "unions-literal-choices", "calculator", "method", "unbound-method"])
def test_the_schema_is_transformers_one(fn):
    from transformers.utils import get_json_schema

    assert function_schema(fn) == get_json_schema(fn)


def test_a_tool_that_cannot_be_described_is_refused_with_its_name_and_parameter():
    def no_doc(x: int):
        return x

    def no_hint(x):
        """Does.

        Args:
            x: A value.
        """

    def undocumented(x: int, y: int):
        """Does.

        Args:
            x: A value.
        """

    def custom(x: Index):
        """Does.

        Args:
            x: A value.
        """

    cases = {no_doc: "tool no_doc: no docstring", no_hint: "tool no_hint: parameter 'x' has no type hint",
             undocumented: "tool undocumented: the docstring's Args: block does not describe parameter 'y'",
             custom: "tool custom: type hint"}
    for fn, message in cases.items():
        with pytest.raises(ToolDefinitionError) as err:
            function_schema(fn)
        assert str(err.value).startswith(message)
