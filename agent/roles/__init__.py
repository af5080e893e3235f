"""The roles an agent plays in a job: submitter, worker, coordinator (and every peer's mirror).

Roles never decide protocol questions: they feed events into protocol/state.py and carry out the
actions it returns. protocol/mirror.py's ``JobMirror`` is the mirror every peer keeps of each job it
follows (the agent commits its outcomes: agent/evidence.py ``Evidence.commit``); ``coordinator``, ``worker`` and ``submitter`` do the I/O for their role.
"""
