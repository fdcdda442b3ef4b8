"""The ``kvstrata`` command line (click): ``replay`` (the main job), ``master`` (a local Mooncake
cluster in the foreground) and ``bench`` (the benchmark scripts behind one command).

Every command reports a failure as one line on stderr and a non-zero exit status, never a traceback
(:func:`kvstrata.impl.cli.main.main`); ``KVSTRATA_DEBUG=1`` adds the traceback.
"""
