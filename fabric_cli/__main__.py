"""``python -m fabric_cli``: the same as the ``fabric`` command."""

from fabric_cli.cli import main

if __name__ == "__main__":
    main()
