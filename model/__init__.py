"""kvstrata.model: the pure reference model of kvstrata (SPEC §7).

Attrs classes and pure functions only: no torch, no threads, no I/O, no wall clock (a step counter
instead). The implementation in ``kvstrata.impl`` is held to this model by differential stateful tests;
a behaviour change starts here.
"""
