"""Attaching to engines: the Lab facade (remote calls, failure triage, recovery) and the launchers."""
