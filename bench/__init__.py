"""kvtier's benchmarks, a package in the shape of ``vllm/benchmarks``, installed with kvtier as
``kvtier.bench`` (``setup.py`` maps this folder there): run each as a file, ``python
bench/ttft.py --quick``, or as a module, ``python -m bench.ttft --quick`` from the repository
root (``python -m kvtier.bench.ttft`` anywhere). Benchmarks import each other as
``kvtier.bench.*``, so neither way edits ``sys.path``.

* ``bench/lib/``: what several benchmarks share — servers (``peers``: ``kvtier serve``,
  Redis; ``vllm_peer``, ``serve_systems``), clients (``serve_client``), workloads
  (``serve_workloads``, ``serve_calibrate``), statistics and metrics (``serve_stats``,
  ``serve_metrics``), tables and JSON lines (``common``, ``serve_report``), plots (``plot``).
* ``bench/fleet/``: the fleet simulation's model (its router is ``kvtier router``'s own).
* one module per benchmark: ``ttft``, ``vllm``, ``serve`` (and ``serve_router``,
  ``serve_profile``), ``engine``, ``engine_probes``, ``kernels``, ``keys``, ``store``,
  ``tier_load``, ``soak``, ``provenance``, ``verify_drift``, ``fleet_sim``, ``fleet_calibrate``.

Each prints a table, then one JSON object as its last line; ``bench/RESULTS.md`` records
the figures with their commands.
"""
