"""The Tinker training API served locally over polyrl's model, learner pieces and engine (``polyrl serve MODEL
--tinker``), so the official ``tinker`` client and the Tinker cookbook's recipes train on this machine.
docs/tinker.md lists the calls and what is refused."""
