"""The error the CLI shows as one line with no traceback: a mistake the user can fix.

Here, not in agent/cli.py, so a module that serves a command (agent/jobdata.py) raises it without
importing the CLI (issue 23); agent/cli.py names it among the user errors it prints as one line.
"""


class UserError(Exception):
    """A mistake the user can fix; the message is the one line to show."""
