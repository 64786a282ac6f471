"""``refinery verify``: a lake compared with the simulator's ground truth of the same run.

:mod:`.data` counts samples, events and collectives lost, duplicated and made up, how far
each one's aligned time lies from its true time against its own stated bound, and how tight
those bounds are;
:mod:`.alerts` scores every alert and episode (every rule of the rule file) against the
injected incidents and the pipeline's own measured lag; :mod:`.verdict` holds the goals and
renders the report. ``refinery demo`` runs the same check at its end.
"""
