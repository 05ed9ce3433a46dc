"""`python -m ftrun` runs the command line."""

from ftrun.cli import main

main()
