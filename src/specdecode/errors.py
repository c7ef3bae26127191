"""One error type for bad input: a ValueError whose message names the problem and the fix."""


class SpecDecodeError(ValueError):
    """Raised for invalid user input; the CLI prints its message on one line and exits with 2."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise SpecDecodeError(message)
