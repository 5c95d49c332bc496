"""The ``ov-kvcrush`` command line: the parser and the commands (:mod:`~ov_kvcrush.cli.main`),
the flags' value converters (:mod:`~ov_kvcrush.cli.values`), and one module per command that
does more than call the library: ``bench``, ``inspect``, ``chat``, ``demo``, and the set-up's
environment check (``python -m ov_kvcrush.cli.envcheck``).

It sits on top of everything else: nothing in the package imports it.
"""
