"""The operations around a run, apart from its step: metrics and trackers, goodput, faults and
stragglers, the run-directory lock, the checkpoint library's log, observing and plotting a run,
and the XLA environment the entry points set. Below `trainer`; imports only `configs` and `sharding`."""
