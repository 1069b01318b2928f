"""The benchmark suites, one module each, each defining `SUITE` (`common.Suite`).

The shared suites are named in `sparseprefill.bench.SUITES`; a module named after a
registered method is that method's own suite (`sparseprefill bench <method>`), found by
its name: a method without one gets the `methods` suite's rows for it alone.
"""
