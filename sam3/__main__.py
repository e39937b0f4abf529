"""`python -m sam3`: the `sam3` command.

A Ctrl-C while `sam3.cli` itself is imported (before `main` can guard anything) ends as one during a command
does: the line `sam3 COMMAND: interrupted`, exit 130 (docs/sam3-cli.md "Hostile text").
"""

try:
    import sys

    from sam3.cli import main
except KeyboardInterrupt:
    from sam3.cli import interrupted  # imported again: the interrupted import left nothing behind

    raise SystemExit(interrupted()) from None

sys.exit(main())
