"""Errors meant for the user: one line that says what went wrong and what to
do next. The command-line entry points print them without a traceback."""


class StreamingError(Exception):
    """Base class of every error this package reports to the user. Its
    message is one line by construction, whatever it quotes."""

    def __str__(self) -> str:
        return " ".join(super().__str__().split())


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type when empty), for
    one-line errors that quote another library's."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class FormatError(StreamingError):
    """A stream directory is missing, incomplete or of an unknown version."""


class CorruptExpertError(FormatError):
    """An expert record is truncated or fails its checksum."""

    def __init__(self, layer: int, expert: int, what: str,
                 advice: str = "re-convert the model"):
        self.layer = layer
        self.expert = expert
        # Without the pointer to `check`, for `check` itself to print.
        self.brief = f"layer {layer}, expert {expert}: {what}; {advice}"
        super().__init__(f"{self.brief} (`mlx_streaming check DIR` lists every damaged record)")


class ExpertReadError(StreamingError):
    """Reading expert bytes from disk failed."""


class BudgetError(StreamingError):
    """The expert cache budget cannot hold what one call needs, or asks for
    more memory than the machine has."""


class ConfigError(StreamingError, ValueError):
    """An option of ``load()`` or a command-line flag is out of range."""


class ConversionError(StreamingError):
    """A model cannot be converted to a stream directory."""


class RankError(StreamingError):
    """A model split over ranks lost one of them (it died, was killed, or
    stopped answering)."""
