"""The planner on the lab's own machine: a :class:`~.machine.Machine` of measured physical
numbers (:mod:`.measure`), any model's step counted (:mod:`.work`) and its pieces timed
(:mod:`.profile`), each rank's step built as programs axis by axis (:mod:`.programs`, as
``parallel/`` runs them) and priced (:mod:`.price`) on the event-driven core the lab's replays
run on (:mod:`labkit.analysis.des`); :mod:`.physical` puts these together as ``simulate``."""
