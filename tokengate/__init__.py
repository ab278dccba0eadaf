"""The ``tokengate`` command: it dispatches to the command line of each program's package."""
