"""The calculator the model may call (agent.tools in config.yaml)."""


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)
