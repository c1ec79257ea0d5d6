"""Whether this Python process runs a script file it could start again, or an interactive session."""

from __future__ import annotations


def is_interactive() -> bool:
    """Whether there is no script file to start again: a notebook, a REPL, ``python -c`` or a script read
    from stdin (``python - < train.py``, whose stdin is used up, so a re-run would run nothing)."""
    import __main__

    if getattr(__main__, "__spec__", None) is not None:
        return False
    return getattr(__main__, "__file__", "<stdin>") == "<stdin>"
