"""Tools for `rollout.tools=examples/tools.py:multiply,add`: plain functions with type hints and a docstring,
written as TRL's GRPOTrainer takes them (`GRPOTrainer(..., tools=[multiply, add])`); gspo runs them unchanged."""


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b
