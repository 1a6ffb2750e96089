"""kvtier's tools, kept apart from the runtime they drive: the ``kvtier``
command (``cli``) and what it runs — ``demo``, ``replay``, ``stress``,
``bench`` — with their helpers: ``trace`` (reading Mooncake-format traces),
``content`` (the deterministic page-content patterns the tools and tests
write and verify), ``oracle`` (the bare LRU references the benchmarks compare
against) and ``data/`` (the bundled synthetic trace slice the demo replays).

Nothing in the runtime imports this package."""
