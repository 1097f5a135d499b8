"""Benchmarks a notebook runs on the lab: the communication sweep (:mod:`.sweep`, as
nccl-tests measures), gradient compression's accuracy against bytes (:mod:`.tradeoff`) and
loss curves per compression and precision (:mod:`.curves`, imported where used).

    >>> sweep = labkit.bench.comm_sweep(lab)                  # a few seconds on local CPU engines
    >>> print(sweep.table()); sweep.fit(); sweep.plot()
    $ labkit bench comm --engines 4 --max-mb 16 --plot comm.png
"""
from .sweep import (BUS_FACTORS, COLLECTIVES, DEFAULT_MAX_BYTES, DEFAULT_SIZES, Sweep, bus_factor,  # noqa: F401
                    comm_sweep, fit_alpha_beta, sweep_on_engine)
from .tradeoff import DEFAULT_TRADEOFF, compression_tradeoff, plot_tradeoff  # noqa: F401
