"""StopChecker: a stop string cuts the reply where the earliest one starts, names the string
that matched, and holds back text that may still become one."""

from __future__ import annotations

from keepwarm.engine.generation.stopping import StopChecker, find_stop


class Chars:
    """A text stream whose token ids are character codes."""

    def push(self, token: int) -> str:
        return chr(token)

    def flush(self) -> str:
        return ""


def _run(text: str, stop: list[str]) -> tuple[str, str, str | None, bool]:
    checker = StopChecker(Chars(), stop, {0})
    streamed, stopped = "", False
    for ch in text:
        out, stopped = checker.push(ord(ch))
        streamed += out
        if stopped:
            break
    streamed += checker.finish(flush=not stopped)
    return streamed, checker.text, checker.matched, stopped


def test_the_earliest_stop_string_wins_and_is_named() -> None:
    assert _run("the cat sat on the mat", ["mat", "sat"]) == ("the cat ", "the cat ", "sat", True)
    # two stops starting at one place: the first listed is named
    assert find_stop("abcdef", ["cde", "cd"], 0) == (2, "cde")
    assert find_stop("abcdef", ["cd", "cde"], 0) == (2, "cd")
    assert find_stop("abcdef", ["xyz"], 0) is None


def test_no_stop_string_names_none() -> None:
    assert _run("hello", ["xyz"]) == ("hello", "hello", None, False)
    checker = StopChecker(Chars(), ["x"], {0})
    assert checker.push(0) == ("", True)  # a stop token ends the reply without a stop string
    assert checker.matched is None
