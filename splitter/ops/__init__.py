"""What a split graph's nodes call beyond aten: the markers the runtime binds
(cache ops, collectives, the workers' all-reduce) and the kernels nodes run
(bag kernels, row-wise sparse updates). Both the modes that put them in the
graph and the runtime that runs it import them from here."""
